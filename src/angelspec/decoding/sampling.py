"""Token sampling and speculative-verification math: small pure functions, explicit randomness.

Everything that turns target / draft distributions into emitted tokens lives here:

* `SamplingParams` / `BatchSampling`: per-request temperature, top-k, top-p, seed and their [B] tensors.
* `process_logits`: temperature -> top-k -> top-p, batched with per-row parameters.
* `uniform_noise` / `exponential_noise` / `sample`: counter-based randomness (see "Randomness" below).
* `verify_greedy` / `verify_speculative` / `verify_deterministic`: batched acceptance with one output
  contract, `tokens [B, K+1]` padded with `PLACEHOLDER_TOKEN_ID` and `num_accepted [B]`.

Each batched function has a slow `_reference_*` twin written as plain loops, and the tests check that the
two agree exactly given the same noise. Nothing on the fast paths calls `.item()`, indexes with a
data-dependent shape or loops over rows in Python, so a decode step built on them has no host syncs.

Shape legend: B batch, K draft depth, V vocab.

Randomness
----------
A request's random numbers are a pure function of a key, never of a generator's hidden state:

    uniform_noise(seeds, counters, stream, V)[b, i] = splitmix64-hash(seed_b, counter_b, stream, i) -> (0, 1)

so (a) output is reproducible from the request seed, (b) a request draws the same numbers alone or in any
batch at any row, and (c) noise for a whole batch costs a few elementwise int64 ops, with no per-row
generators and no syncs. Tokens are drawn from float32 exponentials `exponential_noise` = -log(u) of the same
hash (u on the exact float32 grid (k + 0.5)·2^-23), so a [B, V] or [B, K, V] draw needs no float64 (slow on most
GPUs); the accept coins, [B, K] numbers, stay float64 `uniform_noise`. Keys used in this module and expected from
callers:

    stream               counter                                       consumed by
    NoiseStream.DRAFT    draft_noise_counter(position, draft_round)    the drafter sampling a draft token
    NoiseStream.ACCEPT   absolute position of the draft token          the accept coin of that draft
    NoiseStream.TARGET   absolute position of the emitted token        recovered / bonus / plain-decode sample

"Position" is the index, in the request's sequence, of the token being produced. Verification keys by
position alone because a position is verified at most once: the step that first verifies it commits it.
A position can be *drafted* in several rounds (drafted past a rejection, then drafted again), so draft
noise also carries the round. Reusing it would let a verification budget built from last round's sampled
drafts predict this round's draft, which is correctness trap 1 again (docs/design.md). Plain decoding with
`sample(probs, seeds, positions, NoiseStream.TARGET)` draws the same token as a depth-0 verify step.
"""

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

PLACEHOLDER_TOKEN_ID = -1
# Temperatures below this are greedy: dividing logits by ~1e-6 only risks overflow for no change in the
# argmax. Same cut-off as vLLM's _SAMPLING_EPS.
GREEDY_TEMPERATURE_EPS = 1e-5


class NoiseStream(IntEnum):
    """Independent noise streams of one request; see the module docstring for their counters."""

    DRAFT = 0
    ACCEPT = 1
    TARGET = 2


# ---------------------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SamplingParams:
    """Sampling parameters of one request. temperature 0 = greedy, top_k 0 and top_p 1 = disabled."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # any int, folded to 64 bits; None draws one when the batch is built

    def __post_init__(self) -> None:
        t, k, p, s = self.temperature, self.top_k, self.top_p, self.seed
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t!r}")
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = disabled), got {k!r}")
        if not _is_real(p) or not 0 < p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1] (1 = disabled), got {p!r}")
        if s is not None and (isinstance(s, bool) or not isinstance(s, int)):
            raise ValueError(f"seed must be an int or None, got {s!r}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def filters(self) -> bool:
        """Whether sampling this request applies a top-k or top-p cutoff (a greedy request never does)."""
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1)


def _is_real(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


@dataclass(frozen=True)
class BatchSampling:
    """`SamplingParams` of a batch as [B] tensors, ready for `process_logits` and the verifiers."""

    temperature: Tensor  # [B] float32
    top_k: Tensor  # [B] int64
    top_p: Tensor  # [B] float32
    seeds: Tensor  # [B] int64
    # Host-side: whether some sampled row may filter (top-k or top-p on). False lets `process_logits` skip its sort
    # (`filtering=False`); whoever changes the rows' parameters in place keeps it true to them (`SpecEngine` does).
    filtering: bool = True

    def __post_init__(self) -> None:
        _check_shape("seeds", self.seeds, "B", (None,))
        b = self.seeds.shape[0]
        for name in ("temperature", "top_k", "top_p"):
            _check_shape(name, getattr(self, name), "B", (b,))
        _check_integer("top_k", self.top_k)
        _check_integer("seeds", self.seeds)

    @classmethod
    def from_params(
        cls,
        params: Sequence[SamplingParams],
        *,
        device: torch.device | str | None = None,
        generator: torch.Generator | None = None,
    ) -> "BatchSampling":
        """Stack per-request params; rows with seed=None get a fresh seed from `generator` (CPU).

        A fresh seed per build is still lossless (all noise is then new), but a request that must be
        reproducible across steps should resolve its seed once, e.g. `dataclasses.replace(p, seed=...)`.
        """
        seeds = [p.seed if p.seed is not None else _random_seed(generator) for p in params]
        return cls(
            temperature=torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            seeds=torch.tensor([_wrap_int64(s) for s in seeds], dtype=torch.int64, device=device),
            filtering=any(p.filters for p in params),
        )

    @property
    def batch_size(self) -> int:
        return self.seeds.shape[0]

    def to(self, device: torch.device | str) -> "BatchSampling":
        return BatchSampling(*(t.to(device) for t in (self.temperature, self.top_k, self.top_p, self.seeds)),
                             filtering=self.filtering)


def _random_seed(generator: torch.Generator | None) -> int:
    # Host-side draw at batch-build time, never inside the decode step.
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def _wrap_int64(x: int) -> int:
    return (x + 2**63) % 2**64 - 2**63


# ---------------------------------------------------------------------------------------------------------
# Logit processing
# ---------------------------------------------------------------------------------------------------------


def process_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor, *,
                   filtering: bool = True) -> Tensor:
    """Temperature, then top-k, then top-p (nucleus) filtering with per-row parameters -> float32 probs.

    logits: [B, V] or [B, K, V]; the per-row parameters broadcast over K.
    temperature: [B] float; rows below GREEDY_TEMPERATURE_EPS get a one-hot at the argmax (ties -> lowest id).
    top_k: [B] int; keeps every token whose scaled logit >= the k-th largest, so ties at the boundary are
        all kept (the result does not depend on token ids). 0 or >= V disables it.
    top_p: [B] float in (0, 1]; keeps the smallest set of most likely tokens whose mass reaches top_p (again
        keeping ties with the last one kept); the argmax always survives. 1 disables it.

    filtering: False promises that no sampled row (temperature at or above the greedy threshold) filters: each has
        top_k 0 or >= V and top_p 1 (the caller knows it on the host: `BatchSampling.filtering`); the result is
        the same, without the sort. Not checked (that would read the parameters back: a device sync).

    Rows must have at least one finite logit. One descending sort per row serves both filters; that
    O(V log V) sort is the main cost (measured: docs/design.md §12) and is paid by every row of a batch in which
    some row filters, to keep shapes static.
    """
    if logits.dim() not in (2, 3):
        raise ValueError(f"logits must be [B, V] or [B, K, V], got shape {tuple(logits.shape)}")
    b, v = logits.shape[0], logits.shape[-1]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
        _check_shape(name, t, "B", (b,))
    _check_integer("top_k", top_k)
    row = (b,) + (1,) * (logits.dim() - 1)  # per-row parameters broadcast over K and V

    x = logits.float()
    greedy = (temperature < GREEDY_TEMPERATURE_EPS).view(row)
    x = x / torch.where(greedy, 1.0, temperature.float().view(row))
    if not filtering:  # no cutoff below the smallest logit: the filters below would mask nothing
        return torch.where(greedy, F.one_hot(greedy_argmax(x), v).to(torch.float32), torch.softmax(x, dim=-1))
    sorted_x = torch.sort(x, dim=-1, descending=True).values  # [..., V]

    k = top_k.view(row)
    k = torch.where((k <= 0) | (k > v), v, k).expand(*x.shape[:-1], 1)
    kth = sorted_x.gather(-1, k - 1)  # [..., 1] the k-th largest scaled logit
    sorted_x = sorted_x.masked_fill(sorted_x < kth, -math.inf)

    sorted_p = torch.softmax(sorted_x, dim=-1)
    mass_before = F.pad(torch.cumsum(sorted_p, dim=-1)[..., :-1], (1, 0))  # exclusive cumsum, [..., V]
    p = top_p.float().view(row)
    # top_p == 1 must keep everything: float32 cumsum can reach 1.0 before the tail tokens do.
    keep = (mass_before < p) | (p >= 1.0)  # a prefix of the sorted order; never empty (mass_before[0] = 0)
    last_kept = keep.sum(dim=-1, keepdim=True) - 1
    cutoff = torch.maximum(kth, sorted_x.gather(-1, last_kept))  # [..., 1]

    probs = torch.softmax(x.masked_fill(x < cutoff, -math.inf), dim=-1)
    one_hot = F.one_hot(greedy_argmax(x), v).to(probs.dtype)
    return torch.where(greedy, one_hot, probs)


def _reference_process_logits(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Slow twin of `process_logits`: one row at a time in float64 Python arithmetic."""
    flat = logits.float().reshape(logits.shape[0], -1, logits.shape[-1])  # [B, K or 1, V]
    out = torch.empty_like(flat)
    for b in range(flat.shape[0]):
        for j in range(flat.shape[1]):
            row = _reference_process_row(flat[b, j].tolist(), float(temperature[b]), int(top_k[b]), float(top_p[b]))
            out[b, j] = torch.tensor(row)
    return out.reshape(logits.shape)


def _reference_process_row(logits: list[float], temperature: float, top_k: int, top_p: float) -> list[float]:
    v = len(logits)
    if temperature < GREEDY_TEMPERATURE_EPS:
        best = max(range(v), key=lambda i: (logits[i], -i))
        return [1.0 if i == best else 0.0 for i in range(v)]
    scaled = [x / temperature for x in logits]
    keep = [True] * v
    if 0 < top_k < v:
        kth = sorted(scaled, reverse=True)[top_k - 1]
        keep = [s >= kth for s in scaled]
    probs = _normalised_exp(scaled, keep)
    if top_p < 1.0:
        mass, cutoff = 0.0, 0.0
        for i in sorted(range(v), key=lambda i: -probs[i]):
            if mass >= top_p:
                break
            cutoff = probs[i]
            mass += probs[i]
        keep = [keep[i] and probs[i] >= cutoff for i in range(v)]
        probs = _normalised_exp(scaled, keep)
    return probs


def _normalised_exp(scaled: list[float], keep: list[bool]) -> list[float]:
    top = max(s for s, k in zip(scaled, keep, strict=True) if k)
    weights = [math.exp(s - top) if k else 0.0 for s, k in zip(scaled, keep, strict=True)]
    total = sum(weights)
    return [w / total for w in weights]


# ---------------------------------------------------------------------------------------------------------
# Counter-based noise and sampling
# ---------------------------------------------------------------------------------------------------------

_U64 = 2**64 - 1
_GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, splitmix64's increment
_MUL1 = 0xBF58476D1CE4E5B9  # splitmix64 finaliser multipliers (Stafford's "Mix13")
_MUL2 = 0x94D049BB133111EB
_SEED_SALT = 0x5EED5A17C0FFEE11  # keeps seed 0 away from the hash's fixed point at 0
_UNIT_BITS = 52  # (bits + 0.5) * 2**-52 is exact in float64 and strictly inside (0, 1)
_EXP_BITS = 23  # (bits + 0.5) * 2**-23 is exact in float32 and strictly inside (0, 1)


def _signed(x: int) -> int:
    """The int64 with the same 64 bits as unsigned `x` (torch has no usable uint64 arithmetic)."""
    return _wrap_int64(x & _U64)


def _mix64(z: Tensor) -> Tensor:
    # splitmix64 finaliser, a bijection on 64 bits. int64 multiply wraps mod 2**64, which is what the hash
    # wants; `>>` on int64 is arithmetic, so masking off the sign-extended bits makes it a logical shift.
    z = (z ^ ((z >> 30) & (2**34 - 1))) * _signed(_MUL1)
    z = (z ^ ((z >> 27) & (2**37 - 1))) * _signed(_MUL2)
    return z ^ ((z >> 31) & (2**33 - 1))


def _mix64_(z: Tensor) -> Tensor:
    """`_mix64` in place, with one scratch buffer: the same numbers, without the ten temporaries of a [B, V] hash
    (measured: docs/design.md §12)."""
    t = torch.empty_like(z)
    for shift, mask, mul in ((30, 2**34 - 1, _MUL1), (27, 2**37 - 1, _MUL2), (31, 2**33 - 1, None)):
        torch.bitwise_right_shift(z, shift, out=t)
        z.bitwise_xor_(t.bitwise_and_(mask))
        if mul is not None:
            z.mul_(_signed(mul))
    return z


def uniform_noise(seeds: Tensor, counters: Tensor, stream: int, size: int) -> Tensor:
    """Uniforms in (0, 1) keyed by (seed, counter, stream, index): [B, size] or [B, K, size] float64.

    seeds: [B] int, one per request.
    counters: [B] or [B, K] int, e.g. absolute positions (see the module docstring for the keying).
    stream: a `NoiseStream` (any int in [0, 2**31)); streams of one key are independent.
    size: numbers per (row, counter), typically 1 (a coin) or V (a sample).

    The key is hashed once per (row, counter) and then, per index, by one splitmix64 step
    (state + (i+1)·golden, finalised), so the per-element cost is ~10 int64 ops plus a float64 convert.
    52 random bits per number; float64 because float32 cannot hold an exactly symmetric open-interval grid
    finer than 2**-23, and the int64 intermediate is as large anyway.
    """
    bits = _hash_bits(seeds, counters, stream, size).bitwise_right_shift_(64 - _UNIT_BITS)
    return bits.bitwise_and_(2**_UNIT_BITS - 1).double().add_(0.5).mul_(2.0**-_UNIT_BITS)


def exponential_noise(seeds: Tensor, counters: Tensor, stream: int, size: int) -> Tensor:
    """Exp(1) draws keyed like `uniform_noise` (same arguments): -log(u) in float32, [B, size] or [B, K, size].

    u takes the top 23 bits of the same hash as `uniform_noise`: (bits + 0.5)·2^-23, exact in float32 and
    strictly inside (0, 1), so the draws lie in [6e-8, 16.6] (the exponential's tail beyond 16.6 has mass 6e-8)
    and need no float64 anywhere.
    """
    bits = _hash_bits(seeds, counters, stream, size).bitwise_right_shift_(64 - _EXP_BITS)
    return bits.bitwise_and_(2**_EXP_BITS - 1).float().add_(0.5).mul_(2.0**-_EXP_BITS).log_().neg_()


def _hash_bits(seeds: Tensor, counters: Tensor, stream: int, size: int) -> Tensor:
    """The 64 hash bits of every (seed, counter, stream, index), as int64 [B, (K,) size] (`uniform_noise`)."""
    _check_shape("seeds", seeds, "B", (None,))
    b = seeds.shape[0]
    if counters.dim() not in (1, 2) or counters.shape[0] != b:
        raise ValueError(f"counters must be [B] or [B, K] with B = {b}, got shape {tuple(counters.shape)}")
    _check_integer("seeds", seeds)
    _check_integer("counters", counters)
    if not 0 <= int(stream) < 2**31:
        raise ValueError(f"stream must be in [0, 2**31), got {stream}")
    if size < 0:
        raise ValueError(f"size must be >= 0, got {size}")

    h = _mix64(seeds.long() ^ _signed(_SEED_SALT))  # [B]
    h = h.view((b,) + (1,) * (counters.dim() - 1))
    h = _mix64(h ^ counters.long())  # [B] or [B, K]
    h = _mix64(h + _signed((int(stream) + 1) * _GOLDEN))
    steps = torch.arange(1, size + 1, dtype=torch.int64, device=seeds.device) * _signed(_GOLDEN)  # [size]
    return _mix64_(h.unsqueeze(-1) + steps)  # [B, (K,) size]


def _reference_uniform_noise(seed: int, counter: int, stream: int, size: int, bits: int = _UNIT_BITS) -> list[float]:
    """Slow twin of `uniform_noise` for one key, in unsigned Python integers (`bits` = 23: the uniforms under
    `exponential_noise`)."""

    def mix(z: int) -> int:
        z &= _U64
        z = ((z ^ (z >> 30)) * _MUL1) & _U64
        z = ((z ^ (z >> 27)) * _MUL2) & _U64
        return z ^ (z >> 31)

    h = mix((seed & _U64) ^ _SEED_SALT)
    h = mix(h ^ (counter & _U64))
    h = mix(h + (stream + 1) * _GOLDEN)
    out = []
    for i in range(1, size + 1):
        z = mix(h + i * _GOLDEN)
        out.append(((z >> (64 - bits)) + 0.5) * 2.0**-bits)
    return out


def draft_noise_counter(positions: Tensor, draft_round: Tensor) -> Tensor:
    """Counter for `NoiseStream.DRAFT`: position in the low 32 bits, the request's draft round above.

    positions: [B] or [B, K] int, absolute positions of the draft tokens (< 2**32).
    draft_round: [B] int, how many draft rounds the request has run before this one.
    """
    _check_integer("positions", positions)
    _check_shape("draft_round", draft_round, "B", (positions.shape[0],))
    _check_integer("draft_round", draft_round)
    rounds = draft_round.long().view((-1,) + (1,) * (positions.dim() - 1))
    return positions.long() + (rounds << 32)


def sample(probs: Tensor, seeds: Tensor, counters: Tensor, stream: int) -> Tensor:
    """One token per row (and per draft position): [B] or [B, K] int64.

    probs: [B, V] or [B, K, V]; non-negative weights, need not be normalised; a one-hot row returns its id.
    seeds: [B] int. counters: probs.shape[:-1] int, one key per draw (never share a counter across K).
    stream: which `NoiseStream` to draw from.
    """
    if probs.dim() not in (2, 3):
        raise ValueError(f"probs must be [B, V] or [B, K, V], got shape {tuple(probs.shape)}")
    if counters.shape != probs.shape[:-1]:
        raise ValueError(
            f"counters must have shape probs.shape[:-1] = {tuple(probs.shape[:-1])}, got {tuple(counters.shape)}"
        )
    return _sample_from_exponentials(probs, exponential_noise(seeds, counters, stream, probs.shape[-1]))


def _sample_from_exponentials(weights: Tensor, e: Tensor) -> Tensor:
    # Exponential race: with E_i ~ Exp(1) i.i.d., P(argmax_i w_i / E_i = j) = w_j / sum(w), the Gumbel-max trick
    # without taking logs of the weights (gpt-fast). Needs no normalisation and no sync. The float32 draws (grid
    # 2^-23) tie two top scores with probability about 1e-7 per draw (the gap of the two largest is Exp(1) in log
    # space), far below what any sample size could detect.
    return torch.argmax(weights / e, dim=-1)


def _reference_sample_row(weights: Tensor, u: Tensor) -> int:
    """Slow twin of `_sample_from_exponentials` for one row: weights [V], uniforms u [V] (E = -log u; `sample`'s
    are `_reference_uniform_noise(..., bits=23)`)."""
    e = torch.log(u).neg().tolist()
    w = weights.double().tolist()
    best, best_score = 0, -math.inf
    for i in range(len(w)):
        score = w[i] / e[i]
        if score > best_score:  # strict: the first maximum wins, like torch.argmax
            best, best_score = i, score
    return best


def _reference_sample_with_generators(
    probs: Tensor, generators: Sequence[torch.Generator], num_samples: int = 1
) -> Tensor:
    """Classic per-row sampling with `torch.Generator`s: probs [B, V] -> [B, num_samples].

    Different noise from `sample`, same distribution; kept as an independent check of `sample`.
    """
    return torch.stack(
        [
            torch.multinomial(probs[b].double(), num_samples, replacement=True, generator=generators[b])
            for b in range(probs.shape[0])
        ]
    )


# ---------------------------------------------------------------------------------------------------------
# Verification
# ---------------------------------------------------------------------------------------------------------


class VerifyOutput(NamedTuple):
    tokens: Tensor  # [B, K+1] int64: accepted drafts, then one recovered/bonus token, then placeholders
    num_accepted: Tensor  # [B] int64 in [0, K]; the row emits num_accepted + 1 tokens

    @property
    def num_emitted(self) -> Tensor:  # [B]
        return self.num_accepted + 1


def greedy_argmax(x: Tensor) -> Tensor:
    """`x.argmax(dim=-1)` (ties -> the lowest index, a NaN counts as the maximum), computed as `x.max(-1).indices`,
    which returns the same index faster on CPU, a cost every greedy decode and verify step pays once over the whole
    vocabulary (numbers: docs/design.md §12)."""
    return x.max(dim=-1).indices


def verify_greedy(draft_tokens: Tensor, target: Tensor, depth: Tensor | None = None) -> VerifyOutput:
    """Greedy verification: accept drafts while they equal the target argmax, then emit the target argmax.

    draft_tokens: [B, K] int, draft token ids.
    target: [B, K+1, V], target logits or probs (any monotone transform); ties go to the lowest id.
    depth: [B] int, verify only the first depth_b <= K drafts (None = K); values are clamped to [0, K].

    Lossless by construction: every emitted token is the target argmax given the emitted prefix.
    """
    b, k = _check_drafts(draft_tokens)
    _check_shape("target", target, "B, K+1, V", (b, k + 1, None))
    return greedy_accept(draft_tokens, target, _resolve_depth(depth, b, k, draft_tokens.device))


def greedy_accept(draft_tokens: Tensor, target: Tensor, depth: Tensor) -> VerifyOutput:
    """`verify_greedy` without its argument checks, for a caller that built the arguments itself: draft_tokens
    [B, K] int, target [B, K+1, V], depth [B] int64 already in [0, K]. Only tensor ops, so it traces into one
    compiled graph with the verify forward that produced `target` (the engine's greedy verify step)."""
    k = draft_tokens.shape[1]
    best = greedy_argmax(target)  # [B, K+1]
    num_accepted = _accepted_prefix(draft_tokens == best[:, :k], depth)
    final = best.gather(1, num_accepted[:, None])[:, 0]  # [B]
    return _assemble(draft_tokens, num_accepted, final)


def verify_speculative(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    depth: Tensor | None,
    seeds: Tensor,
    counters: Tensor,
) -> VerifyOutput:
    """Speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
    Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

    draft_tokens: [B, K] int, draft x_j sampled from q_j (drafts past depth_b are ignored).
    draft_probs: [B, K, V], q_j, the distributions the drafts were sampled from.
    target_probs: [B, K+1, V], p_j, target distributions after `process_logits`; p_j is conditioned on
        the prefix plus drafts x_0..x_{j-1}.
    depth: [B] int or None, number of drafts to verify per row, clamped to [0, K]; None = K.
    seeds: [B] int, request seeds. counters: [B] int, absolute position of draft x_0 in its request.

    Draft x_j is *accepted* with probability min(1, p_j(x_j) / q_j(x_j)) (coin: u·q < p, so q(x) = 0
    accepts iff p(x) > 0). At the first rejection j the row emits a *recovered* token from
    normalise(max(0, p_j - q_j)), or from p_j if that residual is all zero (only when p_j == q_j and x_j
    has no mass under either, which sampling from q_j never produces; kept safe anyway). If all depth_b
    drafts are accepted the row emits a *bonus* token from p_{depth_b}. Each emitted token is then
    distributed exactly as the target would sample it, as long as depth does not depend on the sampled
    drafts (docs/design.md trap 1; see `verify_deterministic`).

    Noise: accept coin of x_j keyed (ACCEPT, counter + j); the recovered/bonus sample (TARGET, counter +
    num_accepted), drawn only at that one position.
    """
    b, k = _check_drafts(draft_tokens)
    v = _check_target(target_probs, b, k)
    _check_shape("draft_probs", draft_probs, "B, K, V", (b, k, v))
    _check_keys(seeds, counters, b)
    depth = _resolve_depth(depth, b, k, draft_tokens.device)
    verified = _verified_tokens(draft_tokens, depth)  # [B, K]
    p_x = target_probs[:, :k].gather(-1, verified[..., None])[..., 0]  # [B, K]
    q_x = draft_probs.gather(-1, verified[..., None])[..., 0]  # [B, K]
    num_accepted = _accepted_prefix(_accept_noise(seeds, counters, k) * q_x < p_x, depth)
    p_at = _at_position(target_probs, num_accepted)  # [B, V]
    if k == 0:
        weights = p_at
    else:
        q_at = _at_position(draft_probs, num_accepted.clamp(max=k - 1))  # [B, V]
        weights = _recovery_weights(p_at, (p_at - q_at).clamp(min=0), num_accepted < depth)
    final = sample(weights, seeds, counters.long() + num_accepted, NoiseStream.TARGET)
    return _assemble(draft_tokens, num_accepted, final)


def verify_deterministic(
    draft_tokens: Tensor,
    target_probs: Tensor,
    depth: Tensor | None,
    seeds: Tensor,
    counters: Tensor,
) -> VerifyOutput:
    """Deterministic-draft verification: speculative sampling with q_j = δ(x_j), a point mass.

    draft_tokens: [B, K] int, drafts chosen without randomness (the drafter's argmax).
    target_probs: [B, K+1, V], p_j after `process_logits`, conditioned on the prefix plus x_0..x_{j-1}.
    depth: [B] int or None, drafts to verify per row, clamped to [0, K]; None = K.
    seeds: [B] int, request seeds. counters: [B] int, absolute position of draft x_0.

    x_j is *accepted* with probability p_j(x_j) (always if p_j(x_j) = 1); at the first rejection the
    *recovered* token comes from p_j with x_j removed and renormalised (max(0, p - δ)); the *bonus* token
    from p_{depth_b}. Since the drafts carry no randomness, any depth computed from the drafter's state
    (e.g. confidence-based truncation, D-cut) is a function of the prefix only, and every emitted token is
    exactly target-distributed: this is what makes truncation lossless (docs/design.md trap 1). Exactly equal
    to `verify_speculative` with one-hot draft_probs, at a fraction of the memory. Same noise keying.
    """
    b, k = _check_drafts(draft_tokens)
    _check_target(target_probs, b, k)
    _check_keys(seeds, counters, b)
    depth = _resolve_depth(depth, b, k, draft_tokens.device)
    verified = _verified_tokens(draft_tokens, depth)  # [B, K]
    p_x = target_probs[:, :k].gather(-1, verified[..., None])[..., 0]  # [B, K]
    num_accepted = _accepted_prefix(_accept_noise(seeds, counters, k) < p_x, depth)
    p_at = _at_position(target_probs, num_accepted)  # [B, V]
    if k == 0:
        weights = p_at
    else:
        x_at = verified.gather(1, num_accepted.clamp(max=k - 1)[:, None])  # [B, 1]
        weights = _recovery_weights(p_at, p_at.scatter(-1, x_at, 0.0), num_accepted < depth)
    final = sample(weights, seeds, counters.long() + num_accepted, NoiseStream.TARGET)
    return _assemble(draft_tokens, num_accepted, final)


def _accept_noise(seeds: Tensor, counters: Tensor, k: int) -> Tensor:
    positions = counters.long()[:, None] + torch.arange(k, device=counters.device)  # [B, K]
    return uniform_noise(seeds, positions, NoiseStream.ACCEPT, 1)[..., 0]  # [B, K]


def _verification_noise(seeds: Tensor, counters: Tensor, k: int, v: int) -> tuple[Tensor, Tensor]:
    """All the noise a verify step may consume: accept coins [B, K] and sample uniforms [B, K+1, V].

    The fast paths draw the sample uniforms only at the emitted position; the references take this.
    """
    positions = counters.long()[:, None] + torch.arange(k + 1, device=counters.device)  # [B, K+1]
    return _accept_noise(seeds, counters, k), uniform_noise(seeds, positions, NoiseStream.TARGET, v)


def _verified_tokens(draft_tokens: Tensor, depth: Tensor) -> Tensor:
    # Drafts past the depth may be placeholders; point them at id 0 so gathers stay in range. Drafts
    # inside the depth are used as given, so an invalid id there still fails loudly in the gather.
    k = draft_tokens.shape[1]
    inside = torch.arange(k, device=draft_tokens.device) < depth[:, None]  # [B, K]
    return torch.where(inside, draft_tokens.long(), 0)


def _accepted_prefix(accepted: Tensor, depth: Tensor) -> Tensor:
    """Length of the leading run of accepts within the depth: accepted [B, K] bool, depth [B] -> [B]."""
    inside = torch.arange(accepted.shape[1], device=accepted.device) < depth[:, None]
    return torch.cumprod((accepted & inside).long(), dim=-1).sum(dim=-1)


def _at_position(x: Tensor, index: Tensor) -> Tensor:
    """x [B, J, V] at position index [B] -> [B, V], as a gather so there is no sync."""
    return x.gather(1, index[:, None, None].expand(-1, 1, x.shape[-1]))[:, 0]


def _recovery_weights(p_at: Tensor, residual: Tensor, rejected: Tensor) -> Tensor:
    # Rejected rows sample the residual (falling back to p if it is all zero); rows that accepted every
    # verified draft sample the bonus from p. p_at, residual: [B, V]; rejected: [B] bool.
    residual = torch.where((residual > 0).any(dim=-1, keepdim=True), residual, p_at)
    return torch.where(rejected[:, None], residual, p_at)


def _assemble(draft_tokens: Tensor, num_accepted: Tensor, final: Tensor) -> VerifyOutput:
    b, k = draft_tokens.shape
    j = torch.arange(k + 1, device=draft_tokens.device)  # [K+1]
    drafts = F.pad(draft_tokens.long(), (0, 1), value=PLACEHOLDER_TOKEN_ID)  # [B, K+1]
    n = num_accepted[:, None]
    tokens = torch.where(j < n, drafts, torch.where(j == n, final.long()[:, None], PLACEHOLDER_TOKEN_ID))
    return VerifyOutput(tokens, num_accepted)


# Slow per-row twins. They take the noise explicitly (as `_verification_noise` lays it out) and consume
# it the way the fast paths do, so the tests can demand exact agreement.


def _reference_verify_greedy(draft_tokens: Tensor, target: Tensor, depth: Tensor | None) -> VerifyOutput:
    b, k = draft_tokens.shape
    tokens = torch.full((b, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    num_accepted = torch.zeros(b, dtype=torch.int64)
    for r in range(b):
        n = k if depth is None else min(max(int(depth[r]), 0), k)
        j = 0
        while j < n and int(draft_tokens[r, j]) == _first_argmax(target[r, j].tolist()):
            tokens[r, j] = int(draft_tokens[r, j])
            j += 1
        tokens[r, j] = _first_argmax(target[r, j].tolist())
        num_accepted[r] = j
    return VerifyOutput(tokens, num_accepted)


def _reference_verify_speculative(
    draft_tokens: Tensor,
    draft_probs: Tensor,
    target_probs: Tensor,
    depth: Tensor | None,
    accept_u: Tensor,
    sample_u: Tensor,
) -> VerifyOutput:
    """accept_u: [B, K]; sample_u: [B, K+1, V] (see `_verification_noise`)."""

    def coin(r: int, j: int, x: int) -> bool:
        return float(accept_u[r, j]) * float(draft_probs[r, j, x]) < float(target_probs[r, j, x])

    def residual(r: int, j: int, x: int) -> Tensor:
        return (target_probs[r, j] - draft_probs[r, j]).clamp(min=0)

    return _reference_verify(draft_tokens, target_probs, depth, sample_u, coin, residual)


def _reference_verify_deterministic(
    draft_tokens: Tensor, target_probs: Tensor, depth: Tensor | None, accept_u: Tensor, sample_u: Tensor
) -> VerifyOutput:
    def coin(r: int, j: int, x: int) -> bool:
        return float(accept_u[r, j]) < float(target_probs[r, j, x])

    def residual(r: int, j: int, x: int) -> Tensor:
        out = target_probs[r, j].clone()
        out[x] = 0.0
        return out

    return _reference_verify(draft_tokens, target_probs, depth, sample_u, coin, residual)


def _reference_verify(
    draft_tokens: Tensor,
    target_probs: Tensor,
    depth: Tensor | None,
    sample_u: Tensor,
    coin: Callable[[int, int, int], bool],
    residual: Callable[[int, int, int], Tensor],
) -> VerifyOutput:
    b, k = draft_tokens.shape
    tokens = torch.full((b, k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64)
    num_accepted = torch.zeros(b, dtype=torch.int64)
    for r in range(b):
        n = k if depth is None else min(max(int(depth[r]), 0), k)
        weights = None
        j = 0
        while j < n:
            x = int(draft_tokens[r, j])
            if coin(r, j, x):
                tokens[r, j] = x
                j += 1
                continue
            weights = residual(r, j, x)
            if not bool((weights > 0).any()):
                weights = target_probs[r, j]
            break
        if weights is None:  # every verified draft accepted: bonus token
            weights = target_probs[r, j]
        tokens[r, j] = _reference_sample_row(weights, sample_u[r, j])
        num_accepted[r] = j
    return VerifyOutput(tokens, num_accepted)


def _first_argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


# ---------------------------------------------------------------------------------------------------------
# Validation (shape checks only: reading values would be a host sync)
# ---------------------------------------------------------------------------------------------------------


def _check_shape(name: str, t: Tensor, dims: str, shape: tuple[int | None, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a tensor [{dims}], got {type(t).__name__}")
    if t.dim() != len(shape) or any(s is not None and s != n for s, n in zip(shape, t.shape, strict=False)):
        want = ", ".join("*" if s is None else str(s) for s in shape)
        raise ValueError(f"{name} must be [{dims}] = [{want}], got shape {tuple(t.shape)}")


def _check_integer(name: str, t: Tensor) -> None:
    if t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {t.dtype}")


def _check_drafts(draft_tokens: Tensor) -> tuple[int, int]:
    _check_shape("draft_tokens", draft_tokens, "B, K", (None, None))
    _check_integer("draft_tokens", draft_tokens)
    return draft_tokens.shape[0], draft_tokens.shape[1]


def _check_target(target_probs: Tensor, b: int, k: int) -> int:
    _check_shape("target_probs", target_probs, "B, K+1, V", (b, k + 1, None))
    return target_probs.shape[-1]


def _check_keys(seeds: Tensor, counters: Tensor, b: int) -> None:
    _check_shape("seeds", seeds, "B", (b,))
    _check_shape("counters", counters, "B", (b,))
    _check_integer("seeds", seeds)
    _check_integer("counters", counters)


def _resolve_depth(depth: Tensor | None, b: int, k: int, device: torch.device) -> Tensor:
    if depth is None:
        return torch.full((b,), k, dtype=torch.int64, device=device)
    _check_shape("depth", depth, "B", (b,))
    _check_integer("depth", depth)
    # Clamped, not checked: checking the values would be a host sync.
    return depth.long().clamp(0, k)

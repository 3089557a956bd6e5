"""Tests for angelspec.decoding.sampling: logit processing, counter-based noise, sampling and verification.

Distribution tests draw ~100k samples in one vectorised batch with fixed seeds and compare against the
exact target distribution with a chi-square test at alpha = 1e-4 (Wilson-Hilferty critical value; no
scipy). The trap-1 test also asserts that the same test flags a known-biased protocol, so it has power.
Shape legend: B batch, K draft depth, V vocab.
"""

import math
from statistics import NormalDist

import pytest
import torch

from angelspec.decoding import sampling as S
from angelspec.decoding.sampling import (
    PLACEHOLDER_TOKEN_ID,
    BatchSampling,
    NoiseStream,
    SamplingParams,
    draft_noise_counter,
    process_logits,
    sample,
    uniform_noise,
    verify_deterministic,
    verify_greedy,
    verify_speculative,
)

N_MC = 100_000  # Monte Carlo rows per distribution test


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------


def chi2_crit(df: int, alpha: float = 1e-4) -> float:
    """Upper alpha-quantile of chi-square(df), Wilson-Hilferty approximation (a few percent conservative at df <= 2)."""
    z = NormalDist().inv_cdf(1 - alpha)
    h = 2 / (9 * df)
    return df * (1 - h + z * math.sqrt(h)) ** 3


def chi2_stat(samples: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson chi-square of integer samples [N] against probs [C]; asserts zero-mass cells stay empty."""
    probs = probs.double().flatten()
    counts = torch.bincount(samples.flatten(), minlength=probs.numel()).double()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled an outcome of probability zero"
    expected = samples.numel() * probs[support]
    return float(((counts[support] - expected) ** 2 / expected).sum()), int(support.sum()) - 1


def assert_distributed_as(samples: torch.Tensor, probs: torch.Tensor) -> None:
    stat, df = chi2_stat(samples, probs)
    assert stat < chi2_crit(df), f"chi2 = {stat:.1f} >= crit {chi2_crit(df):.1f} (df {df})"


def random_probs(gen: torch.Generator, *shape: int, zero_frac: float = 0.0) -> torch.Tensor:
    """Random distributions over the last dim, with about zero_frac of the entries forced to zero."""
    logits = torch.randn(*shape, generator=gen) * 1.5
    if zero_frac:
        zero = torch.rand(*shape, generator=gen) < zero_frac
        zero[..., 0] = False  # keep every row non-empty
        logits = logits.masked_fill(zero, -math.inf)
    return torch.softmax(logits, dim=-1)


def keys(b: int, offset: int = 1000, counter: int = 17) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(b, dtype=torch.int64) + offset, torch.full((b,), counter, dtype=torch.int64)


# ---------------------------------------------------------------------------------------------------------
# parameters
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_rejects_bad_values(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_sampling_params_and_batch() -> None:
    assert SamplingParams().is_greedy and not SamplingParams(temperature=0.7).is_greedy
    params = [SamplingParams(0.0), SamplingParams(0.8, 5, 0.9, seed=2**64 + 3), SamplingParams(1.0, seed=-2)]
    batch = BatchSampling.from_params(params, generator=torch.Generator().manual_seed(0))
    assert batch.batch_size == 3
    assert batch.temperature.dtype == torch.float32 and batch.top_k.tolist() == [0, 5, 0]
    assert batch.seeds.dtype == torch.int64 and batch.seeds[1:].tolist() == [3, -2]  # folded to 64 bits
    again = BatchSampling.from_params(params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(batch.seeds, again.seeds)  # seed=None rows drawn from the given generator
    with pytest.raises(ValueError, match="top_p must be"):
        BatchSampling(batch.temperature, batch.top_k, batch.top_p[:2], batch.seeds)


# ---------------------------------------------------------------------------------------------------------
# process_logits
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [None, 3])
def test_process_logits_matches_reference(k: int | None) -> None:
    gen = torch.Generator().manual_seed(1)
    b, v = 40, 10
    shape = (b, v) if k is None else (b, k, v)
    logits = torch.randn(*shape, generator=gen) * 2
    logits[::7, ..., 3] = -math.inf  # masked vocabulary entries

    def pick(options: list) -> torch.Tensor:
        return torch.tensor(options)[torch.randint(len(options), (b,), generator=gen)]

    temperature = pick([0.0, 1e-6, 0.5, 1.0, 1.7])
    top_k = pick([0, 1, 3, 10, 15])
    top_p = pick([1.0, 0.9, 0.5, 1e-6])
    fast = process_logits(logits, temperature, top_k, top_p)
    ref = S._reference_process_logits(logits, temperature, top_k, top_p)
    assert fast.shape == logits.shape and fast.dtype == torch.float32
    assert torch.equal(fast > 0, ref > 0), "kept token sets differ"
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(fast.sum(-1), torch.ones(shape[:-1]))


@pytest.mark.parametrize("k", [None, 3])
def test_process_logits_without_filters_skips_the_sort_and_returns_the_same_probs(k: int | None) -> None:
    """filtering=False (no sampled row has top-k or top-p on) is the sort-free path: bitwise the full path's
    result, for greedy rows (ties, NaN-free), every temperature and masked vocabulary entries; greedy rows may
    keep any top-k / top-p, which never applies to them."""
    gen = torch.Generator().manual_seed(2)
    b, v = 40, 12
    shape = (b, v) if k is None else (b, k, v)
    logits = (torch.randn(*shape, generator=gen) * 2).round(decimals=1)  # rounded: ties occur
    logits[::5, ..., 4] = -math.inf
    temperature = torch.tensor([0.0, 1e-6, 0.3, 1.0, 2.5])[torch.randint(5, (b,), generator=gen)]
    greedy = temperature < S.GREEDY_TEMPERATURE_EPS
    top_k = torch.where(greedy, 3, 0)
    top_p = torch.where(greedy, 0.5, 1.0)
    fast = process_logits(logits, temperature, top_k, top_p, filtering=False)
    assert torch.equal(fast, process_logits(logits, temperature, top_k, top_p))
    batch = BatchSampling.from_params([SamplingParams(temperature=1.0), SamplingParams(top_k=5),
                                       SamplingParams(temperature=0.5, top_p=1.0)])
    assert not batch.filtering and not batch.to("cpu").filtering
    for filt in (SamplingParams(temperature=1.0, top_k=5), SamplingParams(temperature=0.7, top_p=0.9)):
        assert BatchSampling.from_params([SamplingParams(temperature=1.0), filt]).filtering


def _process_one(logits: list[float], t: float = 1.0, k: int = 0, p: float = 1.0) -> list[float]:
    out = process_logits(torch.tensor([logits]), torch.tensor([t]), torch.tensor([k]), torch.tensor([p]))
    return out[0].tolist()


def test_process_logits_edge_cases() -> None:
    ties = [3.0, 1.0, 3.0, 0.0]
    assert _process_one(ties, t=0.0) == [1.0, 0.0, 0.0, 0.0]  # greedy ties go to the lowest id
    assert _process_one(ties, k=1) == [0.5, 0.0, 0.5, 0.0]  # top-k keeps ties at the boundary
    assert _process_one(ties, p=1e-6) == [0.5, 0.0, 0.5, 0.0]  # and so does top-p
    unique = [0.5, 2.0, 1.0, -1.0]
    assert _process_one(unique, k=1) == [0.0, 1.0, 0.0, 0.0]
    assert _process_one(unique, p=1e-6) == [0.0, 1.0, 0.0, 0.0]  # tiny top_p keeps the argmax only
    assert _process_one(unique, t=0.0, k=3, p=0.2) == [0.0, 1.0, 0.0, 0.0]
    kept = _process_one(unique, k=2)
    assert kept[0] == kept[3] == 0.0 and kept[1] > kept[2] > 0.0
    # top_p = 1 keeps a tail that float32 cumsum would round away.
    tail = _process_one([0.0] + [-40.0] * 5, p=1.0)
    assert all(x > 0 for x in tail)
    # top_p keeps the most likely tokens until their mass reaches top_p.
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    assert [x > 0 for x in _process_one(probs.log().tolist(), p=0.79)] == [True, True, False, False]
    assert [x > 0 for x in _process_one(probs.log().tolist(), p=0.81)] == [True, True, True, False]
    # Temperature sharpens and flattens.
    assert _process_one(unique, t=0.5)[1] > _process_one(unique, t=1.0)[1] > _process_one(unique, t=2.0)[1]


def test_process_logits_validation() -> None:
    ones = torch.ones(2)
    with pytest.raises(ValueError, match=r"logits must be \[B, V\] or \[B, K, V\]"):
        process_logits(torch.zeros(5), ones, ones.long(), ones)
    with pytest.raises(ValueError, match=r"temperature must be \[B\]"):
        process_logits(torch.zeros(2, 5), torch.ones(3), ones.long(), ones)
    with pytest.raises(TypeError, match="top_k must be an integer"):
        process_logits(torch.zeros(2, 5), ones, ones, ones)


# ---------------------------------------------------------------------------------------------------------
# noise
# ---------------------------------------------------------------------------------------------------------


def test_uniform_noise_matches_python_reference() -> None:
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789])
    counters = torch.tensor([[0, 1], [5, 2**40], [7, -3], [0, 0], [1, 2], [2**62, 9]])
    for stream in (0, 1, 2, 2**31 - 1):
        noise = uniform_noise(seeds, counters, stream, 7)  # [B, K, 7]
        assert noise.shape == (6, 2, 7) and noise.dtype == torch.float64
        for b in range(6):
            for j in range(2):
                ref = S._reference_uniform_noise(int(seeds[b]), int(counters[b, j]), stream, 7)
                assert noise[b, j].tolist() == ref
        flat = uniform_noise(seeds, counters[:, 0], stream, 7)  # [B] counters give [B, size]
        assert torch.equal(flat, noise[:, 0])


def test_uniform_noise_statistics() -> None:
    n_seeds, n_counters, size = 512, 16, 32  # 2**18 numbers per stream
    seeds = torch.arange(n_seeds, dtype=torch.int64)
    counters = torch.arange(n_counters, dtype=torch.int64).expand(n_seeds, -1)
    u0 = uniform_noise(seeds, counters, 0, size)  # [512, 16, 32]
    u1 = uniform_noise(seeds, counters, 1, size)
    n = u0.numel()
    assert 0 < float(u0.min()) and float(u0.max()) < 1
    assert abs(float(u0.mean()) - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(float(u0.var()) - 1 / 12) < 5 * math.sqrt(1 / 180 / n)  # var of (u - 1/2)^2 is 1/180
    assert_distributed_as((u0 * 64).long(), torch.full((64,), 1 / 64))

    # Neighbouring keys must look independent: streams, counters, seeds, indices.
    pairs = {
        "stream": (u0, u1),
        "counter": (u0[:, :-1], u0[:, 1:]),
        "seed": (u0[:-1], u0[1:]),
        "index": (u0[..., :-1], u0[..., 1:]),
    }
    for name, (a, b) in pairs.items():
        corr = float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(a.numel()), f"{name}: correlation {corr:.4f}"
        cells = (a * 8).long() * 8 + (b * 8).long()  # joint 8x8 histogram must be flat
        assert_distributed_as(cells, torch.full((64,), 1 / 64))


def test_uniform_noise_validation_and_draft_counter() -> None:
    seeds = torch.zeros(3, dtype=torch.int64)
    with pytest.raises(ValueError, match="counters must be"):
        uniform_noise(seeds, torch.zeros(4, dtype=torch.int64), 0, 5)
    with pytest.raises(TypeError, match="seeds must be an integer"):
        uniform_noise(seeds.float(), torch.zeros(3, dtype=torch.int64), 0, 5)
    with pytest.raises(ValueError, match="stream"):
        uniform_noise(seeds, torch.zeros(3, dtype=torch.int64), -1, 5)
    positions = torch.tensor([[5, 6], [5, 6]])
    counter = draft_noise_counter(positions, torch.tensor([0, 1]))
    assert counter[0].tolist() == [5, 6] and counter[1].tolist() == [5 + 2**32, 6 + 2**32]


# ---------------------------------------------------------------------------------------------------------
# sampling
# ---------------------------------------------------------------------------------------------------------


def test_sample_distribution_and_reference() -> None:
    gen = torch.Generator().manual_seed(2)
    table = random_probs(gen, 2, 6, zero_frac=0.3)  # two distributions, alternating rows
    probs = table[torch.arange(N_MC) % 2]  # [N, V]
    seeds, counters = keys(N_MC)
    tokens = sample(probs, seeds, counters, NoiseStream.TARGET)
    for m in range(2):
        assert_distributed_as(tokens[m::2], table[m])
    # Unnormalised weights are fine: scaling a row does not change its draw.
    assert torch.equal(sample(probs * 7.5, seeds, counters, NoiseStream.TARGET), tokens)
    # The fast path equals the per-row loop given the same uniforms.
    u = uniform_noise(seeds[:50], counters[:50], NoiseStream.TARGET, 6)
    assert tokens[:50].tolist() == [S._reference_sample_row(probs[b], u[b]) for b in range(50)]
    # The classic per-row generator sampler agrees in distribution.
    generators = [torch.Generator().manual_seed(s) for s in (3, 4)]
    classic = S._reference_sample_with_generators(table, generators, num_samples=N_MC // 2)
    for m in range(2):
        assert_distributed_as(classic[m], table[m])


def test_sample_shapes_and_one_hot() -> None:
    seeds, counters = keys(4)
    one_hot = torch.eye(6)[torch.tensor([[1, 5, 0], [2, 2, 3], [4, 0, 0], [5, 1, 2]])]  # [B, K, V]
    positions = counters[:, None] + torch.arange(3)
    assert torch.equal(sample(one_hot, seeds, positions, NoiseStream.DRAFT), one_hot.argmax(-1))
    with pytest.raises(ValueError, match=r"counters must have shape probs.shape\[:-1\]"):
        sample(one_hot, seeds, counters, NoiseStream.DRAFT)


# ---------------------------------------------------------------------------------------------------------
# verification: exact behaviour
# ---------------------------------------------------------------------------------------------------------


def test_verify_greedy_edge_cases() -> None:
    # target argmax per position: 2, 4, 1, 3
    target = torch.eye(5)[torch.tensor([[2, 4, 1, 3]])] * 3.0  # [1, K+1=4, V=5] logits
    drafts = torch.tensor([[2, 4, 1]])

    out = verify_greedy(drafts, target)  # all accepted: bonus from position K
    assert out.tokens.tolist() == [[2, 4, 1, 3]] and out.num_accepted.tolist() == [3]
    assert out.num_emitted.tolist() == [4]
    out = verify_greedy(torch.tensor([[0, 4, 1]]), target)  # first rejected
    assert out.tokens.tolist() == [[2, -1, -1, -1]] and out.num_accepted.tolist() == [0]
    out = verify_greedy(torch.tensor([[2, 4, 0]]), target)  # last rejected
    assert out.tokens.tolist() == [[2, 4, 1, -1]] and out.num_accepted.tolist() == [2]
    out = verify_greedy(torch.tensor([[2, -1, -1]]), target, depth=torch.tensor([1]))  # depth < K
    assert out.tokens.tolist() == [[2, 4, -1, -1]] and out.num_accepted.tolist() == [1]
    out = verify_greedy(drafts, target, depth=torch.tensor([0]))
    assert out.tokens.tolist() == [[2, -1, -1, -1]] and out.num_accepted.tolist() == [0]
    out = verify_greedy(torch.zeros(1, 0, dtype=torch.int64), target[:, :1])  # K = 0
    assert out.tokens.tolist() == [[2]] and out.num_accepted.tolist() == [0]
    tie = torch.tensor([[[1.0, 3.0, 3.0], [0.0, 0.0, 0.0]]])  # ties go to the lowest id
    assert verify_greedy(torch.tensor([[2]]), tie).tokens.tolist() == [[1, -1]]
    assert verify_greedy(torch.tensor([[1]]), tie).tokens.tolist() == [[1, 0]]


def _random_verify_case(gen: torch.Generator, b: int, k: int, v: int) -> dict[str, torch.Tensor]:
    """Drafts sampled from q, with rows where q has holes, p == q, and p is one-hot."""
    q = random_probs(gen, b, k, v, zero_frac=0.3)  # [B, K, V]
    p = random_probs(gen, b, k + 1, v, zero_frac=0.3)  # [B, K+1, V]
    p[1::5, :k] = q[1::5]  # p == q: every draft accepted
    p[2::5] = torch.eye(v)[torch.randint(v, (p[2::5].shape[:2]), generator=gen)]  # greedy target rows
    drafts = torch.zeros(b, k, dtype=torch.int64)
    if k:
        drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
        drafts[3::5, 0] = torch.randint(v, (drafts[3::5].shape[0],), generator=gen)  # maybe q(x) = 0
    depth = torch.randint(0, k + 1, (b,), generator=gen)
    seeds = torch.randint(-(2**62), 2**62, (b,), generator=gen)
    counters = torch.randint(0, 2**20, (b,), generator=gen)
    return {"drafts": drafts, "q": q, "p": p, "depth": depth, "seeds": seeds, "counters": counters}


@pytest.mark.parametrize("k", [0, 1, 4])
def test_batched_verifiers_match_references(k: int) -> None:
    gen = torch.Generator().manual_seed(10 + k)
    b, v = 200, 6
    c = _random_verify_case(gen, b, k, v)
    accept_u, sample_u = S._verification_noise(c["seeds"], c["counters"], k, v)
    for depth in (c["depth"], None):
        fast = verify_speculative(c["drafts"], c["q"], c["p"], depth, c["seeds"], c["counters"])
        ref = S._reference_verify_speculative(c["drafts"], c["q"], c["p"], depth, accept_u, sample_u)
        assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.num_accepted, ref.num_accepted)

        fast = verify_deterministic(c["drafts"], c["p"], depth, c["seeds"], c["counters"])
        ref = S._reference_verify_deterministic(c["drafts"], c["p"], depth, accept_u, sample_u)
        assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.num_accepted, ref.num_accepted)
        # Deterministic protocol == standard protocol with a point-mass draft distribution.
        point = torch.nn.functional.one_hot(c["drafts"], v).float()
        spec = verify_speculative(c["drafts"], point, c["p"], depth, c["seeds"], c["counters"])
        assert torch.equal(fast.tokens, spec.tokens)

        fast = verify_greedy(c["drafts"], c["p"], depth)
        ref = S._reference_verify_greedy(c["drafts"], c["p"], depth)
        assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.num_accepted, ref.num_accepted)

    out = verify_speculative(c["drafts"], c["q"], c["p"], c["depth"], c["seeds"], c["counters"])
    emitted = out.tokens != PLACEHOLDER_TOKEN_ID
    assert torch.equal(emitted.sum(-1), out.num_emitted) and bool((out.num_accepted <= c["depth"]).all())
    if k:
        assert bool((out.num_accepted[1::5] == c["depth"][1::5]).all()), "p == q must accept every draft"


def test_one_hot_targets_reduce_to_greedy() -> None:
    gen = torch.Generator().manual_seed(4)
    b, k, v = 32, 3, 8
    batch = BatchSampling.from_params(
        [SamplingParams(temperature=0.0 if r % 2 else 0.9, top_k=r % 4, seed=r) for r in range(b)]
    )
    target_logits = torch.randn(b, k + 1, v, generator=gen)
    draft_logits = target_logits[:, :k] + 0.7 * torch.randn(b, k, v, generator=gen)  # often agrees
    p = process_logits(target_logits, batch.temperature, batch.top_k, batch.top_p)
    q = process_logits(draft_logits, batch.temperature, batch.top_k, batch.top_p)
    positions = 30 + torch.arange(k).expand(b, -1)
    rounds = torch.zeros(b, dtype=torch.int64)
    drafts = sample(q, batch.seeds, draft_noise_counter(positions, rounds), NoiseStream.DRAFT)
    counters = torch.full((b,), 30)
    greedy = verify_greedy(drafts, target_logits)
    spec = verify_speculative(drafts, q, p, None, batch.seeds, counters)
    det = verify_deterministic(drafts, p, None, batch.seeds, counters)
    rows = slice(1, None, 2)  # the temperature-0 rows
    assert torch.equal(spec.tokens[rows], greedy.tokens[rows])
    assert torch.equal(det.tokens[rows], greedy.tokens[rows])
    assert bool((greedy.num_accepted[rows] > 0).any()), "test needs some accepted greedy drafts"


def test_empty_residual_falls_back_to_target() -> None:
    b, v = 64, 5
    seeds, counters = keys(b)
    drafts = torch.zeros(b, 1, dtype=torch.int64)
    # Deterministic: p puts all its (unnormalised) mass on the draft, so a rejection leaves nothing.
    p = torch.zeros(b, 2, v)
    p[:, 0, 0], p[:, 1, 3] = 0.5, 1.0
    out = verify_deterministic(drafts, p, None, seeds, counters)
    assert bool((out.num_accepted == 0).any()) and bool((out.num_accepted == 1).any())
    assert bool((out.tokens[:, 0] == 0).all())
    # Standard: p == q and the draft lies outside both supports (q(x) = 0): rejected, residual empty.
    q = torch.tensor([0.0, 0.5, 0.5, 0.0, 0.0]).expand(b, 1, v)
    p = torch.cat([q, torch.full((b, 1, v), 1 / v)], dim=1)
    out = verify_speculative(drafts, q, p, None, seeds, counters)
    assert bool((out.num_accepted == 0).all())
    assert_distributed_as(out.tokens[:, 0], q[0, 0])
    # q(x) = 0 but p(x) > 0: the ratio is infinite, so the draft is always accepted.
    p[:, 0] = torch.tensor([0.2, 0.4, 0.4, 0.0, 0.0])
    assert bool((verify_speculative(drafts, q, p, None, seeds, counters).num_accepted == 1).all())


def test_depth_zero_is_plain_decoding() -> None:
    gen = torch.Generator().manual_seed(5)
    c = _random_verify_case(gen, 64, 2, 6)
    plain = sample(c["p"][:, 0], c["seeds"], c["counters"], NoiseStream.TARGET)
    zero = torch.zeros(64, dtype=torch.int64)
    for out in (
        verify_speculative(c["drafts"], c["q"], c["p"], zero, c["seeds"], c["counters"]),
        verify_deterministic(c["drafts"], c["p"], zero, c["seeds"], c["counters"]),
    ):
        assert torch.equal(out.tokens[:, 0], plain) and bool((out.tokens[:, 1:] == -1).all())


def test_verify_validation() -> None:
    drafts, p, q = torch.zeros(2, 3, dtype=torch.int64), torch.rand(2, 4, 5), torch.rand(2, 3, 5)
    seeds, counters = keys(2)
    with pytest.raises(ValueError, match=r"draft_tokens must be \[B, K\].*got shape \(3,\)"):
        verify_greedy(torch.zeros(3, dtype=torch.int64), p)
    with pytest.raises(ValueError, match=r"target_probs must be \[B, K\+1, V\]"):
        verify_deterministic(drafts, p[:, :3], None, seeds, counters)
    with pytest.raises(ValueError, match=r"draft_probs must be \[B, K, V\]"):
        verify_speculative(drafts, q[:, :, :4], p, None, seeds, counters)
    with pytest.raises(ValueError, match=r"depth must be \[B\]"):
        verify_deterministic(drafts, p, torch.zeros(3, dtype=torch.int64), seeds, counters)
    with pytest.raises(ValueError, match=r"counters must be \[B\]"):
        verify_deterministic(drafts, p, None, seeds, counters[:, None])
    with pytest.raises(TypeError, match="draft_tokens must be an integer"):
        verify_greedy(drafts.float(), p)


# ---------------------------------------------------------------------------------------------------------
# verification: distributions
# ---------------------------------------------------------------------------------------------------------


def _drafts(protocol: str, q: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, round_: int):
    """Draft tokens for one position: sampled from q [B, V] (standard) or its argmax (deterministic)."""
    if protocol == "deterministic":
        return q.argmax(-1)
    rounds = torch.full_like(seeds, round_)
    return sample(q, seeds, draft_noise_counter(positions, rounds), NoiseStream.DRAFT)


def _verify(protocol, drafts, q, p, depth, seeds, counters):  # noqa: ANN001, ANN202
    if protocol == "deterministic":
        return verify_deterministic(drafts, p, depth, seeds, counters)
    return verify_speculative(drafts, q, p, depth, seeds, counters)


@pytest.mark.parametrize("protocol", ["standard", "deterministic"])
def test_first_token_is_target_distributed(protocol: str) -> None:
    gen = torch.Generator().manual_seed(6)
    b, k, v = N_MC, 3, 6
    p0 = random_probs(gen, v, zero_frac=0.2)
    model = torch.arange(b) % 3  # three different drafters, so the argmax draft varies by row
    q = random_probs(gen, 3, k, v, zero_frac=0.3)[model]  # [B, K, V]
    p = torch.cat([p0.expand(b, 1, v), random_probs(gen, 4, k, v)[torch.arange(b) % 4]], dim=1)
    seeds, counters = keys(b)
    positions = counters[:, None] + torch.arange(k)
    drafts = torch.stack([_drafts(protocol, q[:, j], seeds, positions[:, j], 0) for j in range(k)], dim=1)
    depth = torch.randint(0, k + 1, (b,), generator=gen)  # independent of the drafts: allowed
    out = _verify(protocol, drafts, q, p, depth, seeds, counters)
    assert_distributed_as(out.tokens[:, 0], p0)


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("protocol", ["standard", "deterministic"])
def test_first_two_tokens_are_target_distributed(protocol: str, k: int) -> None:
    """The target at position 2 depends on token 1. With K = 1 the second token is the bonus or comes
    from the next step; with K = 2 it is draft 2 or its recovery. Rows that emit only one token get
    their second from a second verify step (K = 1, prefix t1), as the engine would run it."""
    gen = torch.Generator().manual_seed(7)
    b, v = N_MC, 6
    p1, p2, p3 = random_probs(gen, v), random_probs(gen, v, v), random_probs(gen, v, v, v)  # p2[a] = p(.|a)
    model = torch.arange(b) % 3
    q1, q2 = random_probs(gen, 3, v, zero_frac=0.3)[model], random_probs(gen, 3, v, v, zero_frac=0.3)
    seeds, counters = keys(b, counter=50)

    x1 = _drafts(protocol, q1, seeds, counters, 0)
    q2_x1 = q2[model, x1]  # [B, V]
    x2 = _drafts(protocol, q2_x1, seeds, counters + 1, 0)
    target = torch.stack([p1.expand(b, v), p2[x1], p3[x1, x2]], dim=1)[:, : k + 1]  # [B, K+1, V]
    drafts, q = torch.stack([x1, x2], 1)[:, :k], torch.stack([q1, q2_x1], 1)[:, :k]  # [B, K], [B, K, V]
    first = _verify(protocol, drafts, q, target, None, seeds, counters)

    t1 = first.tokens[:, 0]  # step 2, for rows that emitted only t1: prefix t1, one fresh draft
    q2_t1 = q2[model, t1]
    y = _drafts(protocol, q2_t1, seeds, counters + 1, 1)
    second = _verify(
        protocol, y[:, None], q2_t1[:, None], torch.stack([p2[t1], p3[t1, y]], 1), None, seeds, counters + 1
    )
    t2 = torch.where(first.num_accepted > 0, first.tokens[:, 1], second.tokens[:, 0])
    assert_distributed_as(t1 * v + t2, (p1[:, None] * p2).flatten())


def _biased_first_token(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Exact first-token law when verification runs only if q(x) > 0.5 for the *sampled* draft x."""
    out = torch.zeros_like(p, dtype=torch.float64)
    residual = (p - q).clamp(min=0)
    residual = residual / residual.sum()
    for x in range(p.numel()):
        if q[x] > 0.5:
            accept = min(1.0, float(p[x] / q[x]))
            out += q[x] * (1 - accept) * residual
            out[x] += q[x] * accept
        else:
            out += q[x] * p  # depth 0: a plain target sample
    return out


def test_trap1_confidence_truncation() -> None:
    """docs/design.md trap 1: a verification depth chosen from the confidence of a *sampled* draft biases
    standard rejection sampling; the same policy on the argmax draft (deterministic protocol) does not."""
    b, v = N_MC, 6
    p = torch.tensor([0.2, 0.2, 0.2, 0.2, 0.1, 0.1])
    confident = torch.tensor([0.6, 0.1, 0.1, 0.1, 0.05, 0.05])
    unsure = torch.tensor([0.3, 0.1, 0.35, 0.1, 0.05, 0.1])
    q = torch.stack([confident, unsure])[torch.arange(b) % 2]  # [B, V]
    target = torch.stack([p.expand(b, v), torch.full((b, v), 1 / v)], dim=1)  # [B, K+1=2, V]
    seeds, counters = keys(b, counter=9)
    sampled = _drafts("standard", q, seeds, counters, 0)

    # Standard protocol, depth from the sampled draft's confidence: detectably biased, and exactly as
    # the analysis predicts (so the chi-square test has power, and the bias is the one we think it is).
    depth = (q.gather(1, sampled[:, None])[:, 0] > 0.5).long()
    biased = verify_speculative(sampled[:, None], q[:, None], target, depth, seeds, counters).tokens[:, 0]
    stat, df = chi2_stat(biased, p)
    assert stat > 10 * chi2_crit(df), f"bias not detected: chi2 = {stat:.1f}"
    predicted = 0.5 * _biased_first_token(p, confident) + 0.5 * p.double()
    assert_distributed_as(biased, predicted)

    # Standard protocol, depth from the distribution alone (not the sample): unbiased.
    depth = (q.max(-1).values > 0.5).long()
    fair = verify_speculative(sampled[:, None], q[:, None], target, depth, seeds, counters).tokens[:, 0]
    assert_distributed_as(fair, p)

    # Deterministic protocol with the same confidence policy on the argmax draft: unbiased.
    argmax = q.argmax(-1)
    depth = (q.gather(1, argmax[:, None])[:, 0] > 0.5).long()
    exact = verify_deterministic(argmax[:, None], target, depth, seeds, counters).tokens[:, 0]
    assert_distributed_as(exact, p)
    assert_distributed_as(exact[depth == 1], p)  # including the rows that were actually verified


# ---------------------------------------------------------------------------------------------------------
# seeded determinism, batch independence
# ---------------------------------------------------------------------------------------------------------


def test_fast_paths_run_on_meta_tensors() -> None:
    """Meta tensors have no data: any .item(), .tolist() or data-dependent shape (boolean indexing) on a
    fast path raises here, so this is a CPU-only proxy for "no host syncs"."""
    b, k, v = 4, 3, 7
    meta = {"device": "meta"}
    logits = torch.empty(b, k + 1, v, **meta)
    ones, zeros = torch.ones(b, **meta), torch.zeros(b, dtype=torch.int64, **meta)
    p = process_logits(logits, ones, zeros, ones)
    q = process_logits(logits[:, :k], ones, zeros, ones)
    positions = zeros[:, None] + torch.arange(k, **meta)
    drafts = sample(q, zeros, draft_noise_counter(positions, zeros), NoiseStream.DRAFT)
    outs = [
        verify_greedy(drafts, p, zeros),
        verify_speculative(drafts, q, p, zeros, zeros, zeros),
        verify_deterministic(drafts, p, None, zeros, zeros),
        verify_speculative(drafts[:, :0], q[:, :0], p[:, :1], None, zeros, zeros),
    ]
    assert [tuple(o.tokens.shape) for o in outs] == [(b, k + 1)] * 3 + [(b, 1)]
    assert all(o.tokens.is_meta and o.num_accepted.shape == (b,) for o in outs)


def test_seeded_and_independent_of_batch_composition() -> None:
    gen = torch.Generator().manual_seed(8)
    b, k, v, at = 5, 3, 8, 3
    logits_t = torch.randn(b, k + 1, v, generator=gen)
    logits_d = torch.randn(b, k, v, generator=gen)
    batch = BatchSampling.from_params(
        [SamplingParams(0.3 + 0.4 * r, top_k=r % 3 * 3, top_p=0.95, seed=100 + r) for r in range(b)]
    )
    counters = torch.tensor([11, 40, 7, 23, 5])
    depth = torch.tensor([3, 1, 0, 2, 3])

    def run(rows: list[int]) -> list[torch.Tensor]:
        i = torch.tensor(rows)
        p = process_logits(logits_t[i], batch.temperature[i], batch.top_k[i], batch.top_p[i])
        q = process_logits(logits_d[i], batch.temperature[i], batch.top_k[i], batch.top_p[i])
        seeds, ctr = batch.seeds[i], counters[i]
        positions = ctr[:, None] + torch.arange(k)
        drafts = sample(q, seeds, draft_noise_counter(positions, torch.zeros_like(ctr)), NoiseStream.DRAFT)
        spec = verify_speculative(drafts, q, p, depth[i], seeds, ctr)
        det = verify_deterministic(q.argmax(-1), p, depth[i], seeds, ctr)
        return [p, drafts, spec.tokens, spec.num_accepted, det.tokens, det.num_accepted]

    together = run(list(range(b)))
    assert all(torch.equal(x, y) for x, y in zip(together, run(list(range(b))), strict=True))  # seeded
    alone = run([at])
    reordered = run([at, 0, 4, 1, 2])
    for x_all, x_alone, x_re in zip(together, alone, reordered, strict=True):
        assert torch.equal(x_all[at : at + 1], x_alone)
        assert torch.equal(x_all[at : at + 1], x_re[:1])

    seeds, ctr = keys(1000)
    probs = torch.full((1000, v), 1 / v)
    base = sample(probs, seeds, ctr, NoiseStream.TARGET)
    assert (base != sample(probs, seeds + 1, ctr, NoiseStream.TARGET)).float().mean() > 0.7
    assert (base != sample(probs, seeds, ctr + 1, NoiseStream.TARGET)).float().mean() > 0.7
    assert (base != sample(probs, seeds, ctr, NoiseStream.DRAFT)).float().mean() > 0.7


def test_greedy_argmax_is_torch_argmax_including_ties_nan_and_strides():
    """The fast greedy argmax (max(-1).indices) picks exactly torch.argmax's index: ties -> the lowest id, a NaN wins,
    all -inf rows -> 0, also for non-contiguous [B, K+1, V] inputs."""
    g = torch.Generator().manual_seed(0)
    for trial in range(60):
        x = torch.randint(0, 3, (6, 4, 257), generator=g).float()  # many ties
        if trial % 3 == 0:
            x[1, :, 100] = float("nan")
        if trial % 4 == 0:
            x[2] = float("-inf")
        if trial % 5 == 0:
            x = x.transpose(0, 1)
        assert torch.equal(S.greedy_argmax(x), x.argmax(dim=-1))
        assert torch.equal(S.greedy_argmax(x[:, 0]), x[:, 0].argmax(dim=-1))

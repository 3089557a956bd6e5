"""Token draws from float32 exponential noise (`sampling.exponential_noise`): keyed by the same hash as
`uniform_noise`, no float64 [B, (K,) V] tensor anywhere, batch-invariant, target-distributed. The chi-squared tests
of `test_sampling.py` run through the same `sample` and stay as they were."""

from __future__ import annotations

import math

import pytest
import torch
from test_sampling import N_MC, assert_distributed_as, keys, random_probs

from angelspec.decoding import sampling as S
from angelspec.decoding.sampling import NoiseStream, exponential_noise, sample, verify_speculative


def test_exponential_noise_is_float32_and_matches_the_python_reference() -> None:
    seeds = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 123456789])
    counters = torch.tensor([[0, 1], [5, 2**40], [7, -3], [0, 0], [1, 2], [2**62, 9]])
    for stream in (0, 2, 2**31 - 1):
        e = exponential_noise(seeds, counters, stream, 7)
        assert e.shape == (6, 2, 7) and e.dtype == torch.float32
        for b in range(6):
            for j in range(2):
                u = S._reference_uniform_noise(int(seeds[b]), int(counters[b, j]), stream, 7, bits=23)
                assert all(0 < x < 1 for x in u)
                assert torch.equal(torch.tensor(u, dtype=torch.float32).double(), torch.tensor(u))  # exact grid
                torch.testing.assert_close(e[b, j], torch.tensor([-math.log(x) for x in u], dtype=torch.float32),
                                           rtol=2e-7, atol=0)
        # the top 23 of the same 52 bits `uniform_noise` uses: the two never differ by more than the coarser grid
        u64 = S.uniform_noise(seeds, counters, stream, 7)
        assert float((torch.exp(-e.double()) - u64).abs().max()) < 2**-22


def test_exponential_noise_statistics() -> None:
    seeds = torch.arange(256, dtype=torch.int64)
    counters = torch.arange(16, dtype=torch.int64).expand(256, -1)
    e = exponential_noise(seeds, counters, int(NoiseStream.TARGET), 64).double().flatten()  # 2**18 draws
    n = e.numel()
    assert abs(float(e.mean()) - 1) < 5 / math.sqrt(n) and abs(float(e.var()) - 1) < 5 * math.sqrt(8 / n)
    assert 0 < float(e.min()) and float(e.max()) < 16.7
    # P(E in [t_i, t_{i+1})) for 16 equal-probability bins: a chi-square on the exponential's own quantiles.
    cells = torch.floor(-torch.expm1(-e) * 16).long().clamp(max=15)  # 1 - exp(-E) ~ U(0, 1)
    assert_distributed_as(cells, torch.full((16,), 1 / 16))


def test_sample_makes_no_float64_tensor_of_the_vocabulary(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every tensor `sample` builds from the hash is int64 or float32: the [B, K, V] draw has no float64 step."""
    seen: list[torch.dtype] = []
    original = S._hash_bits

    def spy(*args):
        out = original(*args)
        seen.append(out.dtype)
        return out

    monkeypatch.setattr(S, "_hash_bits", spy)
    monkeypatch.setattr(S, "uniform_noise", lambda *a: pytest.fail("sample drew float64 uniforms"))
    probs = torch.softmax(torch.randn(3, 4, 1000), -1)
    seeds, counters = keys(3)
    out = sample(probs, seeds, counters[:, None] + torch.arange(4), NoiseStream.DRAFT)
    assert out.shape == (3, 4) and seen == [torch.int64]
    assert sample(probs.bfloat16(), seeds, counters[:, None] + torch.arange(4), NoiseStream.DRAFT).shape == (3, 4)


def test_a_rows_draw_does_not_depend_on_its_batch() -> None:
    gen = torch.Generator().manual_seed(4)
    probs = random_probs(gen, 64, 300)
    seeds, counters = keys(64)
    together = sample(probs, seeds, counters, NoiseStream.TARGET)
    perm = torch.randperm(64, generator=gen)
    assert torch.equal(sample(probs[perm], seeds[perm], counters[perm], NoiseStream.TARGET), together[perm])
    for b in (0, 17, 63):
        assert torch.equal(sample(probs[b:b + 1], seeds[b:b + 1], counters[b:b + 1], NoiseStream.TARGET),
                           together[b:b + 1])


def test_sample_equals_the_per_row_reference_on_its_own_noise() -> None:
    gen = torch.Generator().manual_seed(6)
    probs = random_probs(gen, 200, 9, zero_frac=0.3)
    seeds, counters = keys(200)
    tokens = sample(probs, seeds, counters, NoiseStream.TARGET)
    ref = [S._reference_sample_row(probs[b], torch.tensor(S._reference_uniform_noise(
        int(seeds[b]), int(counters[b]), int(NoiseStream.TARGET), 9, bits=23), dtype=torch.float64))
        for b in range(200)]
    assert tokens.tolist() == ref


def test_a_large_vocabulary_draw_is_target_distributed() -> None:
    """At a real vocabulary's size (32k), with most mass on a few tokens and a long flat tail: the tail's total
    and the head tokens come out in proportion."""
    v, head = 32_000, 8
    gen = torch.Generator().manual_seed(8)
    probs = torch.full((v,), 0.3 / (v - head), dtype=torch.float64)
    probs[:head] = torch.softmax(torch.randn(head, generator=gen, dtype=torch.float64), -1) * 0.7
    n = N_MC // 20
    seeds, counters = keys(n)
    tokens = sample(probs.float().expand(n, -1), seeds, counters, NoiseStream.TARGET)
    cells = tokens.clamp(max=head)  # the head tokens, and the tail as one cell
    want = torch.cat([probs[:head], probs[head:].sum()[None]])
    assert_distributed_as(cells, want)


def test_speculative_verification_still_matches_the_references() -> None:
    """`verify_speculative` draws its recovered / bonus token from the float32 exponentials; the per-row reference
    fed the same 23-bit uniforms agrees token for token."""
    gen = torch.Generator().manual_seed(12)
    b, k, v = 120, 3, 7
    q = random_probs(gen, b, k, v)
    p = random_probs(gen, b, k + 1, v)
    drafts = torch.multinomial(q.reshape(-1, v), 1, generator=gen).reshape(b, k)
    seeds, counters = keys(b)
    fast = verify_speculative(drafts, q, p, None, seeds, counters)
    accept_u, _ = S._verification_noise(seeds, counters, k, v)
    sample_u = torch.tensor([[S._reference_uniform_noise(int(seeds[r]), int(counters[r]) + j,
                                                         int(NoiseStream.TARGET), v, bits=23)
                              for j in range(k + 1)] for r in range(b)], dtype=torch.float64)
    ref = S._reference_verify_speculative(drafts, q, p, None, accept_u, sample_u)
    assert torch.equal(fast.tokens, ref.tokens) and torch.equal(fast.num_accepted, ref.num_accepted)

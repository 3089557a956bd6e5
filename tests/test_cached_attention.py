"""The native cached attention (`models/kernels/cached_attention.c`, the "native" attention backend): the same
answer as SDPA under the cache's mask, each query's result independent of what shares its call, and the fallbacks
where the kernel cannot take a call."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_attention_kernels import _decoder

from angelspec.models import few_rows
from angelspec.models.attention import AttentionPlan, resolve_attention_backend, set_attention_backend
from angelspec.models.decoder import CacheInputs

op = few_rows.attention_op()
needs_kernel = pytest.mark.skipif(op is None, reason=f"the native library is not built: {few_rows.status()}")


def _reference(q, k, v, start, kv_len):
    T = q.shape[2]
    slots = start[:, None] + torch.arange(T)
    mask = (torch.arange(kv_len)[None, None, :] <= slots[:, :, None])[:, None]
    return F.scaled_dot_product_attention(q, k[:, :, :kv_len], v[:, :, :kv_len], attn_mask=mask, enable_gqa=True)


def _case(B, H, Hkv, T, D, S, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, D, generator=g).transpose(1, 2)  # the projection's layout: heads a transposed view
    k, v = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g)
    start = torch.randint(0, S - T + 1, (B,), generator=g)
    return q, k, v, start


@needs_kernel
@pytest.mark.parametrize("B,H,Hkv,T,D,S", [(1, 4, 2, 1, 64, 50), (3, 4, 2, 5, 64, 80), (2, 8, 2, 3, 128, 40),
                                           (4, 4, 4, 1, 32, 30), (2, 6, 2, 2, 20, 17), (5, 4, 1, 8, 64, 100),
                                           (2, 2, 2, 7, 8, 9)])
def test_the_kernel_equals_sdpa_under_the_cache_mask(B, H, Hkv, T, D, S):
    """Grouped and ungrouped heads, head dims with and without a tail past the 8-wide and 32-wide blocks, rows that
    start at slot 0 and rows whose last query sees the last slot."""
    q, k, v, start = _case(B, H, Hkv, T, D, S)
    start[0], start[-1] = 0, S - T
    kv_len = int(start.max()) + T
    out = op(q, k[:, :, :kv_len], v[:, :, :kv_len], start, D ** -0.5)
    assert out.shape == (B, H, T, D) and out.transpose(1, 2).is_contiguous()
    torch.testing.assert_close(out, _reference(q, k, v, start, kv_len), atol=2e-6, rtol=2e-5)


@needs_kernel
def test_a_row_past_the_slots_it_may_read_sees_only_those():
    """An idle row whose length runs past the call's span (the span bounds the active rows) attends over the span,
    as SDPA over the sliced cache does."""
    q, k, v, start = _case(3, 4, 2, 2, 16, 40)
    start = torch.tensor([5, 30, 11])
    kv_len = 20
    torch.testing.assert_close(op(q, k[:, :, :kv_len], v[:, :, :kv_len], start, 0.25),
                               _reference(q, k, v, start.clamp(max=kv_len), kv_len), atol=2e-6, rtol=2e-5)


@needs_kernel
def test_a_query_gets_the_same_bits_whatever_shares_its_call():
    """A row alone, the first new position alone, or more threads: the same result bit for bit (a verify step's
    first position and a decode step agree; a row does not depend on the batch)."""
    q, k, v, start = _case(6, 4, 2, 5, 64, 120, seed=1)
    kv_len = int(start.max()) + 5
    kk, vv = k[:, :, :kv_len], v[:, :, :kv_len]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = op(q, kk, vv, start, 0.125)
        torch.set_num_threads(max(threads, 2))
        full = op(q, kk, vv, start, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(alone, full)
    for b in range(6):
        assert torch.equal(op(q[b:b + 1], kk[b:b + 1], vv[b:b + 1], start[b:b + 1], 0.125)[0], full[b])
    assert torch.equal(op(q[:, :, :1], kk, vv, start, 0.125)[:, :, 0], full[:, :, 0])


@needs_kernel
def test_bad_inputs_get_a_clear_error():
    q, k, v, start = _case(2, 4, 2, 1, 16, 10)
    with pytest.raises(RuntimeError, match="fp32"):
        op(q.double(), k, v, start, 0.25)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        op(q, k[:, :1].expand(2, 3, 10, 16), v[:, :1].expand(2, 3, 10, 16), start, 0.25)
    with pytest.raises(RuntimeError, match="int64"):
        op(q, k, v, start.int(), 0.25)


@needs_kernel
def test_auto_on_a_cpu_is_the_kernel_and_cached_forwards_equal_sdpa():
    """Decode, verify and packed (ragged) verify forwards through the kernel equal the SDPA mask path; a fresh
    prefill stays SDPA's causal kernel, a documents forward SDPA's mask."""
    assert resolve_attention_backend("auto", torch.device("cpu")) == "native"
    model = _decoder()
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(0))
    keep = torch.arange(4)[None] < torch.tensor([[4], [2], [3]])
    outs = {}
    for backend in ("sdpa", "native"):
        set_attention_backend(model, backend)
        cache = model.new_cache(3, 40)
        with torch.no_grad():
            model.forward_cached(ids[:, :8], CacheInputs(cache, kv_len=8))
            cache.truncate(torch.tensor([8, 5, 7]))  # rows of different lengths
            verify = model.forward_cached(ids[:, 8:12], CacheInputs(cache, kv_len=12)).logits
            cache.truncate(torch.tensor([9, 6, 8]))
            decode = model.forward_cached(ids[:, 9:10], CacheInputs(cache, kv_len=10)).logits
            cache.truncate(torch.tensor([9, 6, 8]))
            packed = model.forward_cached(ids[:, 8:12], CacheInputs(cache, kv_len=13, keep=keep)).logits
        outs[backend] = (verify, decode, packed * keep[..., None])
    for a, b in zip(outs["native"], outs["sdpa"], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    start = torch.tensor([3, 0])
    assert AttentionPlan.cached(start, 2, 5, 48, "native", False).kind == "rows"
    assert AttentionPlan.cached(start, 2, 5, 48, "native", True).kind == "causal"
    assert AttentionPlan.cached(start, 65, 70, 96, "native", False).kind == "mask"  # past NATIVE_MAX_NEW
    assert AttentionPlan.cached(start, 2, 5, 48, "native", False, torch.bfloat16).kind == "mask"  # a bf16 cache
    assert AttentionPlan.documents(torch.zeros(2, 4, dtype=torch.long), "native").kind == "mask"


@needs_kernel
def test_calls_the_kernel_cannot_take_run_sdpa():
    """bf16, or a call that needs gradients (the kernel has no backward): the same plan runs SDPA under the mask."""
    q, k, v, start = _case(2, 4, 2, 3, 16, 20)
    plan = AttentionPlan.cached(start, 3, 20, 20, "native", False)
    assert plan.kind == "rows"
    ref = _reference(q, k, v, start, 20)
    torch.testing.assert_close(plan(q.bfloat16(), k.bfloat16(), v.bfloat16()).float(), ref, atol=3e-2, rtol=3e-2)
    qg = q.clone().requires_grad_(True)
    out = plan(qg, k, v)
    assert out.grad_fn is not None
    out.sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    torch.testing.assert_close(out.detach(), ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_compiled_step_runs_the_kernel_without_graph_breaks():
    """The engine compiles its steps with dynamic shapes: the op's fake output (a transposed view) must trace,
    and the compiled call must give the eager bits."""
    q, k, v, start = _case(2, 4, 2, 3, 16, 20)
    plan = AttentionPlan.cached(start, 3, 15, 20, "native", False)
    torch._dynamo.reset()
    compiled = torch.compile(plan.__call__, dynamic=True, fullgraph=True)
    assert torch.equal(compiled(q, k, v), plan(q, k, v))

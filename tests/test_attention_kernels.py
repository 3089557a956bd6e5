"""The attention backends (`models.attention`: sdpa / flex / expand / auto) against today's masked SDPA and the
dense references. FlexAttention's compiled CPU kernel takes neither a backward nor the log-sum-exp, so here the
LSE-returning paths (TTT prefix, block anchors, block context) run the eager FlexAttention under the same block
mask, the compiled kernel is checked on the cached and document-masked forwards (few, small: each shape compiles
for seconds), and the gradient checks run only where a GPU is (`pytest -m gpu`, which benchmarks/gpu_check.py runs)."""

from __future__ import annotations

import pytest
import torch

from angelspec.models import Decoder, DecoderConfig, few_rows
from angelspec.models.attention import (
    AttentionPlan,
    document_first_index,
    document_prefix_attention,
    document_prefix_attention_reference,
    prefix_block_mask,
    resolve_attention_backend,
    set_attention_backend,
)
from angelspec.models.decoder import CacheInputs, TrainInputs

CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                          reason="FlexAttention's backward is not implemented on CPU: gradients are checked on a GPU")


def _decoder(seed: int = 0) -> Decoder:
    cfg = DecoderConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    model.init_weights(std=0.3)
    return model.eval()


def _packed_case(B: int = 2, T: int = 300, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Documents starting at 0, 130 and 230 (row 1 also at 50), cut at T: tiles with one, two and three documents,
    and a tail tile shorter than 128."""
    t = torch.arange(T)
    doc = ((t >= 130).long() + (t >= 230).long()).repeat(B, 1)
    doc[1, 50:] += 5
    return doc.to(device), torch.arange(T, device=device)[None]


def test_backend_names_and_auto() -> None:
    cpu = "native" if few_rows.attention_op() is not None else "sdpa"
    assert resolve_attention_backend("auto", torch.device("cpu")) == cpu
    assert resolve_attention_backend("auto", torch.device("cuda")) == "flex"
    with pytest.raises(ValueError, match="attention backend must be one of auto, sdpa, native, flex, expand"):
        resolve_attention_backend("flash", torch.device("cpu"))
    model = _decoder()
    set_attention_backend(model, "expand")
    assert model.attn_backend == "expand"


def test_block_mask_classifies_tiles_exactly() -> None:
    """Every tile the block mask skips holds no visible pair; every tile it calls full holds only visible ones."""
    doc, _ = _packed_case()
    g = torch.Generator().manual_seed(0)
    q_last = torch.randint(-1, 300, (2, 200), generator=g)
    q_doc = doc[:, :200]
    bm = prefix_block_mask(q_last, 300, q_doc, doc)
    dense = (doc[:, None, :] == q_doc[:, :, None]) & (torch.arange(300) <= q_last[:, :, None])  # [B, Q, S]
    n_part, i_part = bm.kv_num_blocks[:, 0], bm.kv_indices[:, 0]
    n_full, i_full = bm.full_kv_num_blocks[:, 0], bm.full_kv_indices[:, 0]
    for b in range(2):
        for i in range(2):
            part = set(i_part[b, i, :n_part[b, i]].tolist())
            full = set(i_full[b, i, :n_full[b, i]].tolist())
            assert not part & full
            for j in range(3):
                tile = dense[b, i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
                if j in full:
                    assert tile.all()
                elif j not in part:
                    assert not tile.any()


def test_flex_prefix_attention_equals_reference_with_lse_and_empty_queries() -> None:
    """The TTT prefix / block-anchor pattern through FlexAttention (eager here: the LSE path) equals the dense
    reference, including queries that see nothing (out 0, lse -inf) and a broadcast one-row index."""
    torch.manual_seed(0)
    doc, _ = _packed_case()
    q, k, v = torch.randn(2, 4, 200, 16), torch.randn(2, 2, 300, 16), torch.randn(2, 2, 300, 16)
    q_last = torch.randint(-1, 300, (2, 200), generator=torch.Generator().manual_seed(1))
    out, lse = document_prefix_attention(q, k, v, q_last, doc[:, :200], doc, backend="flex")
    ref_out, ref_lse = document_prefix_attention_reference(q, k, v, q_last, doc[:, :200], doc)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    assert torch.equal(lse.isinf(), ref_lse.isinf()) and (q_last == -1).any()
    torch.testing.assert_close(lse.nan_to_num(neginf=0.0), ref_lse.nan_to_num(neginf=0.0), atol=1e-5, rtol=1e-5)
    causal = torch.arange(200)[None]  # one row broadcast over the batch, no documents
    out, lse = document_prefix_attention(q, k, v, causal, backend="flex")
    ref_out, ref_lse = document_prefix_attention_reference(q, k, v, causal)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


def test_block_anchor_and_context_attention_through_flex() -> None:
    """The block drafters' training anchors and their inference context step under flex equal today's paths."""
    from angelspec.models.block.drafter import (
        AnchorIndex,
        anchored_block_attention,
        context_block_attention,
        context_block_mask,
    )

    torch.manual_seed(0)
    doc, _ = _packed_case(T=160)
    R, N, Bk = 2, 6, 4
    anchors = torch.sort(torch.randint(1, 159, (R, N), generator=torch.Generator().manual_seed(2)), dim=1).values
    index = AnchorIndex.build(anchors, Bk, doc)
    q, k, v = torch.randn(R, 4, N * Bk, 16), torch.randn(R, 2, N * Bk, 16), torch.randn(R, 2, N * Bk, 16)
    ck, cv = torch.randn(R, 2, 160, 16), torch.randn(R, 2, 160, 16)
    torch.testing.assert_close(anchored_block_attention(q, k, v, ck, cv, index, backend="flex"),
                               anchored_block_attention(q, k, v, ck, cv, index, backend="sdpa"), atol=1e-5, rtol=1e-5)
    lengths = torch.tensor([0, 37])  # an empty context: only the block's own entries
    qb, kb, vb = q[:, :, :Bk], k[:, :, :Bk], v[:, :, :Bk]
    valid = torch.arange(160)[None] < lengths[:, None]
    torch.testing.assert_close(context_block_attention(qb, kb, vb, ck, cv, None, context_block_mask(lengths, Bk, 160)),
                               context_block_attention(qb, kb, vb, ck, cv, valid), atol=1e-5, rtol=1e-5)


def test_fresh_prefill_and_expanded_kv_equal_the_masked_path() -> None:
    """A prefill that says every row is empty (kv_len <= T) runs SDPA is_causal; "expand" repeats the kv heads;
    both equal the boolean-mask path, including the packed (ragged) form of each."""
    model = _decoder()
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(0))
    keep = torch.arange(9)[None] < torch.tensor([[9], [5]])
    outs = {}
    for backend in ("sdpa", "expand"):
        set_attention_backend(model, backend)
        cache = model.new_cache(2, 32)
        with torch.no_grad():
            fresh = model.forward_cached(ids, CacheInputs(cache, kv_len=9)).logits
            step = model.forward_cached(ids[:, :3], CacheInputs(cache)).logits  # not fresh: the mask over the cache
            packed = model.forward_cached(ids, CacheInputs(model.new_cache(2, 32), kv_len=9, keep=keep)).logits
            cache = model.new_cache(2, 32)
            masked = model.forward_cached(ids, CacheInputs(cache)).logits  # no kv_len: the mask path
        outs[backend] = step
        torch.testing.assert_close(fresh, masked, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[1, :5], masked[1, :5], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs["expand"], outs["sdpa"], atol=1e-5, rtol=1e-5)
    assert AttentionPlan.cached(torch.zeros(2, dtype=torch.long), 9, 9, 48, "sdpa", True).kind == "causal"


def test_compiled_flex_cached_decode_verify_and_documents_equal_sdpa() -> None:
    """The compiled FlexAttention kernel (two shapes: each compiles for about a minute on this CPU): a cached
    verify step over the whole capacity (rows at different lengths) and the document-masked forward equal the
    masked SDPA paths."""
    model = _decoder()
    g = torch.Generator().manual_seed(1)
    prompt, step = torch.randint(0, 64, (2, 6), generator=g), torch.randint(0, 64, (2, 4), generator=g)
    num_new = torch.tensor([6, 3])
    logits = {}
    for backend in ("sdpa", "flex"):
        set_attention_backend(model, backend)
        cache = model.new_cache(2, 150)  # capacity 166: two key tiles
        with torch.no_grad():
            model.forward_cached(prompt, CacheInputs(cache, num_new=num_new, kv_len=6))
            # a decode step is the T = 1 case
            logits[backend] = model.forward_cached(step, CacheInputs(cache, kv_len=10)).logits
    torch.testing.assert_close(logits["flex"], logits["sdpa"], atol=1e-5, rtol=1e-5)
    doc, pos = _packed_case(T=160)
    ids = torch.randint(0, 64, (2, 160), generator=g)
    with torch.no_grad():
        set_attention_backend(model, "flex")
        flex = model(ids, TrainInputs(document_ids=doc)).logits
        set_attention_backend(model, "sdpa")
        dense = model(ids, TrainInputs(document_ids=doc)).logits
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


# ----- gradients: FlexAttention's backward runs on a GPU only -----


def check_flex_gradients(device: str = "cuda") -> dict[str, float]:
    """FlexAttention's gradients against the dense references: the document-prefix pattern with its LSE (TTT's
    prefix, the block anchors' context) and the target's document-masked forward, fp32 within 1e-5; in bf16 the
    gradient error against an fp64 reference at most twice the dense bf16 reference's. -> the max errors."""
    torch.manual_seed(0)
    doc, causal = _packed_case(T=300, device=device)
    first = document_first_index(doc)
    errs: dict[str, float] = {}

    def grads(fn, dtype, *base):
        xs = [x.detach().to(dtype).requires_grad_() for x in base]
        out, lse = fn(*xs)
        (out.float().square().sum() + lse.float().nan_to_num(neginf=0.0).sum()).backward()
        return [x.grad.double() for x in xs]

    base = [torch.randn(2, 4, 300, 64, device=device), torch.randn(2, 2, 300, 64, device=device),
            torch.randn(2, 2, 300, 64, device=device)]

    def flex(q, k, v):
        return document_prefix_attention(q, k, v, causal, doc, doc, first, backend="flex")

    def ref(q, k, v):
        return document_prefix_attention_reference(q, k, v, causal, doc, doc)

    g_flex, g_ref = grads(flex, torch.float32, *base), grads(ref, torch.float32, *base)
    errs["fp32"] = max(float((a - b).abs().max()) for a, b in zip(g_flex, g_ref, strict=True))
    g_64 = grads(ref, torch.float64, *base)
    flex_bf16 = max(float((a - b).abs().max()) for a, b in zip(grads(flex, torch.bfloat16, *base), g_64, strict=True))
    ref_bf16 = max(float((a - b).abs().max()) for a, b in zip(grads(ref, torch.bfloat16, *base), g_64, strict=True))
    errs["bf16"], errs["bf16_reference"] = flex_bf16, ref_bf16
    model = _decoder().to(device)
    ids = torch.randint(0, 64, (2, 300), device=device)
    per_backend = {}
    for backend in ("flex", "sdpa"):
        set_attention_backend(model, backend)
        model.zero_grad()
        model(ids, TrainInputs(document_ids=doc)).logits.logsumexp(-1).sum().backward()
        per_backend[backend] = [p.grad.clone() for p in model.parameters()]
    errs["decoder"] = max(float((a - b).abs().max()) for a, b in zip(*per_backend.values(), strict=True))
    return errs


@pytest.mark.gpu
@CUDA
def test_flex_gradients_equal_the_references_cuda() -> None:
    errs = check_flex_gradients("cuda")
    assert errs["fp32"] <= 1e-5 and errs["decoder"] <= 1e-5, errs
    assert errs["bf16"] <= 2 * errs["bf16_reference"], errs


@pytest.mark.parametrize("kind", ["mask", "expand"])
def test_a_compiled_cached_forward_has_no_graph_break_under_dynamic_shapes(kind: str) -> None:
    """The engine compiles with dynamic=True, where head counts read from shapes are symbolic: the GQA switch must
    come out as a plain bool, or SDPA refuses it and every layer falls out of the graph (one recompile per layer,
    then eager once the recompile limit is hit)."""
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 3, 8), torch.randn(2, 2, 10, 8), torch.randn(2, 2, 10, 8)
    plan = AttentionPlan(kind, kv_len=7, mask=torch.ones(2, 1, 3, 7, dtype=torch.bool))
    torch._dynamo.reset()
    compiled = torch.compile(plan.__call__, dynamic=True, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), plan(q, k, v))

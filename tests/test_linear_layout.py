"""`models.linear`: weights stored transposed for few-row CPU GEMMs, the same layer and the same outputs."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_decoder

from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.models.linear import Linear, is_transposed, transpose_weights


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(5,), (3, 5), (2, 4, 5)], ids=["1d", "2d", "3d"])
def test_a_transposed_weight_computes_the_same_layer(bias, shape):
    torch.manual_seed(0)
    lin = Linear(5, 7, bias=bias).double()
    x = torch.randn(*shape, dtype=torch.float64)
    want = F.linear(x, lin.weight, lin.bias)
    assert transpose_weights(lin) == 1 and is_transposed(lin.weight)
    assert lin.weight.shape == (7, 5)
    torch.testing.assert_close(lin(x), want, rtol=1e-12, atol=1e-12)
    assert transpose_weights(lin) == 0  # idempotent


def test_transposed_weights_still_train_and_save_contiguous(tmp_path: Path):
    from safetensors.torch import load_file

    from angelspec.models.hf_io import save_safetensors_atomic

    torch.manual_seed(0)
    lin = Linear(4, 3)
    ref = copy.deepcopy(lin)
    transpose_weights(lin)
    x = torch.randn(6, 4)
    lin(x).square().sum().backward()
    ref(x).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    save_safetensors_atomic(dict(lin.state_dict()), tmp_path / "w.safetensors", {"format": "pt"})
    loaded = load_file(str(tmp_path / "w.safetensors"))
    assert loaded["weight"].is_contiguous() and torch.equal(loaded["weight"], ref.weight.detach())


def test_a_tied_lm_head_gets_its_own_transposed_copy_and_the_embedding_stays_row_major():
    model = tiny_decoder(dtype=torch.float32)
    assert model.lm_head.weight is model.embed_tokens.weight  # tied in the tiny config
    emb = model.embed_tokens.weight.detach().clone()
    n_linear = sum(isinstance(m, Linear) for m in model.modules())
    assert transpose_weights(model) == n_linear
    assert model.embed_tokens.weight.is_contiguous() and torch.equal(model.embed_tokens.weight, emb)
    assert is_transposed(model.lm_head.weight) and torch.equal(model.lm_head.weight, emb)
    assert all(is_transposed(m.weight) for m in model.modules() if isinstance(m, Linear))


def _greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation by full forwards without a cache (no engine, so no weight layout change)."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


@pytest.mark.parametrize("k", [1, 4])
def test_the_engine_on_cpu_transposes_and_decodes_what_the_row_major_model_decodes(k):
    from angelspec_research.oracle import OracleDrafter, greedy_continuations

    target = tiny_decoder(vocab=64)
    untouched = copy.deepcopy(target)
    prompts = [[5, 9, 11, 4], [7, 7, 8, 20, 21, 6]]
    n_new = 1 + 3 * (k + 1)  # prefill emits one token, then three full blocks
    with torch.no_grad():
        want = [_greedy_reference(untouched, p, n_new) for p in prompts]
    assert not any(is_transposed(m.weight) for m in untouched.modules() if isinstance(m, Linear))
    table = greedy_continuations(prompts, want)
    engine = SpecEngine(target, OracleDrafter(table), EngineConfig(max_batch_size=2, num_draft_tokens=k))
    assert all(is_transposed(m.weight) for m in target.modules() if isinstance(m, Linear))
    out = engine.generate([Request(p, n_new, stop_ids=()) for p in prompts])
    assert [r.token_ids for r in out] == want
    assert engine.metrics.mean_accepted_length == k + 1

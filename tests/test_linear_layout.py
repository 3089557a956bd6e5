"""`models.linear`: weights stored transposed, and the large ones prepacked (for the few-rows kernel and oneDNN), for
few-row CPU GEMMs: the same layer and the same outputs, whatever happens to the weights afterwards. The prepacked
tests run once per product kernel (`product`)."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_decoder

from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.models import few_rows
from angelspec.models import linear as linear_module
from angelspec.models.linear import PACK_KEY, Linear, is_transposed, prepack_weights, transpose_weights


@pytest.fixture(params=["few-rows", "oneDNN", "python"])
def product(request, monkeypatch):
    """How every prepacked product is made: the native op's few-rows kernel (its row limit lifted, so each test's
    products all take it, one row too), the native op with the kernel switched off (oneDNN for two rows or more), or
    the Python op where the native one is not built (oneDNN for two rows or more)."""
    if request.param != "python" and few_rows.native_op() is None:
        pytest.skip(f"the native op is not built here: {few_rows.status()}")
    if request.param != "few-rows" and linear_module._linear_pointwise is None:
        pytest.skip("this torch has no oneDNN")
    if request.param == "few-rows":
        monkeypatch.setattr(few_rows, "ROWS_PER_THREAD", 1024)
    elif request.param == "oneDNN":
        monkeypatch.setattr(few_rows, "_enabled", False)
    else:
        monkeypatch.setattr(few_rows, "_ready", False)
    few_rows._configure()
    yield request.param
    monkeypatch.undo()
    few_rows._configure()


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


def _oracle_engine_decodes_the_reference(target, untouched, k: int, **config) -> None:
    """The engine on `target` with the oracle drafter (every draft accepted) decodes what a cache-free greedy loop on
    `untouched` (a row-major copy of it made before any engine) decodes, K + 1 tokens a step."""
    from angelspec_research.oracle import OracleDrafter, greedy_continuations

    prompts = [[5, 9, 11, 4], [7, 7, 8, 20, 21, 6]]
    n_new = 1 + 3 * (k + 1)  # prefill emits one token, then three full blocks
    with torch.no_grad():
        want = [_greedy_reference(untouched, p, n_new) for p in prompts]
    assert not any(is_transposed(m.weight) for m in untouched.modules() if isinstance(m, Linear))
    table = greedy_continuations(prompts, want)
    engine = SpecEngine(target, OracleDrafter(table), EngineConfig(max_batch_size=2, num_draft_tokens=k, **config))
    out = engine.generate([Request(p, n_new, stop_ids=()) for p in prompts])
    assert [r.token_ids for r in out] == want
    assert engine.metrics.mean_accepted_length == k + 1


@pytest.mark.parametrize("k", [1, 4])
def test_the_engine_on_cpu_transposes_and_decodes_what_the_row_major_model_decodes(k):
    target = tiny_decoder(vocab=64)
    _oracle_engine_decodes_the_reference(target, copy.deepcopy(target), k)
    assert all(is_transposed(m.weight) for m in target.modules() if isinstance(m, Linear))


def _packed_layer(bias: bool = False) -> Linear:
    torch.manual_seed(0)
    lin = Linear(256, 1024, bias=bias).eval()  # 2**18 weights: above PACK_MIN_ELEMENTS
    assert lin.weight.numel() >= linear_module.PACK_MIN_ELEMENTS
    transpose_weights(lin)
    assert prepack_weights(lin) == 1 and PACK_KEY in lin._buffers
    return lin


def _calls_packed(lin: Linear, x: torch.Tensor) -> bool:
    """Whether `lin(x)` multiplies by a prepacked copy (it makes one: `linear.copies`)."""
    linear_module._drop(int(lin._buffers[PACK_KEY]))
    lin(x)
    return bool(linear_module.copies(lin))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(2, 256), (3, 5, 256), (7, 256, "t")], ids=["2d", "3d", "strided"])
def test_a_prepacked_weight_computes_the_same_layer_for_two_rows_or_more(product, bias, shape):
    lin = _packed_layer(bias)
    x = torch.randn(256, 7).t() if shape[-1] == "t" else torch.randn(*shape)  # "t": a transposed view
    with torch.no_grad():
        assert _calls_packed(lin, x)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        one = torch.randn(1, 256)  # one row: the kernel's where it runs, else the BLAS
        assert _calls_packed(lin, one) == (product == "few-rows")
        torch.testing.assert_close(lin(one), F.linear(one, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert not _calls_packed(lin, torch.randn(4, 256))  # recording gradients: the plain layer


def test_a_prepacked_layer_follows_its_weight_changed_in_place_or_replaced(product):
    lin = _packed_layer()
    x = torch.randn(5, 256)

    def check() -> None:
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-4, atol=1e-4)  # stale: O(1) off

    check()
    with torch.no_grad():
        lin.weight.mul_(-2.0)  # in place: the version counter moves
    check()
    lin.weight.data = torch.randn(1024, 256)  # another tensor under the same parameter
    check()
    lin.weight = torch.nn.Parameter(torch.randn(1024, 256))  # another parameter
    check()
    with torch.inference_mode():
        made_in_inference = torch.randn(1024, 256)
    lin.weight.data = made_in_inference  # no version counter: no copy can be trusted, the plain layer runs
    check()
    lin.weight = torch.nn.Parameter(torch.randn(1024, 256))
    check()
    lin.weight.data.mul_(3.0)  # through `.data`: no version counter moves, so the copy cannot tell ...
    prepack_weights(lin)  # ... until the next engine lays the weights out again
    check()
    with torch.no_grad(), pytest.raises(RuntimeError):  # an input of another dtype than its (copied) weight: the
        lin(x.double())  # error F.linear gives, never the copy's bytes read as another dtype
    lin.weight = torch.nn.Parameter(lin.weight.detach().double())  # a dtype no copy serves
    x = x.double()
    check()


def test_prepacking_is_inference_only_switchable_and_leaves_state_and_training_alone(product):
    lin = _packed_layer()
    state = lin.state_dict()
    assert set(state) == {"weight"}  # the key is not saved
    ref = copy.deepcopy(lin)
    x = torch.randn(6, 256)
    lin(x).square().sum().backward()  # gradients: the plain layer
    ref(x).square().sum().backward()
    torch.testing.assert_close(lin.weight.grad, ref.weight.grad)
    assert prepack_weights(lin, enabled=False) == 0 and PACK_KEY not in lin._buffers
    assert prepack_weights(torch.nn.Sequential(Linear(32, 32)).eval()) == 0  # too small to pay
    assert prepack_weights(Linear(256, 1024).double()) == 0  # fp32 only


def test_a_packed_copy_goes_with_its_layer(product):
    lin = _packed_layer()
    key = int(lin._buffers[PACK_KEY])
    with torch.no_grad():
        lin(torch.randn(3, 256))
    assert linear_module.copies(lin)
    del lin
    gc.collect()
    assert key not in linear_module._packs and few_rows.copies(key) is None


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_the_engine_with_every_weight_prepacked_decodes_what_the_row_major_model_decodes(product, monkeypatch,
                                                                                          compile):
    monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)  # the tiny model's weights too
    target = tiny_decoder(vocab=64, dtype=torch.float32)
    untouched = copy.deepcopy(target)
    for prepack in (True, False):
        _oracle_engine_decodes_the_reference(target, untouched, 4, compile=compile, prepack=prepack)
        linears = [m for m in target.modules() if isinstance(m, Linear)]
        assert all((PACK_KEY in m._buffers) == prepack for m in linears)


def test_few_row_products_take_the_kernel_and_more_rows_take_onednn():
    if not few_rows.available() or linear_module._linear_pointwise is None:
        pytest.skip("needs both the few-rows kernel and oneDNN")
    lin = _packed_layer()
    limit = few_rows.max_rows()
    with torch.no_grad():
        for rows, kernel in ((1, True), (2, True), (limit, True), (limit + 1, False)):
            linear_module._drop(int(lin._buffers[PACK_KEY]))
            x = torch.randn(rows, 256)
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)
            assert linear_module.copies(lin) == ({"rows"} if kernel else {"onednn"}), rows

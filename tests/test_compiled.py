"""Compiled forwards run the weights of the model they are called with, now: never the weights some earlier call
traced. dynamo keeps one list of compiled graphs per function and checks tensor shapes, not which tensors, so a
graph that held its weights as constants (inductor's `freezing`, or dynamo's preparation for it, which a user's
environment can switch on) would serve a second model of the same shapes with the first one's weights, and a
model whose weights changed (a drafter evaluated during training) with its old ones."""

from __future__ import annotations

import random

import pytest
import torch
import torch._dynamo.config as dynamo_config
from conftest import tiny_decoder

from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, reference_generate
from angelspec.models import Decoder
from angelspec.models import linear as linear_module


def _decoder(seed: int) -> Decoder:
    return tiny_decoder(seed=seed, dtype=torch.float32)


def _requests() -> list[Request]:
    rng = random.Random(5)
    return [Request([rng.randrange(64) for _ in range(rng.randint(3, 9))], max_new_tokens=10, stop_ids=())
            for _ in range(3)]


def _compiled_tokens(model: Decoder, reqs: list[Request]) -> list[list[int]]:
    engine = SpecEngine(model, None, EngineConfig(max_batch_size=2, compile=True, max_seq_len=32))
    return [r.token_ids for r in engine.generate(reqs)]


@pytest.mark.parametrize("prepare_freezing", [False, True], ids=["default", "TORCHDYNAMO_PREPARE_FREEZING"])
@pytest.mark.parametrize("prepack_all", [False, True], ids=["", "every-weight-prepacked"])
def test_each_model_runs_its_own_weights(prepare_freezing: bool, prepack_all: bool, monkeypatch) -> None:
    """(The options themselves: `test_attention_switch.test_cuda_graph_options_and_the_engine_switch`.) With every
    weight prepacked (`models.linear.prepack_weights`), the graphs take the layers' keys, and each copy follows its
    weight."""
    if prepack_all:
        if not linear_module.prepack_available():
            pytest.skip("this torch has no oneDNN")
        monkeypatch.setattr(linear_module, "PACK_MIN_ELEMENTS", 0)
    with dynamo_config.patch(prepare_freezing=prepare_freezing):
        torch._dynamo.reset()  # graphs traced by other tests (with other settings) must not answer for these
        reqs = _requests()
        first, second = _decoder(1), _decoder(2)
        want_first = [r.token_ids for r in reference_generate(first, reqs)]
        want_second = [r.token_ids for r in reference_generate(second, reqs)]
        assert want_first != want_second  # the two models tell their weights apart
        assert _compiled_tokens(first, reqs) == want_first
        assert _compiled_tokens(second, reqs) == want_second  # the same graphs, the second model's weights

        with torch.no_grad():  # new values in place (the engine's weight layout stays)
            for p in first.parameters():
                p.mul_(-1.5)
        changed = [r.token_ids for r in reference_generate(first, reqs)]
        assert changed != want_first
        assert _compiled_tokens(first, reqs) == changed
        assert dynamo_config.prepare_freezing is prepare_freezing  # the caller's setting is back after each call

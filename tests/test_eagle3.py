"""EAGLE-3 as a member of the MTP family: the fast TTT rollout against its explicit-mask reference, lossless
greedy decoding through the engine with exact draft-cache rollback, training with exact resume, the drafter
folder round trip, refusal of a target without the tap layers, and train + eval from the command line.

Targets are tiny (hidden 32) but have 6 layers, so the default taps (1, L//2, L-2) = (1, 3, 4) are distinct."""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import replace
from functools import partial
from pathlib import Path

import conftest
import pytest
import torch
from conftest import RecordingMixin, check_lossless_and_recorded, mtp_reference_drafts, tiny_decoder

from angelspec.decoding.drafters import get_drafter
from angelspec.decoding.drafters.base import DrafterMismatchError
from angelspec.decoding.drafters.eagle3 import Eagle3Drafter
from angelspec.decoding.drafters.mtp import MTPDrafter
from angelspec.decoding.engine import EngineConfig, Request
from angelspec.models import Decoder, load_target, save_target
from angelspec.models.config import ConfigError
from angelspec.models.decoder import TrainInputs
from angelspec.models.eagle3 import Eagle3Config, Eagle3DraftModel
from angelspec.models.hf_io import CheckpointError
from angelspec.models.mtp import concat_taps
from angelspec.models.mtp_io import load_mtp, save_mtp
from angelspec.train.ttt import RolloutMemory, ttt_rollout

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 6
TAPS = (1, 3, 4)


tiny_target = partial(tiny_decoder, layers=LAYERS)


def tiny_model(target: Decoder, depths: int = 3, seed: int = 1, std: float = 0.3) -> Eagle3DraftModel:
    model = Eagle3DraftModel(Eagle3Config.for_target(target.config, num_depths=depths), target.embed_tokens,
                        target.lm_head)
    model.init_weights(std=std, generator=torch.Generator().manual_seed(seed))
    return model.to(target.embed_tokens.weight.dtype)


def test_config_taps_shapes_and_weight_names():
    target = tiny_target()
    model = tiny_model(target)
    assert model.config.target_layer_ids == TAPS and model.config.drafter == "eagle3"
    sd = model.state_dict()
    assert sd["fc.weight"].shape == (32, 3 * 32)
    assert sd["layer.attn.qkv_proj.weight"].shape == ((4 + 2 * 2) * 8, 2 * 32)  # q/k/v read [E(x); h]: 2C wide
    assert "proj.weight" not in sd and "embed_norm.weight" not in sd  # no MTP fusion
    assert not any(k.startswith(("embed_tokens", "lm_head", "_shared")) for k in sd)
    # (1, 2, 2) is not three layers: a 4-layer target's taps are its first, middle and last layer instead
    assert Eagle3Config.for_target(tiny_target(layers=4).config).target_layer_ids == (0, 2, 3)
    assert Eagle3Config.for_target(tiny_target(layers=3).config).target_layer_ids == (0, 1, 2)
    with pytest.raises(ConfigError, match="at least 3"):
        Eagle3Config.for_target(tiny_target(layers=2).config)  # no three layers at all
    with pytest.raises(ConfigError, match="strictly increasing"):
        Eagle3Config.for_target(target.config, target_layer_ids=(3, 1, 4))
    with pytest.raises(ConfigError, match=r"\[6\] out of range"):
        Eagle3Config.for_target(target.config, target_layer_ids=(1, 3, 6))


def test_fast_ttt_matches_explicit_mask_reference():
    """Packed rows (several documents, padding): same argmax chain, states, logits and gradients (fp64)."""
    from angelspec.data.packing import Doc, pack_documents

    target = tiny_target()
    model = tiny_model(target, depths=4)
    g = torch.Generator().manual_seed(0)
    docs = [Doc(torch.randint(0, 64, (n,), generator=g), torch.ones(n, dtype=torch.long)) for n in (9, 7, 5, 12, 3)]
    packed = pack_documents(docs, 20, pad_id=0)
    assert packed.num_rows >= 2 and (packed.document_ids == -1).any()
    with torch.no_grad():
        tout = target(packed.input_ids, TrainInputs(positions=packed.positions, document_ids=packed.document_ids,
                                                    hidden_layers=list(TAPS), compute_logits=False))
    taps = concat_taps(tout.hidden)  # [B, T, 3C]
    args = (model, taps, packed.input_ids, packed.positions, packed.document_ids, 4)
    fast, ref = ttt_rollout(*args, memory=RolloutMemory(query_chunk=6)), ttt_rollout(*args, attention="reference")
    assert torch.equal(fast.inputs, ref.inputs)
    torch.testing.assert_close(fast.hidden, ref.hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(fast.logits, ref.logits, atol=1e-10, rtol=0)
    params = (model.fc.weight, model.layer.attn.qkv_proj.weight, model.hidden_norm.weight)
    gf = torch.autograd.grad(fast.logits.square().mean(), params)
    gr = torch.autograd.grad(ref.logits.square().mean(), params)
    for a, b in zip(gf, gr, strict=True):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-6)
    # depth 0 of the rollout is the teacher-forced causal pass (`forward`) over the same rows
    d0 = model(taps, packed.input_ids.roll(-1, 1), packed.positions, packed.document_ids)
    row_inner = (packed.document_ids[:, :-1] == packed.document_ids[:, 1:]) & (packed.document_ids[:, :-1] >= 0)
    torch.testing.assert_close(fast.hidden[:, :-1, 0][row_inner], d0[:, :-1][row_inner], atol=1e-10, rtol=0)


class RecordingEagle3(RecordingMixin, Eagle3Drafter):
    """Remembers each row's committed sequence and every greedy proposal made from it."""

    def allocate(self, *args, **kw):
        super().allocate(*args, **kw)
        self.start_recording()


def test_greedy_spec_decoding_is_lossless_and_drafts_match_training():
    """12 ragged prompts × 48 new tokens, batch 5 (rows refill), K=4 > D=3; every checked proposal equals the
    from-scratch training rollout on its committed prefix (the draft cache rolls back exactly)."""
    vocab = 12  # a small vocabulary, so that random weights still get drafts accepted
    target = tiny_target(vocab=vocab)
    drafter = RecordingEagle3(tiny_model(target, depths=3))
    rng = random.Random(7)
    reqs = [Request([rng.randrange(vocab) for _ in range(rng.randint(1, 20))], max_new_tokens=48, stop_ids=())
            for _ in range(12)]
    # partial accepts happen, so rollback is exercised
    got = check_lossless_and_recorded(target, drafter, reqs, EngineConfig(max_batch_size=5, num_draft_tokens=4), 7,
                                      lambda seq: mtp_reference_drafts(drafter.model, target, seq, 4))
    assert all(len(r.token_ids) == 48 for r in got)


def test_save_load_round_trip_and_tap_refusal(tmp_path):
    target = tiny_target(vocab=32)
    model = tiny_model(target)
    save_mtp(model, tmp_path / "d", {"note": "x"})
    raw = json.loads((tmp_path / "d" / "config.json").read_text())
    assert raw["architectures"] == ["AngelSpecEagle3"] and "eagle3_config" in raw
    assert raw["angelspec"]["drafter"] == "eagle3" and raw["angelspec"]["target_layer_ids"] == list(TAPS)
    assert get_drafter("eagle3") is Eagle3Drafter
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "d", target=target)
    assert isinstance(drafter.model, Eagle3DraftModel) and drafter.target_layer_ids == TAPS
    assert drafter.model.config == model.config and drafter.model._shared[0] is target.embed_tokens
    a, b = model.state_dict(), drafter.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    taps, ids = torch.randn(2, 5, 96, dtype=torch.float64), torch.randint(0, 32, (2, 5))
    pos = torch.arange(5).expand(2, 5)
    assert torch.equal(model(taps, ids, pos), drafter.model(taps, ids, pos))
    drafter.check_compatible(target.config)
    # the kind is part of the folder: the MTP loader refuses it
    with pytest.raises(CheckpointError, match="not a mtp drafter"):
        MTPDrafter.from_pretrained(tmp_path / "d", target=target)
    # a target too shallow for taps (1, 3, 4): a clear error naming the ids, before the fingerprint check
    shallow = tiny_target(vocab=32, layers=4)
    with pytest.raises(DrafterMismatchError, match=r"target layer ids \[1, 3, 4\] do not fit a target with 4 layers"):
        Eagle3Drafter.from_pretrained(tmp_path / "d", target=shallow)
    with pytest.raises(ConfigError, match="4 layers"):
        load_mtp(tmp_path / "d", shallow, kind="eagle3")


# ---------------------------------------------------------------------------------------------------------
# Trainer and CLI (a 6-layer target folder sharing the tiny tokenizer)
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def deep_target_dir(tmp_path_factory, tiny_target_dir) -> Path:
    out = tmp_path_factory.mktemp("eagle3_target") / "t"
    shutil.copytree(tiny_target_dir, out)
    base = load_target(tiny_target_dir).config
    model = Decoder(replace(base, num_hidden_layers=LAYERS))
    model.init_weights(generator=torch.Generator().manual_seed(0))
    save_target(model, out)
    return out


@pytest.fixture(scope="module")
def conversations(tmp_path_factory) -> Path:
    return conftest.write_conversations(tmp_path_factory.mktemp("eagle3_data") / "conv.jsonl", 40, seed=5)


def test_train_two_steps_and_exact_resume(tmp_path, deep_target_dir, conversations):
    from angelspec.train.eagle3 import tiny_debug, train_eagle3

    cfg = replace(tiny_debug(), steps=2, ckpt_every=1)
    kw = dict(config=cfg, progress=False, log=lambda *_: None)
    report = train_eagle3(deep_target_dir, conversations, tmp_path / "a", **kw)
    assert report["drafter"] == "eagle3" and report["steps"] == 2
    train_eagle3(deep_target_dir, conversations, tmp_path / "b", max_minutes=0, **kw)  # stops after step 1
    train_eagle3(deep_target_dir, conversations, tmp_path / "b", resume=True, **kw)
    assert "fc.weight" in conftest.same_weights(tmp_path / "a", tmp_path / "b")
    logs = conftest.train_log(tmp_path / "a")
    assert [r["objective"] for r in logs] == ["lk_alpha", "e2e_tv"] and len(logs[0]["alpha_per_depth"]) == 3
    target = load_target(deep_target_dir)
    drafter = Eagle3Drafter.from_pretrained(tmp_path / "a", target=target)
    assert drafter.target_layer_ids == TAPS


def test_train_and_eval_from_the_cli(capsys, tmp_path, deep_target_dir, conversations):
    from angelspec.cli import main

    prompts = conftest.write_domain_prompts(tmp_path / "prompts.jsonl")
    out = tmp_path / "eagle3"
    code = main(["train", "--drafter", "eagle3", "--target", str(deep_target_dir), "--data", str(conversations),
                 "--out", str(out), "--preset", "tiny_debug", "--quiet", "steps=2"])
    stdout, err = capsys.readouterr()
    assert code == 0, err
    assert f"eagle3 written to {out}" in stdout
    assert json.loads((out / "config.json").read_text())["angelspec"]["drafter"] == "eagle3"
    code = main(["eval", "--target", str(deep_target_dir), "--drafter", str(out), "--prompts", str(prompts),
                 "--max-new-tokens", "8", "--quiet"])
    stdout, err = capsys.readouterr()
    assert code == 0 and "lossless: yes (3/3" in stdout, err


def test_cli_train_on_a_too_shallow_target_and_tap_overrides(capsys, tmp_path, tiny_target_dir, conversations):
    """The 2-layer tiny target has no three distinct default taps: one clear line, nothing written. The taps
    can be set with `target_layer_ids=a,b,c`."""
    from angelspec.cli import main
    from angelspec.train.eagle3 import tiny_debug
    from angelspec.train.overrides import with_overrides

    code = main(["train", "--drafter", "eagle3", "--target", str(tiny_target_dir), "--data", str(conversations),
                 "--out", str(tmp_path / "o"), "--preset", "tiny_debug", "--quiet", "steps=1"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "at least 3" in err and "target_layer_ids" in err
    assert not (tmp_path / "o" / "config.json").exists()
    assert with_overrides(tiny_debug(), {"target_layer_ids": "0,2,5"}).target_layer_ids == (0, 2, 5)
    with pytest.raises(ValueError, match="3 comma-separated integers"):
        with_overrides(tiny_debug(), {"target_layer_ids": "1,2"})

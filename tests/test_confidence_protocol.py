"""The block drafters' confidence trained for the protocol that consumes it (our issue 15): the confidence-driven
depth policies verify ARGMAX drafts deterministically, so a "protocol" confidence head predicts 1[argmax q = argmax p]
at T = 0 and p_T(argmax q) at T > 0, per sampling temperature, and the engine hands each row's temperature to it.
Also: folders without the option behave as before ("tv"), and the confidence head alone can be re-trained on a frozen
drafter."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import conftest
import pytest
import torch
from conftest import QUIET, tiny_decoder
from test_calibrate_cli import FixedConfidences

from angelspec.decoding.drafters.block import BlockDrafterAdapter, DFlyDrafter
from angelspec.decoding.drafters.block_propose import BlockProposer
from angelspec.decoding.drafters.calibrated import CalibratedDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
from angelspec.decoding.policies.dcut import DCut
from angelspec.decoding.policies.sts import (
    CALIBRATION_FILE,
    StsCalibration,
    StsCalibrationSet,
    load_calibration,
)
from angelspec.decoding.sampling import SamplingParams
from angelspec.eval.sts_fit import collect_outcomes
from angelspec.models import ConfigError, load_target
from angelspec.models.block.config import BlockDrafterConfig
from angelspec.models.block.drafter import BlockDrafter
from angelspec.models.block.heads import ConfidenceHead, temperature_weights
from angelspec.models.decoder import TrainInputs
from angelspec.train.block import BlockDrafterTrainConfig, tiny_debug, train_dfly
from angelspec.train.confidence import argmax_drafts, confidence_targets, protocol_acceptance
from angelspec.train.losses import LossConfig, dspark_loss, dspark_position_weights
from angelspec_research.commit_prediction import CommitPredictionRecorder, predicted_commits

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, MASK = 16, 1


def tiny_target():
    return tiny_decoder(VOCAB, layers=3, heads=2, kv=1)


def tiny_block_drafter(target, *, head: str = "hidden", conditioning: str = "dfly", **design) -> BlockDrafter:
    cfg = BlockDrafterConfig.for_target(target.config, mask_token_id=MASK, block_size=4, num_draft_layers=1,
                                        target_layer_ids=(0, 2), conditioning=conditioning, head=head, markov_rank=8,
                                        **design)
    model = BlockDrafter(cfg, target.embed_tokens, target.lm_head)
    model.init_weights(std=0.3, generator=torch.Generator().manual_seed(1))
    return model.double().eval()


# ----- the target formula -----


def test_protocol_targets_on_a_hand_built_example():
    # Three rows over a 4-token vocabulary. Teacher p (logits) and student q; the draft is argmax q.
    teacher = torch.tensor([[2.0, 1.0, 0.0, -1.0],    # argmax p = 0
                            [0.0, 3.0, 1.0, 0.0],     # argmax p = 1
                            [1.0, 1.5, 0.5, 1.0]], dtype=torch.float64)  # argmax p = 1
    student = torch.tensor([[1.0, 0.9, 0.0, 0.0],     # x = 0: matches
                            [0.0, 0.0, 4.0, 0.0],     # x = 2: does not match
                            [0.0, 0.0, 0.0, 9.0]], dtype=torch.float64)  # x = 3 (outside the draft vocab below)
    got = protocol_acceptance(student, teacher, (0.0, 0.5, 1.0))
    p1 = torch.softmax(teacher, -1)
    p_half = torch.softmax(teacher / 0.5, -1)
    x = torch.tensor([0, 2, 3])
    rows = torch.arange(3)
    assert got[:, 0].tolist() == [1.0, 0.0, 0.0]  # T = 0: 1[argmax q = argmax p]
    torch.testing.assert_close(got[:, 2], p1[rows, x])  # T = 1: p(argmax q)
    torch.testing.assert_close(got[:, 1], p_half[rows, x])  # T = 0.5: p_{0.5}(x) = p(x)² / Σ p²
    torch.testing.assert_close(got[0, 1], p1[0, 0] ** 2 / (p1[0] ** 2).sum())
    # Not α: row 0's targets are 1 (T = 0) and p(x) = 0.64 (T = 1), where 1 − TV(p, q) = Σ min(p, q) = 0.73.
    alpha = torch.minimum(p1[0], torch.softmax(student[0], -1)).sum()
    assert abs(float(got[0, 2]) - float(alpha)) > 0.05 and abs(float(got[0, 0]) - float(alpha)) > 0.2
    # With a draft vocabulary {0, 1, 2}, row 2's draft is the best id inside it (0, 1, 2 tie at 0 -> id 0).
    vocab = torch.tensor([0, 1, 2])
    assert argmax_drafts(student, vocab).tolist() == [0, 2, 0]
    got_v = protocol_acceptance(student, teacher, (0.0, 1.0), vocab)
    torch.testing.assert_close(got_v[2], torch.stack([torch.tensor(0.0, dtype=torch.float64), p1[2, 0]]))


def test_confidence_targets_follow_the_config_and_the_mask():
    target = tiny_target()
    proto = tiny_block_drafter(target, confidence_target="protocol", confidence_temperatures=(0.0, 1.0)).config
    tv = tiny_block_drafter(target).config
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(2, 3, VOCAB, generator=g).double(), torch.randn(2, 3, VOCAB, generator=g).double()
    mask = torch.tensor([[True, True, False], [True, False, False]])
    out = confidence_targets(proto, s, t, mask)
    assert out.shape == (2, 3, 2) and (out[~mask] == 0).all()
    torch.testing.assert_close(out[mask], protocol_acceptance(s[mask], t[mask], (0.0, 1.0)))
    from angelspec.train.losses import token_alpha

    out_tv = confidence_targets(tv, s, t, mask)
    assert out_tv.shape == (2, 3)
    torch.testing.assert_close(out_tv[mask], token_alpha(s[mask], t[mask]))


def test_dspark_loss_fits_the_given_protocol_targets():
    g = torch.Generator().manual_seed(1)
    n, k = 3, 4
    s = torch.randn(n, k, VOCAB, generator=g, dtype=torch.float64)
    t = torch.randn(n, k, VOCAB, generator=g, dtype=torch.float64)
    y = torch.randint(0, VOCAB, (n, k), generator=g)
    m = torch.rand(n, k, generator=g) > 0.3
    c = torch.randn(n, k, 2, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.rand(n, k, 2, generator=g, dtype=torch.float64)
    loss = dspark_loss(s, t, y, m, c, LossConfig(gamma=2.0), confidence_targets=targets).loss
    (g_c,) = torch.autograd.grad(loss, c)
    # ∂/∂c_j of the position-weighted mean of BCE averaged over the two temperatures: w_k (σ(c_j) − y_j) / (2 Σ w).
    pos = (dspark_position_weights(k, 2.0, dtype=torch.float64) * m)[..., None]
    torch.testing.assert_close(g_c, pos * (torch.sigmoid(c.detach()) - targets) / (2 * pos.sum()))


# ----- the temperature-conditioned head -----


def test_temperature_weights_interpolate_and_clamp():
    grid = (0.0, 0.5, 1.0)
    w = temperature_weights(torch.tensor([0.0, 0.25, 0.5, 0.8, 1.0, 2.0]), grid)
    expected = torch.tensor([[1, 0, 0], [0.5, 0.5, 0], [0, 1, 0], [0, 0.4, 0.6], [0, 0, 1], [0, 0, 1]])
    torch.testing.assert_close(w, expected.float())
    assert temperature_weights(torch.tensor([3.0]), (0.7,)).tolist() == [[1.0]]


def test_protocol_head_reads_the_row_temperature_and_the_tv_head_ignores_it():
    torch.manual_seed(0)
    head = ConfidenceHead(6, 2, (0.0, 0.5, 1.0)).double()
    h, e = torch.randn(2, 3, 6, dtype=torch.float64), torch.randn(2, 3, 2, dtype=torch.float64)
    cols = head.all_logits(h, e)  # [2, 3, 3]
    got = head(h, e, torch.tensor([[0.25], [1.0]]))  # row 0 at T = 0.25, row 1 at T = 1
    torch.testing.assert_close(got[0], (0.5 * cols[0, :, 0] + 0.5 * cols[0, :, 1]).float())
    torch.testing.assert_close(got[1], cols[1, :, 2].float())
    torch.testing.assert_close(head(h, e), cols[..., 0].float())  # no temperature: greedy
    assert head.training_logits(h, e).shape == (2, 3, 3)
    tv = ConfidenceHead(6, 2).double()
    assert tv.proj.out_features == 1 and tv.training_logits(h, e).shape == (2, 3)
    torch.testing.assert_close(tv(h, e, torch.tensor([[0.0], [1.0]])), tv(h, e))


def test_engine_hands_each_rows_temperature_to_a_protocol_head():
    target = tiny_target()
    model = tiny_block_drafter(target, confidence_target="protocol", confidence_temperatures=(0.0, 1.0))
    drafter = DFlyDrafter(model)
    seen = []
    head = model.confidence
    forward = head.forward

    def spy(h, e, temperature=None):  # the confidence head as the drafting step calls it
        out = forward(h, e, temperature)
        greedy = forward(h, e, None)  # the same step, read at T = 0
        seen.append((None if temperature is None else temperature.flatten().clone(), out.clone(), greedy.clone()))
        return out

    head.forward = spy
    reqs = [Request([4, 5, 6], max_new_tokens=6, sampling=SamplingParams(temperature=t, seed=1), stop_ids=())
            for t in (0.0, 1.0)]
    SpecEngine(target, drafter, EngineConfig(max_batch_size=2, num_draft_tokens=3), depth_policy=DCut()).generate(reqs)
    temps, conf, greedy = seen[0]
    assert temps is not None and temps.tolist() == [0.0, 1.0]
    # The confidences are the head's at those temperatures: row 1's differ from what it would say at T = 0.
    torch.testing.assert_close(conf[0], greedy[0])
    assert not torch.allclose(conf[1], greedy[1])


@pytest.mark.parametrize("kind", ["dfly", "dspark"])
def test_shipped_folders_keep_the_tv_head_and_ignore_the_temperature(kind):
    from angelspec.assets import DEFAULT_DRAFTERS, DEFAULT_TARGET

    target = load_target(DEFAULT_TARGET)
    drafter = BlockDrafterAdapter.from_pretrained(DEFAULT_DRAFTERS / kind, target=target)
    cfg = drafter.model.config
    assert cfg.confidence_target == "tv" and cfg.confidence_temperatures == ()
    assert drafter.model.confidence.proj.out_features == 1
    model = drafter.model
    ids = torch.tensor([[100, 101, 102, 103, 104, 105]])
    with torch.no_grad():
        taps = target(ids, TrainInputs(hidden_layers=list(cfg.target_layer_ids), compute_logits=False)).hidden
        from angelspec.models.mtp import concat_taps

        args = (concat_taps(taps)[:, :5].expand(2, -1, -1), torch.tensor([5, 5]), ids[:, 5].expand(2))
        plain = BlockProposer(model).propose_from_taps(*args)
        cache = model.new_cache(2, 5, slack=0, dtype=taps[0].dtype, device="cpu")
        model.append_context(args[0], cache, num_new=args[1])
        at_t = BlockProposer(model).propose(args[2], cache, kv_len=5, temperature=torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(at_t.confidences, plain.confidences, rtol=0, atol=0)
    # The one-output head's formula, from the saved tensors: σ(w·[h; W1 x_prev] + b).
    h = model.norm(model.backbone_step(args[2], cache, 5)[:, 1:])
    prev = torch.cat([args[2][:, None], plain.tokens[:, :-1]], dim=1)
    w, b = model.confidence.proj.weight, model.confidence.proj.bias
    by_hand = torch.sigmoid((torch.cat([h, model.markov_embed(prev).to(h.dtype)], -1) @ w.t() + b)[..., 0].float())
    torch.testing.assert_close(plain.confidences, by_hand.detach())


def test_bad_confidence_settings_are_clear_errors():
    target = tiny_target()
    with pytest.raises(ConfigError, match="unknown confidence_target"):
        tiny_block_drafter(target, confidence_target="alpha")
    with pytest.raises(ConfigError, match="takes no temperatures"):
        tiny_block_drafter(target, confidence_target="tv", confidence_temperatures=(0.0,))
    with pytest.raises(ConfigError, match="strictly increasing"):
        tiny_block_drafter(target, confidence_target="protocol", confidence_temperatures=(1.0, 0.0))
    with pytest.raises(ConfigError, match="strictly increasing"):
        BlockDrafterTrainConfig(confidence_temperatures=())
    with pytest.raises(ConfigError, match="needs init_from"):
        BlockDrafterTrainConfig(only="confidence")
    with pytest.raises(ConfigError, match="train these parts alone"):
        BlockDrafterTrainConfig(only="backbone", init_from="x")
    assert BlockDrafterTrainConfig().confidence_target == "protocol"  # the default for new runs
    from angelspec.train.overrides import with_overrides

    cfg = with_overrides(BlockDrafterTrainConfig(), {"confidence_temperatures": "0,0.7"})
    assert cfg.confidence_temperatures == (0.0, 0.7)


# ----- training -----


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    return conftest.write_conversations(tmp_path_factory.mktemp("conf_data") / "conv.jsonl", 40, seed=7)


@pytest.fixture(scope="module")
def protocol_dfly(tmp_path_factory, tiny_target_dir, conversations):
    """A DFly trained for one step with the defaults of a new run (a protocol head at T = 0 and 1)."""
    out = tmp_path_factory.mktemp("protocol") / "dfly"
    train_dfly(tiny_target_dir, conversations, out, config=replace(tiny_debug(), steps=1,
                                                                   confidence_temperatures=(0.0, 1.0)), **QUIET)
    return out


def test_a_new_run_trains_a_protocol_head(protocol_dfly, tiny_target_dir):
    raw = json.loads((protocol_dfly / "config.json").read_text())
    assert raw["block_drafter_config"]["confidence_target"] == "protocol"
    assert raw["block_drafter_config"]["confidence_temperatures"] == [0.0, 1.0]
    drafter = DFlyDrafter.from_pretrained(protocol_dfly, target=load_target(tiny_target_dir))
    assert drafter.model.confidence.proj.out_features == 2


def test_confidence_only_training_changes_only_the_confidence_head(capsys, tmp_path, tiny_target_dir, conversations):
    from safetensors.torch import load_file

    from angelspec.train.confidence import is_confidence_parameter

    base = tmp_path / "tv"
    train_dfly(tiny_target_dir, conversations, base, config=replace(tiny_debug(), steps=1, confidence_target="tv"),
               **QUIET)
    out = tmp_path / "conf"
    args = ["train", "--drafter", "dfly", "--target", str(tiny_target_dir), "--data", str(conversations),
            "--out", str(out), "--init-from", str(base), "--only", "confidence", "--preset", "tiny_debug", "--quiet",
            "steps=2", "ckpt_every=1"]
    code, stdout, err = conftest.run_cli(capsys, *args)
    assert code == 0, err
    before, after = load_file(str(base / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert before.keys() == after.keys()
    frozen = [k for k in before if not is_confidence_parameter(k)]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)  # backbone and head bit for bit
    assert after["confidence.proj.weight"].shape[0] == 3 and before["confidence.proj.weight"].shape[0] == 1
    # Each output started as the old head's (warm start) and then moved.
    assert not torch.allclose(after["confidence.proj.weight"], before["confidence.proj.weight"].expand(3, -1))
    assert not torch.equal(after["confidence_embed.weight"], before["confidence_embed.weight"])
    raw = json.loads((out / "config.json").read_text())
    assert raw["block_drafter_config"]["confidence_target"] == "protocol"
    assert raw["angelspec"]["objective"] == "confidence" and raw["angelspec"]["train_config"]["init_from"] == str(base)
    assert [r["objective"] for r in conftest.train_log(out)] == ["confidence", "confidence"]
    # Resumable like any run: stopped after one step and resumed, the same folder bit for bit.
    again = tmp_path / "again"
    code, _, err = conftest.run_cli(capsys, *[a if a != str(out) else str(again) for a in args], "--max-minutes",
                                    "0.0001")
    assert code == 0, err
    code, _, err = conftest.run_cli(capsys, *[a if a != str(out) else str(again) for a in args], "--resume")
    assert code == 0, err
    conftest.same_weights(out, again)


def test_init_from_without_only_warm_starts_the_whole_drafter(capsys, tmp_path, tiny_target_dir, conversations):
    """`--init-from DIR` alone trains all of the folder's drafter on from its weights; anchor_fusion=true adds the
    fused anchor input at zero, so before any update the new drafter is the folder's."""
    from safetensors.torch import load_file

    base = tmp_path / "base"
    train_dfly(tiny_target_dir, conversations, base, config=replace(tiny_debug(), steps=1, confidence_target="tv"),
               **QUIET)
    def args(start: Path, out: str, *settings: str) -> list[str]:
        return ["train", "--drafter", "dfly", "--target", str(tiny_target_dir), "--data", str(conversations),
                "--init-from", str(start), "--preset", "tiny_debug", "--quiet", "--out", str(tmp_path / out),
                "anchor_fusion=true", "block_size=3", *settings]


    code, _, err = conftest.run_cli(capsys, *args(base, "still", "steps=1", "lr=0"))
    assert code == 0, err
    before, still = load_file(str(base / "model.safetensors")), load_file(str(tmp_path / "still" / "model.safetensors"))
    assert set(still) - set(before) == {"anchor_fuse.weight", "anchor_norm.weight"}
    assert all(torch.equal(before[k], still[k]) for k in before) and not still["anchor_fuse.weight"].any()
    target = load_target(tiny_target_dir)
    old = DFlyDrafter.from_pretrained(base, target=target).model
    new = DFlyDrafter.from_pretrained(tmp_path / "still", target=target).model
    assert new.config.anchor_fusion and new.config.block_size == old.config.block_size != 3  # the folder's design
    taps = torch.randn(1, 6, old.config.num_taps * old.config.hidden_size)
    anchor = torch.tensor([5])
    torch.testing.assert_close(BlockProposer(new).propose_from_taps(taps, torch.tensor([6]), anchor).logits,
                               BlockProposer(old).propose_from_taps(taps, torch.tensor([6]), anchor).logits,
                               rtol=0, atol=0)

    code, _, err = conftest.run_cli(capsys, *args(base, "moved", "steps=2"))
    assert code == 0, err
    moved = load_file(str(tmp_path / "moved" / "model.safetensors"))
    assert moved["anchor_fuse.weight"].any()
    assert not torch.equal(moved["layers.0.attn.qkv_proj.weight"], before["layers.0.attn.qkv_proj.weight"])
    raw = json.loads((tmp_path / "moved" / "config.json").read_text())
    assert raw["angelspec"]["train_config"]["init_from"] == str(base) and raw["angelspec"]["objective"] == "dfly"
    # Stopped and resumed with the start folder named by another path: the same run, bit for bit.
    shutil.copytree(base, tmp_path / "base-copy")
    again = args(tmp_path / "base-copy", "again", "steps=2", "ckpt_every=1")
    code, _, err = conftest.run_cli(capsys, *again, "--max-minutes", "0.0001")
    assert code == 0, err
    code, _, err = conftest.run_cli(capsys, *again, "--resume")
    assert code == 0, err
    conftest.same_weights(tmp_path / "moved", tmp_path / "again")


def test_confidence_only_refusals(capsys, tmp_path, tiny_target_dir, conversations):
    base = tmp_path / "tv"
    train_dfly(tiny_target_dir, conversations, base, config=replace(tiny_debug(), steps=1), **QUIET)
    common = ["--target", str(tiny_target_dir), "--data", str(conversations), "--quiet", "--only", "confidence",
              "--preset", "tiny_debug"]
    code, _, err = conftest.run_cli(capsys, "train", "--drafter", "dspark", "--out", str(tmp_path / "x"),
                                    "--init-from", str(base), *common)
    conftest.assert_bad_input(code, err, "holds a dfly drafter, not dspark")
    code, _, err = conftest.run_cli(capsys, "train", "--drafter", "dfly", "--out", str(base), "--force",
                                    "--init-from", str(base), *common)
    conftest.assert_bad_input(code, err, "lies in --out")
    assert (base / "model.safetensors").is_file()  # untouched
    code, _, err = conftest.run_cli(capsys, "train", "--drafter", "dfly", "--out", str(tmp_path / "y"),
                                    "--init-from", str(tmp_path / "nowhere"), *common)
    conftest.assert_bad_input(code, err, "not a drafter folder")
    code, _, err = conftest.run_cli(capsys, "train", "--drafter", "mtp", "--out", str(tmp_path / "z"),
                                    "--init-from", str(base), *common)
    conftest.assert_bad_input(code, err, "--init-from applies to the block drafters")


# ----- calibration per sampling temperature -----


def _fits() -> StsCalibrationSet:
    return StsCalibrationSet((StsCalibration(temperatures=(2.0, 2.0), sampling_temperature=1.0),
                              StsCalibration(temperatures=(0.5, 0.25), sampling_temperature=0.0)))


def test_old_calibration_files_are_greedy_fits(tmp_path):
    (tmp_path / CALIBRATION_FILE).write_text(json.dumps({"method": "sts", "temperatures": [2.0, 0.5]}))
    cal = load_calibration(tmp_path)
    assert cal.sampling_temperatures == (0.0,) and cal.fits[0].temperatures == (2.0, 0.5)
    assert cal.fit_for(1.0) is cal.fits[0]  # the only fit serves every temperature
    # Several fits round-trip through the file, sorted by temperature; one fit keeps the old single-fit form.
    fits = _fits()
    assert fits.sampling_temperatures == (0.0, 1.0)
    fits.save(tmp_path)
    assert load_calibration(tmp_path) == fits
    assert set(json.loads((tmp_path / CALIBRATION_FILE).read_text())) == {"method", "fits"}
    StsCalibrationSet((fits.fits[1],)).save(tmp_path)
    assert json.loads((tmp_path / CALIBRATION_FILE).read_text())["temperatures"] == [2.0, 2.0]
    with pytest.raises(ValueError, match="one fit per sampling temperature"):
        StsCalibrationSet((fits.fits[0], fits.fits[0]))


def test_each_row_uses_the_fit_of_the_nearest_temperature():
    target = tiny_target()
    drafter = CalibratedDrafter(FixedConfidences([0.25, 0.5]), _fits())
    seen = []

    def policy(proposal, state):
        seen.append(proposal.confidences.clone())
        return torch.zeros_like(state.seq_lens)

    temps = [0.0, 1.0, 0.7, 0.5, 3.0]  # 0.5 is halfway: the lower fit; 3.0 is far: the nearest (1.0)
    reqs = [Request([4, 5], max_new_tokens=2, sampling=SamplingParams(temperature=t, seed=i), stop_ids=())
            for i, t in enumerate(temps)]
    SpecEngine(target, drafter, EngineConfig(max_batch_size=5, num_draft_tokens=2), depth_policy=policy).generate(reqs)
    greedy, hot = [0.25 ** 2, 0.5 ** 4], [0.25 ** 0.5, 0.5 ** 0.5]  # c^(1/T_k) with T_k of each fit
    for row, want in enumerate([greedy, hot, hot, greedy, hot]):
        assert seen[0][row].tolist() == pytest.approx(want), row
    assert drafter.temperature_note(0.2) is None and drafter.temperature_note(1.2) is None
    note = drafter.temperature_note(3.0)
    assert "calibrated at temperature 0, 1" in note and "use the fit at 1" in note and "--temperature 3" in note
    assert "used at temperature 0.7" in drafter.describe(0.7).splitlines()[1]


def test_calibration_at_t1_verifies_argmax_drafts_and_adds_a_fit(capsys, tmp_path, tiny_target_dir, protocol_dfly):
    import shutil

    folder = tmp_path / "dfly"
    shutil.copytree(protocol_dfly, folder)
    target = load_target(tiny_target_dir)
    drafter = DFlyDrafter.from_pretrained(folder, target=target)
    proposals = conftest.record_proposals(drafter)
    collect_outcomes(target, drafter, [[4, 5, 6, 7], [8, 9]], name="d", max_new_tokens=8, num_draft_tokens=3,
                     batch_size=2, temperature=1.0)
    assert proposals and all(p.deterministic and p.probs is None for p in proposals)  # what D-cut verifies
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["def add(x, y):", "What is 7 + 8?"]))
    args = ["calibrate", "--target", tiny_target_dir, "--drafter", folder, "--prompts", prompts,
            "--max-new-tokens", 12, "--num-draft-tokens", 3, "--quiet"]
    code, out, err = conftest.run_cli(capsys, *args)
    assert code == 0, err
    code, out, err = conftest.run_cli(capsys, *args, "--temperature", 1)
    assert code == 0, err
    assert "at sampling temperature 1 on" in out
    first = load_calibration(folder)
    assert first.sampling_temperatures == (0.0, 1.0)
    code, _, err = conftest.run_cli(capsys, *args, "--temperature", 1)  # that fit exists
    conftest.assert_bad_input(code, err, "already exists; pass --force", "temperature 1")
    code, _, err = conftest.run_cli(capsys, *args, "--temperature", 1, "--force", "--max-new-tokens", 6)
    assert code == 0, err
    again = load_calibration(folder)
    assert again.sampling_temperatures == (0.0, 1.0) and again.fits[0] == first.fits[0]  # the T = 0 fit is kept
    code, _, err = conftest.run_cli(capsys, *args, "--temperature", -1)
    conftest.assert_bad_input(code, err, "--temperature must be a number >= 0")
    # generate at a temperature far from both fits says which fit it uses.
    code, _, err = conftest.run_cli(capsys, "generate", "--target", tiny_target_dir, "--drafter", folder,
                                    "--prompts", prompts, "--out", tmp_path / "gen.jsonl", "--max-new-tokens", 4,
                                    "--temperature", 2, "--quiet")
    assert code == 0 and "use the fit at 1" in err, err


# ----- D-cut's predicted vs measured committed tokens -----


def test_predicted_commits_by_hand():
    conf = torch.tensor([[0.5, 0.5, 0.5], [1.0, 0.0, 1.0], [float("nan"), 2.0, 0.5]])
    got = predicted_commits(conf, torch.tensor([2, 3, 1]))
    # 1 + .5 + .25;  1 + 1 + 0 + 0;  NaN -> 0 as the policies sanitise it: 1 + 0
    assert got.tolist() == [1.75, 2.0, 1.0]


@pytest.mark.parametrize("reject", [False, True])
def test_prediction_bookkeeping_counts_active_rows_at_the_chosen_depth(reject):
    from angelspec.decoding.engine import reference_generate
    from angelspec_research.oracle import OracleDrafter, greedy_continuations

    target = tiny_target()
    prompts = [[4, 5, 6], [7], [8, 9, 10, 11], [12, 13], [5]]
    reqs = [Request(p, max_new_tokens=n, stop_ids=()) for p, n in zip(prompts, (9, 4, 13, 6, 7), strict=True)]
    ar = reference_generate(target, reqs)
    drafter = OracleDrafter(greedy_continuations(prompts, [r.token_ids for r in ar]), reject=reject, vocab_size=VOCAB)
    recorder = CommitPredictionRecorder()
    engine = SpecEngine(target, drafter, EngineConfig(max_batch_size=3, num_draft_tokens=3),
                        depth_policy=DCut(ratios=(0.5,)), on_verify=recorder)
    results = engine.generate(reqs)
    got = recorder.summary()
    assert got.row_steps == sum(r.num_steps - 1 for r in results)  # every active row-step, no idle row
    # Confidences are 1, so D-cut's prediction is depth + 1 at whatever depth it chose.
    assert got.predicted == pytest.approx(got.depth + 1)
    if reject:  # every draft rejected: one committed token per step, the prediction over-confident
        assert got.measured == 1.0 and got.ratio == pytest.approx(got.depth + 1)
    else:  # every verified draft accepted: the prediction is exact
        assert got.measured == pytest.approx(got.predicted) and 0 < got.depth < 3


def test_benchmark_prints_predicted_and_measured_per_temperature(capsys, tiny_target_dir, protocol_dfly, tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "confidence_protocol.py"
    spec = importlib.util.spec_from_file_location("confidence_protocol", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "domain": d}) + "\n" for d, p in conftest.DOMAIN_PROMPTS))
    code = bench.main(["--target", str(tiny_target_dir), "--drafter", str(protocol_dfly), "--prompts", str(prompts),
                       "--limit", "1", "--max-new-tokens", "6", "--policy", "dcut:0.5", "--quiet"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith(str(protocol_dfly)[-40:])]
    assert [r[-6] for r in rows] == ["0", "1"]  # one row per temperature
    assert all("protocol" in line for line in out.splitlines()[2:])
    for r in rows:
        predicted, measured, ratio = float(r[-4]), float(r[-3]), float(r[-2])
        assert int(r[-5]) > 0 and predicted >= 1 and measured >= 1 and ratio == pytest.approx(predicted / measured,
                                                                                              abs=2e-3)


def test_a_run_begun_before_the_option_resumes_as_tv(tmp_path, tiny_target_dir, conversations):
    from angelspec.train.checkpoint import TRAINER_STATE, ResumeError

    tv = replace(tiny_debug(), steps=2, ckpt_every=1, confidence_target="tv")
    train_dfly(tiny_target_dir, conversations, tmp_path / "whole", config=tv, **QUIET)
    train_dfly(tiny_target_dir, conversations, tmp_path / "old", config=tv, max_minutes=0, **QUIET)  # stops at 1
    state_file = tmp_path / "old" / "training" / "checkpoint" / TRAINER_STATE
    state = json.loads(state_file.read_text())
    # as written before them (init_from is free to change on resume, so a checkpoint does not record it)
    assert "init_from" not in state["train_config"]
    for key in ("confidence_target", "confidence_temperatures", "only"):
        del state["train_config"][key]
    state_file.write_text(json.dumps(state))
    with pytest.raises(ResumeError, match=r"train_config\.confidence_target: checkpoint 'tv' vs now 'protocol'"):
        train_dfly(tiny_target_dir, conversations, tmp_path / "old", config=replace(tv, confidence_target="protocol"),
                   resume=True, **QUIET)
    train_dfly(tiny_target_dir, conversations, tmp_path / "old", config=tv, resume=True, **QUIET)
    conftest.same_weights(tmp_path / "whole", tmp_path / "old")


def test_confidence_only_drafter_warm_starts_or_adds_the_head(tmp_path):
    from angelspec.models.block.io import save_block_drafter
    from angelspec.train.confidence import confidence_only_drafter, warm_start_outputs

    w = torch.tensor([[1.0, 2.0], [3.0, 6.0]])  # a head at T = 0 and 1, re-gridded to 0, 0.5, 1 and to one output
    torch.testing.assert_close(warm_start_outputs(w, (0.0, 1.0), (0.0, 0.5, 1.0)), torch.tensor([[1.0, 2], [2, 4],
                                                                                                 [3, 6]]))
    torch.testing.assert_close(warm_start_outputs(w[:, 0], (0.0, 1.0), ()), torch.tensor([3.0]))
    target = tiny_target()
    bare = tiny_block_drafter(target, confidence_head=False)
    save_block_drafter(bare, tmp_path / "bare")
    model = confidence_only_drafter(tmp_path / "bare", target, kind="dfly", confidence_target="protocol",
                                    temperatures=(0.0, 1.0), seed=0, init_std=0.02)
    assert model.config.confidence_head and model.confidence.proj.out_features == 2
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {"confidence.proj.weight", "confidence.proj.bias", "confidence_embed.weight"}
    old = bare.state_dict()
    assert all(torch.equal(t, old[n]) for n, t in model.state_dict().items() if n in old)

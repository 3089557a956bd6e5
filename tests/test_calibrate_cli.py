"""`angelspec calibrate` and calibrated confidences: the on_verify recorder's labels, the logit transform,
`CalibratedDrafter` (calibrated, sanitised confidences), and the CLI on the tiny target with a tiny draft LM
(a perturbed copy of the target, so some drafts are accepted and some are not), picked up by `eval`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from angelspec.cli import main
from angelspec.data.tokenizer import load_tokenizer
from angelspec.decoding.drafters.base import Drafter, DraftState, Proposal
from angelspec.decoding.drafters.calibrated import CalibratedDrafter
from angelspec.decoding.drafters.draft_lm import DraftLMDrafter
from angelspec.decoding.engine import EngineConfig, Request, SpecEngine, VerifyEvent
from angelspec.decoding.loading import resolve_drafter
from angelspec.decoding.policies.dcut import DCut
from angelspec.decoding.policies.sts import (
    CALIBRATION_FILE,
    CalibrationError,
    StsCalibration,
    temperatures_for,
)
from angelspec.eval.sts_fit import ConfidenceRecorder, confidence_logits, drafter_folder
from angelspec.models import load_target, save_target

PROMPTS = ["def add(x, y):", "Tom has 3 apples and buys 4 more.", "What is 7 + 8?", "The cache stores tokens.",
           "Write a function that merges two lists.", "What does a drafter do?"]


def run(capsys: pytest.CaptureFixture[str], *args: object) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, tiny_target_dir: Path) -> Path:
    """A draft LM folder (its confidences: its own max prob). The random tiny target greedily repeats one
    token; the draft is the target with that token's (tied) output row scaled by 0.6, so the draft agrees
    with the target in about a third of the contexts: both outcomes occur."""
    model = load_target(tiny_target_dir)
    ids = load_tokenizer(tiny_target_dir).apply_chat_template([{"role": "user", "content": PROMPTS[0]}],
                                                              add_generation_prompt=True, enable_thinking=False)
    with torch.no_grad():
        top = int(model(torch.tensor([ids])).logits[0, -1].argmax())
        model.lm_head.weight[top] *= 0.6
    out = tmp_path_factory.mktemp("draft") / "draft_lm"
    save_target(model, out)
    raw = json.loads((out / "config.json").read_text())
    raw["angelspec"] = {"drafter": "draft-lm", "target_fingerprint": model.config.fingerprint()}
    (out / "config.json").write_text(json.dumps(raw))
    return out


@pytest.fixture
def prompts_file(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return path


def event(conf: list[list[float]] | None, depth: list[int], acc: list[int], active: list[bool]) -> VerifyEvent:
    b = len(depth)
    k = len(conf[0]) if conf else 3
    return VerifyEvent(proposal=Proposal(tokens=torch.zeros(b, k, dtype=torch.int64),
                                         confidences=None if conf is None else torch.tensor(conf)),
                       depth=torch.tensor(depth), num_accepted=torch.tensor(acc), active=torch.tensor(active))


# ----- recorder and logits ---------------------------------------------------------------------------
def test_confidence_logits_clip_and_mark_invalid() -> None:
    z = confidence_logits(torch.tensor([0.5, 0.0, 1.0, float("nan"), 1.5, -0.1]))
    assert z[0] == 0 and z[1] == pytest.approx(-math.log(1e6), rel=1e-4) and z[2] == pytest.approx(math.log(1e6),
                                                                                                     rel=1e-4)
    assert torch.isnan(z[3:]).all()
    p = torch.tensor([0.2, 0.7])
    assert torch.sigmoid(confidence_logits(p)).float().tolist() == pytest.approx(p.tolist())


def test_recorder_labels_the_accepted_prefix_and_skips_unobserved_rows() -> None:
    rec = ConfidenceRecorder("toy")
    conf = [[0.9, 0.8, 0.7], [0.6, 0.5, 0.4], [0.3, 0.2, 0.1], [0.5, 0.5, 0.5]]
    # row 0: full depth, 2 accepted; row 1: depth 2, first rejected; row 2: depth 1, all accepted (unobserved);
    # row 3: idle
    rec(event(conf, depth=[3, 2, 1, 0], acc=[2, 0, 1, 0], active=[True, True, True, False]))
    logits, accepted = rec.tensors()
    assert accepted.tolist() == [[True, True, False], [False, False, False]]
    assert torch.sigmoid(logits).float()[:, 0].tolist() == pytest.approx([0.9, 0.6])
    assert rec.unobserved == 1


def test_drafters_without_confidences_are_named() -> None:
    rec = ConfidenceRecorder("my-drafter")
    with pytest.raises(CalibrationError, match="drafter my-drafter reports no confidences"):
        rec(event(None, depth=[1], acc=[0], active=[True]))
    with pytest.raises(CalibrationError, match="no draft block of my-drafter"):
        ConfidenceRecorder("my-drafter").tensors()


def test_drafter_folder_needs_a_folder(draft_dir: Path) -> None:
    assert drafter_folder(str(draft_dir)) == drafter_folder(f"draft-lm:{draft_dir}") == draft_dir
    with pytest.raises(CalibrationError, match="needs a drafter folder"):
        drafter_folder("ngram")


# ----- calibrated drafter -----------------------------------------------------------------------------
class FixedConfidences(Drafter):
    """Proposes token 0 with the given raw confidences (to check what reaches the depth policy)."""

    def __init__(self, conf: list[float]) -> None:
        self.conf = torch.tensor(conf)

    def prefill(self, rows, prompts, first_tokens, target_hidden) -> None:
        pass

    def propose(self, state: DraftState) -> Proposal:
        b, k = state.seq_lens.shape[0], state.num_draft_tokens
        return Proposal(tokens=torch.zeros(b, k, dtype=torch.int64), confidences=self.conf[:k].expand(b, k),
                        deterministic=True)

    def on_commit(self, commit) -> None:
        pass


def test_calibrated_drafter_calibrates_and_sanitises(target_model) -> None:
    cal = StsCalibration(temperatures=(2.0, 0.5))
    assert temperatures_for(cal, 3) == [2.0, 0.5, 0.5] and temperatures_for(cal, 1) == [2.0]
    drafter = CalibratedDrafter(FixedConfidences([0.25, 0.5, float("nan"), 1.7]), cal)
    seen = []

    def policy(proposal: Proposal, state: DraftState) -> torch.Tensor:
        seen.append(proposal.confidences.clone())
        return torch.zeros_like(state.seq_lens)

    engine = SpecEngine(target_model, drafter, EngineConfig(max_batch_size=1, num_draft_tokens=4),
                        depth_policy=policy)
    engine.generate([Request(prompt_ids=[1, 2], max_new_tokens=2, stop_ids=())])
    c = seen[0][0].tolist()
    assert c[:2] == pytest.approx([0.25**0.5, 0.5**2])  # c^(1/T)
    assert c[2:] == [0.0, 1.0]  # NaN -> 0, above 1 -> 1: nothing outside [0, 1] reaches the policy
    assert drafter.bad_count == 2 * len(seen)


@pytest.fixture(scope="module")
def target_model(tiny_target_dir: Path):
    return load_target(tiny_target_dir)


def test_resolve_drafter_applies_calibration(target_model, tiny_target_dir: Path, draft_dir: Path,
                                             tmp_path: Path) -> None:
    import shutil

    folder = tmp_path / "calibrated"
    shutil.copytree(draft_dir, folder)
    assert isinstance(resolve_drafter(str(folder), target_model, tiny_target_dir), DraftLMDrafter)
    StsCalibration(temperatures=(1.5, 1.0, 0.8)).save(folder)
    drafter = resolve_drafter(str(folder), target_model, tiny_target_dir)
    assert isinstance(drafter, CalibratedDrafter) and isinstance(drafter.inner, DraftLMDrafter)
    # The budget policies run on it unchanged and stay lossless at T=0.
    requests = [Request(prompt_ids=[3, 4, 5, 6], max_new_tokens=8, stop_ids=())] * 2
    ar = SpecEngine(target_model).generate(requests)
    spec = SpecEngine(target_model, drafter, EngineConfig(max_batch_size=2, num_draft_tokens=3),
                      depth_policy=DCut()).generate(requests)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]
    (folder / CALIBRATION_FILE).write_text("{broken")
    with pytest.raises(CalibrationError, match="not a usable calibration"):
        resolve_drafter(str(folder), target_model, tiny_target_dir)


# ----- the command line --------------------------------------------------------------------------------
def test_calibrate_cli_writes_calibration_and_eval_uses_it(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                           tiny_target_dir: Path, draft_dir: Path,
                                                           prompts_file: Path, one_thread) -> None:
    import shutil

    folder = tmp_path / "drafter"
    shutil.copytree(draft_dir, folder)
    args = ["calibrate", "--target", tiny_target_dir, "--drafter", folder, "--prompts", prompts_file,
            "--max-new-tokens", 24, "--num-draft-tokens", 3, "--limit", 4, "--quiet"]
    code, out, err = run(capsys, *args)
    assert code == 0, err
    assert "ECE before" in out and "ECE after" in out and f"wrote {folder / CALIBRATION_FILE}" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    survival = [float(r[-1]) for r in rows]
    assert 0 < survival[0] < 1 and survival == sorted(survival, reverse=True)  # both outcomes were seen
    saved = json.loads((folder / CALIBRATION_FILE).read_text())
    assert saved["method"] == "sts" and len(saved["temperatures"]) == 3
    assert all(a <= b + 1e-12 for a, b in zip(saved["ece_after"], saved["ece_before"], strict=True))

    code, _, err = run(capsys, *args)  # refuses to overwrite
    assert code == 2 and "already exists; pass --force" in err and len(err.strip().splitlines()) == 1
    code, out, err = run(capsys, *args, "--force")
    assert code == 0, err

    report = tmp_path / "eval.json"
    code, out, err = run(capsys, "eval", "--target", tiny_target_dir, "--drafter", folder, "--prompts", prompts_file,
                         "--max-new-tokens", 8, "--num-draft-tokens", 3, "--limit", 2, "--quiet", "--json", report)
    assert code == 0, err
    assert "calibrated confidences (STS from" in out and "lossless: yes" in out
    assert json.loads(report.read_text())["calibration"]["temperatures"] == saved["temperatures"]


def test_calibrate_cli_bad_input(capsys: pytest.CaptureFixture[str], tiny_target_dir: Path,
                                 prompts_file: Path) -> None:
    code, _, err = run(capsys, "calibrate", "--target", tiny_target_dir, "--drafter", "ngram", "--prompts",
                       prompts_file)
    assert code == 2 and "needs a drafter folder" in err and len(err.strip().splitlines()) == 1

"""`make drafters` (`angelspec.pipelines.shipped`): the export a shipped drafter goes through (bf16 weights that
still load and decode losslessly, the train report with its data and tokens, the evaluation log), the stage
checks that make the pipeline resumable, and the presets it trains with."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from conftest import write_conversations
from safetensors.torch import load_file

from angelspec.errors import UsageError
from angelspec.pipelines.shipped import (
    SHIPPED,
    build_shipped_drafters,
    export_shipped,
    rollout_state,
    run_finished,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_export_is_bf16_and_still_lossless(tmp_path, tiny_target_dir) -> None:
    from angelspec.decoding.engine import EngineConfig, Request, SpecEngine
    from angelspec.decoding.loading import load_target_and_tokenizer, resolve_drafter
    from angelspec.train.block import tiny_debug, train_dfly

    data = write_conversations(tmp_path / "conv.jsonl", 40, seed=3)
    run = tmp_path / "run"
    train_dfly(tiny_target_dir, data, run, config=replace(tiny_debug(), steps=2), progress=False, log=lambda *_: None)
    assert run_finished(run, 2) and not run_finished(run, 3)
    (run / "training" / "eval_log.jsonl").write_text(json.dumps({"step": 2, "mal": 1.0}) + "\n")
    dest = export_shipped(run, tmp_path / "assets" / "dfly", data=data)
    weights = load_file(str(dest / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in weights.values() if v.is_floating_point())
    report = json.loads((dest / "train_report.json").read_text())
    assert report["shipped"]["weights_dtype"] == "bfloat16" and report["shipped"]["train_tokens"] == 2 * 2 * 64
    assert report["shipped"]["data"] == str(data)
    assert (dest / "eval_log.jsonl").is_file() and (dest / "config.json").is_file()
    assert not list(dest.parent.glob(".*tmp*"))  # the temporary folder was swapped in

    target, _ = load_target_and_tokenizer(tiny_target_dir)
    drafter = resolve_drafter(str(dest), target, tiny_target_dir)  # bf16 on disk, the target's dtype in memory
    reqs = [Request([5, 6, 7, 8], 20, stop_ids=()), Request([9, 10], 20, stop_ids=())]
    ar = SpecEngine(target, None, EngineConfig(max_batch_size=2)).generate(reqs)
    spec = SpecEngine(target, drafter, EngineConfig(max_batch_size=2, num_draft_tokens=4)).generate(reqs)
    assert [r.token_ids for r in spec] == [r.token_ids for r in ar]


def test_a_second_stage_trains_on_from_the_first_and_exports_as_one_curve(tmp_path, tiny_target_dir) -> None:
    """A drafter shipped in two stages: the second starts from the first's weights (`init_from`), and the export's
    report and evaluation log count the tokens of both, the log as one curve across the stages."""
    from angelspec.train.block import tiny_debug, train_dfly

    data = write_conversations(tmp_path / "conv.jsonl", 40, seed=3)
    first, second = tmp_path / "dfly", tmp_path / "dfly_af"
    train_dfly(tiny_target_dir, data, first, config=replace(tiny_debug(), steps=2), progress=False,
               log=lambda *_: None)
    train_dfly(tiny_target_dir, data, second, config=replace(tiny_debug(), steps=3, anchor_fusion=True,
                                                             init_from=str(first)), progress=False, log=lambda *_: None)
    for run, steps in ((first, 2), (second, 3)):
        (run / "training" / "eval_log.jsonl").write_text(
            json.dumps({"step": steps, "tokens": steps * 128, "mal": 1.0 + steps, "temperature": 0.0}) + "\n")
    dest = export_shipped(second, tmp_path / "assets" / "dfly", data=data, earlier=[first])
    report = json.loads((dest / "train_report.json").read_text())
    assert report["shipped"]["train_tokens"] == (2 + 3) * 2 * 64
    assert [s["steps"] for s in report["shipped"]["stages"]] == [2, 3]
    assert report["shipped"]["stages"][1]["init_from"] == str(first)
    log = [json.loads(line) for line in (dest / "eval_log.jsonl").read_text().splitlines()]
    assert [(r["stage"], r["step"], r["tokens"], r["stage_tokens"]) for r in log] == [(0, 2, 256, 256),
                                                                                       (1, 3, 256 + 384, 384)]
    assert json.loads((dest / "config.json").read_text())["block_drafter_config"]["anchor_fusion"] is True
    assert SHIPPED["dfly"].stages(tmp_path)[1] == ("dfly_shipped_af", second)


def test_an_unfinished_run_is_not_exported_twice_over(tmp_path) -> None:
    assert not run_finished(tmp_path / "nope", 10)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "train_report.json").write_text(json.dumps({"steps": 3}))
    assert not run_finished(tmp_path / "run", 10)  # stopped early by --max-minutes: the next call resumes it
    with pytest.raises(UsageError, match="no trained drafter"):
        export_shipped(tmp_path / "empty", tmp_path / "out")


def test_rollout_state_reads_the_sidecar(tmp_path) -> None:
    out = tmp_path / "rollouts.jsonl"
    assert rollout_state(out) is None
    out.with_name("rollouts.jsonl.progress.json").write_text(json.dumps({"lines_done": 7, "complete": False}))
    assert rollout_state(out) == {"lines_done": 7, "complete": False}


def test_unknown_names_are_refused_before_any_work(tmp_path) -> None:
    with pytest.raises(UsageError, match="unknown shipped drafter"):
        build_shipped_drafters(["dfly", "medusa"], work_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_every_shipped_preset_exists_and_is_sized_as_promised() -> None:
    tokens = {}
    for d in SHIPPED.values():
        cfg = d.config()
        tokens[d.name] = cfg.steps * cfg.batch_size * cfg.seq_len
        assert cfg.draft_vocab_size == 1024  # CPU-cheap drafting from the 1024 most frequent answer tokens
    assert tokens["dfly"] >= 9_500_000 and tokens["mtp"] >= 9_500_000  # the flagships: ~10M tokens
    # Issue 13: the flagships on at least 10M tokens, "EAGLE-3 and DSpark on at least a third of that". (This
    # compared with a third of DFly's preset, 13.9M since its warm restart, which is more than the issue asks.)
    assert tokens["eagle3"] >= 10_000_000 / 3 and tokens["dspark"] >= 10_000_000 / 3

"""`make drafters`: rebuild the drafters that ship with the embedded target, from scratch and resumable.

Stages, each skipped when its output is complete and resumed when it was interrupted:
1. the prompt pool: 20,000 prompts drawn from the offline corpus the target was built from, decontaminated
   against the held-out prompts (`data.prompt_pool`, `angelspec prompt-pool`; needs `make data-sources`);
2. greedy target rollouts of the pool (`train.rollout`, `angelspec rollout`);
3. each drafter trained on the rollouts with its `*_shipped` preset (`train.runs.train_drafter`, `angelspec train
   --eval-every`), an evaluation server beside it logging MAL and speed-up per checkpoint
   (`eval.server`), time-boxed with `max_minutes` per call (run it again to continue); a drafter with a second
   stage (DFly, DSpark: `*_shipped_af`, the fused anchor input) then trains on from the first stage's weights
   in `<name>_af/` (`init_from`);
4. the export: config.json, bf16 safetensors, the tokenizer, `train_report.json` (data, tokens, minutes) and
   the evaluation log into `assets/drafters/<name>/`, and the learning curves (MAL against training tokens)
   as `assets/drafters/learning_curves.png`.

Everything lives under `work_dir` (default `.cache/shipped/`); the export folder is what the package ships.
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from angelspec.assets import DEFAULT_DRAFTERS, resolve_target_dir
from angelspec.errors import UsageError
from angelspec.fileio import read_json_object, write_json_atomic

DEFAULT_WORK = Path(".cache/shipped")
POOL_FILE = "prompts.jsonl"
ROLLOUT_FILE = "rollouts.jsonl"
ROLLOUT_BATCH = 32  # fastest of 16 / 32 / 64 / 128 for the embedded target on one core (same output at any size)
ROLLOUT_NEW_TOKENS = 256
# Copied beside the weights so the folder loads on its own (`--drafter DIR`).
FOLDER_FILES = ("config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json",
                "tokenizer_config.json", "calibration.json")


@dataclass(frozen=True)
class ShippedDrafter:
    """One shipped drafter: its kind (`angelspec train --drafter`), training preset and, optionally, the preset of
    a second stage that trains on from the first stage's drafter (`init_from`)."""

    name: str
    kind: str
    preset: str
    then: str | None = None

    def stages(self, work_dir: Path) -> list[tuple[str, Path]]:
        """(preset, run folder) of each stage, in order; the last one is what ships."""
        out = [(self.preset, work_dir / self.name)]
        if self.then is not None:
            out.append((self.then, work_dir / f"{self.name}_af"))
        return out

    def config(self) -> Any:
        """The preset's training config."""
        from angelspec.train.registry import get_trainer

        return get_trainer(self.kind)[1][self.preset]()


SHIPPED = {d.name: d for d in (ShippedDrafter("dfly", "dfly", "dfly_shipped", then="dfly_shipped_af"),
                               ShippedDrafter("mtp", "mtp", "mtp_shipped"),
                               ShippedDrafter("eagle3", "eagle3", "eagle3_shipped"),
                               ShippedDrafter("dspark", "dspark", "dspark_shipped", then="dspark_shipped_af"))}


def ensure_pool(work_dir: Path, *, log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """The prompt pool, built once."""
    from angelspec.data.prompt_pool import build_prompt_pool

    pool = work_dir / POOL_FILE
    if pool.is_file() and pool.with_name(pool.name + ".summary.json").is_file():
        return pool
    log(f"prompt pool -> {pool}")
    work_dir.mkdir(parents=True, exist_ok=True)
    build_prompt_pool(pool, target_dir=resolve_target_dir(None), progress=progress, force=True)  # ours, unfinished
    return pool


def rollout_state(out: Path) -> dict[str, Any] | None:
    """The rollout's progress sidecar (lines done, complete), or None before it started."""
    return read_json_object(out.with_name(out.name + ".progress.json"))


def ensure_rollouts(work_dir: Path, pool: Path, *, log: Callable[[str], None] = print,
                    progress: bool = True) -> Path:
    """Greedy rollouts of the pool by the target, resumed where a kill left them."""
    from angelspec.train.rollout import RolloutSettings, rollout

    out = work_dir / ROLLOUT_FILE
    state = rollout_state(out)
    if state is not None and state.get("complete"):
        return out
    log(f"rollouts of {pool} -> {out}" + (f" (resuming at line {state['lines_done']})" if state else ""))
    settings = RolloutSettings(max_new_tokens=ROLLOUT_NEW_TOKENS, batch_size=ROLLOUT_BATCH)
    summary = rollout(None, pool, out, settings, resume=state is not None, progress=progress)
    log(summary.format())
    return out


def train_config(run: Path) -> dict[str, Any]:
    """The run's training config, from its last checkpoint's trainer state ({} before the first)."""
    from angelspec.eval.server import latest_checkpoint

    found = latest_checkpoint(run)
    return found[1].get("train_config", {}) if found else {}


def run_finished(run: Path, planned_steps: int) -> bool:
    """True when the run wrote its model and report for its planned number of steps."""
    return (read_json_object(run / "train_report.json") or {}).get("steps") == planned_steps


def train_shipped(d: ShippedDrafter, data: Path, work_dir: Path, *, max_minutes: float | None,
                  eval_every: int | None = None, progress: bool = True,
                  log: Callable[[str], None] = print) -> Path:
    """Train (or continue) one shipped drafter, stage by stage; an evaluation server process watches each run.
    Returns the last stage's run folder (unfinished when `max_minutes` ran out: run it again to continue)."""
    from angelspec.eval.server import spawn_eval_server
    from angelspec.train.registry import get_trainer
    from angelspec.train.runs import TrainSettings, train_drafter

    presets = get_trainer(d.kind)[1]
    start: Path | None = None
    for preset, run in d.stages(work_dir):
        steps = presets[preset]().steps
        if not run_finished(run, steps):
            resume = (run / "training").is_dir()
            overrides = () if eval_every is None else (f"ckpt_every={eval_every}",)
            server = spawn_eval_server(run, limit=3, max_new_tokens=64)
            log(f"{d.name}: {'resuming' if resume else 'training'} {d.kind} ({preset}) in {run}"
                f"{'' if start is None else f' from {start}'}; eval-server pid {server.pid} -> "
                f"{run}/training/eval_log.jsonl")
            settings = TrainSettings(preset=preset, overrides=overrides, resume=resume, progress=progress,
                                     max_minutes=max_minutes, init_from=None if start is None else str(start))
            result = train_drafter(d.kind, data, run, settings, log=log)
            log(result.format())
            if not run_finished(run, steps):
                return run  # time is up: the next stage waits for this one
        start = run
    return run


def _bf16_weights(src: Path, dest: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from angelspec.models.hf_io import save_safetensors_atomic

    state = load_file(str(src))
    save_safetensors_atomic({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
                            dest, {"format": "pt"})


def run_tokens(run: Path) -> int:
    """Training tokens a finished (or stopped) run saw: its steps x batch size x sequence length."""
    cfg = train_config(run)
    return (read_json_object(run / "train_report.json") or {}).get("steps", 0) * cfg.get("batch_size", 0) * cfg.get(
        "seq_len", 0)


def stages_eval_log(runs: Sequence[Path]) -> list[dict[str, Any]]:
    """The evaluation logs of a drafter's stages as one curve: each record tagged with its `stage` (0, 1, ...), its
    `tokens` counted from the first stage's start (`stage_tokens`: within its own stage)."""
    from angelspec.eval.server import read_eval_log

    out, before = [], 0
    for i, run in enumerate(runs):
        for rec in read_eval_log(run):
            tokens = rec.get("tokens")
            out.append({**rec, "stage": i, "stage_tokens": tokens,
                        "tokens": None if tokens is None else tokens + before})
        before += run_tokens(run)
    return out


def _stage_summary(run: Path) -> dict[str, Any]:
    """One stage of a staged drafter for its train report: run folder, steps, tokens, seconds and start folder."""
    report = read_json_object(run / "train_report.json") or {}
    meta = (read_json_object(run / "config.json") or {}).get("angelspec", {})
    return {"run": str(run), "steps": report.get("steps"), "train_tokens": run_tokens(run),
            "train_seconds": report.get("train_seconds"), "init_from": meta.get("train_config", {}).get("init_from")}


def export_shipped(run: Path, dest: Path, *, data: Path | None = None, earlier: Sequence[Path] = ()) -> Path:
    """Copy a trained drafter into the package: config + bf16 weights + tokenizer + train report (with the data
    and tokens it saw) + the evaluation log. `earlier`: the run folders of the stages before `run`, whose tokens,
    seconds and evaluation records the report and log include (`stages_eval_log`). Written to a temporary folder
    and swapped in."""
    if not (run / "config.json").is_file() or not (run / "model.safetensors").is_file():
        raise UsageError(f"{run} holds no trained drafter yet (no config.json + model.safetensors); train it first")
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in FOLDER_FILES:
        if (run / name).is_file():
            shutil.copy2(run / name, tmp / name)
    _bf16_weights(run / "model.safetensors", tmp / "model.safetensors")
    report = read_json_object(run / "train_report.json") or {}
    stages = [*earlier, run]
    report["shipped"] = {"weights_dtype": "bfloat16", "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                         "train_tokens": sum(run_tokens(r) for r in stages),
                         "data": str(data) if data else report.get("data"), "train_config": train_config(run)}
    if earlier:
        report["shipped"]["stages"] = [_stage_summary(r) for r in stages]
    write_json_atomic(tmp / "train_report.json", report)
    records = stages_eval_log(stages)
    if records:
        (tmp / "eval_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)
    return dest


def build_shipped_drafters(names: Sequence[str] = tuple(SHIPPED), *, work_dir: str | Path = DEFAULT_WORK,
                           out_root: str | Path = DEFAULT_DRAFTERS, max_minutes: float | None = None,
                           eval_every: int | None = None, export: bool = True, train: bool = True,
                           progress: bool = True, log: Callable[[str], None] = print) -> dict[str, Path]:
    """Run the stages of the module docstring for `names`; returns the exported folders (or the run folders when
    `export` is False). `max_minutes` bounds each drafter's training in this call (None: to the end); `train`
    False exports the runs as they are (a partly trained drafter, with its train report saying how far it got)."""
    from angelspec.errors import require_positive
    from angelspec.train.safety import check_minutes

    unknown = [n for n in names if n not in SHIPPED]
    if unknown:
        raise UsageError(f"unknown shipped drafter(s) {unknown}; choose from {', '.join(SHIPPED)}")
    check_minutes(max_minutes)  # before the pool and the rollouts, which take a while
    if eval_every is not None:
        require_positive("eval_every", eval_every)
    work_dir, out_root = Path(work_dir), Path(out_root)
    if train:
        pool = ensure_pool(work_dir, log=log, progress=progress)
        data = ensure_rollouts(work_dir, pool, log=log, progress=progress)
    else:
        data = work_dir / ROLLOUT_FILE
    done: dict[str, Path] = {}
    for name in names:
        d = SHIPPED[name]
        runs = [run for _, run in d.stages(work_dir)]
        if train:
            train_shipped(d, data, work_dir, max_minutes=max_minutes, eval_every=eval_every, progress=progress,
                          log=log)
        # the last stage that has a drafter ships (an unfinished second stage: the first stage's drafter)
        last = max((i for i, r in enumerate(runs) if (r / "model.safetensors").is_file()), default=len(runs) - 1)
        done[name] = (export_shipped(runs[last], out_root / name, data=data, earlier=runs[:last]) if export
                      else runs[last])
    if export:
        from angelspec.eval.server import plot_learning_curves

        curves = {n: stages_eval_log([r for _, r in d.stages(work_dir)]) for n, d in SHIPPED.items()}
        curves = {n: recs for n, recs in curves.items() if recs}
        if curves:
            plot_learning_curves(curves, out_root / "learning_curves.png")
    return done

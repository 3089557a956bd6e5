"""`make drafters`: rebuild the drafters that ship with the embedded target, from scratch and resumable.

Stages, each skipped when its output is complete and resumed when it was interrupted:
1. the prompt pool: 20,000 prompts drawn from the offline corpus the target was built from, decontaminated
   against the held-out prompts (`data.prompt_pool`, `angelspec prompt-pool`; needs `make data-sources`);
2. greedy target rollouts of the pool (`train.rollout`, `angelspec rollout`);
3. each drafter trained on the rollouts with its `*_shipped` preset (`train.runs.train_drafter`, `angelspec train
   --eval-every`), an evaluation server beside it logging MAL and speed-up per checkpoint
   (`eval.server`), time-boxed with `max_minutes` per call (run it again to continue);
4. the export: config.json, bf16 safetensors, the tokenizer, `train_report.json` (data, tokens, minutes) and
   the evaluation log into `assets/drafters/<name>/`, and the learning curves (MAL against training tokens)
   as `assets/drafters/learning_curves.png`.

Everything lives under `work_dir` (default `.cache/shipped/`); the export folder is what the package ships.
"""

from __future__ import annotations

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
    """One shipped drafter: its kind (`angelspec train --drafter`) and training preset."""

    name: str
    kind: str
    preset: str

    def config(self) -> Any:
        """The preset's training config."""
        from angelspec.train.registry import get_trainer

        return get_trainer(self.kind)[1][self.preset]()


SHIPPED = {d.name: d for d in (ShippedDrafter("dfly", "dfly", "dfly_shipped"),
                               ShippedDrafter("mtp", "mtp", "mtp_shipped"),
                               ShippedDrafter("eagle3", "eagle3", "eagle3_shipped"),
                               ShippedDrafter("dspark", "dspark", "dspark_shipped"))}


def ensure_pool(work_dir: Path, *, log: Callable[[str], None] = print, progress: bool = True) -> Path:
    """The prompt pool, built once."""
    from angelspec.data.prompt_pool import build_prompt_pool

    pool = work_dir / POOL_FILE
    if pool.is_file() and pool.with_name(pool.name + ".summary.json").is_file():
        return pool
    log(f"prompt pool -> {pool}")
    work_dir.mkdir(parents=True, exist_ok=True)
    build_prompt_pool(pool, target_dir=resolve_target_dir(None), progress=progress)
    return pool


def rollout_state(out: Path) -> dict[str, Any] | None:
    """The rollout's progress sidecar (lines done, complete), or None before it started."""
    return read_json_object(out.with_name(out.name + ".progress.json"))


def ensure_rollouts(work_dir: Path, pool: Path, *, log: Callable[[str], None] = print,
                    progress: bool = True) -> Path:
    """Greedy rollouts of the pool by the target, resumed where a kill left them."""
    from angelspec.train.rollout import rollout

    out = work_dir / ROLLOUT_FILE
    state = rollout_state(out)
    if state is not None and state.get("complete"):
        return out
    log(f"rollouts of {pool} -> {out}" + (f" (resuming at line {state['lines_done']})" if state else ""))
    summary = rollout(None, pool, out, max_new_tokens=ROLLOUT_NEW_TOKENS, batch_size=ROLLOUT_BATCH,
                      resume=state is not None, progress=progress)
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
    """Train (or continue) one shipped drafter; an evaluation server process watches the run."""
    from angelspec.eval.server import spawn_eval_server
    from angelspec.train.runs import train_drafter

    run = work_dir / d.name
    if run_finished(run, d.config().steps):
        return run
    resume = (run / "training").is_dir()
    overrides = [] if eval_every is None else [f"ckpt_every={eval_every}"]
    server = spawn_eval_server(run, limit=3, max_new_tokens=64)
    log(f"{d.name}: {'resuming' if resume else 'training'} {d.kind} ({d.preset}) in {run}; eval-server pid "
        f"{server.pid} -> {run}/training/eval_log.jsonl")
    result = train_drafter(d.kind, data, run, preset=d.preset, overrides=overrides, resume=resume,
                           progress=progress, max_minutes=max_minutes, log=log)
    log(result.format())
    return run


def _bf16_weights(src: Path, dest: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from angelspec.models.hf_io import save_safetensors_atomic

    state = load_file(str(src))
    save_safetensors_atomic({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in state.items()},
                            dest, {"format": "pt"})


def export_shipped(run: Path, dest: Path, *, data: Path | None = None) -> Path:
    """Copy a trained drafter into the package: config + bf16 weights + tokenizer + train report (with the data
    and tokens it saw) + the evaluation log. Written to a temporary folder and swapped in."""
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
    cfg = train_config(run)
    report["shipped"] = {"weights_dtype": "bfloat16", "exported_at": time.strftime("%Y-%m-%d %H:%M:%S"),
                         "train_tokens": report.get("steps", 0) * cfg.get("batch_size", 0) * cfg.get("seq_len", 0),
                         "data": str(data) if data else report.get("data"), "train_config": cfg}
    write_json_atomic(tmp / "train_report.json", report)
    log = run / "training" / "eval_log.jsonl"
    if log.is_file():
        shutil.copy2(log, tmp / "eval_log.jsonl")
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
    unknown = [n for n in names if n not in SHIPPED]
    if unknown:
        raise UsageError(f"unknown shipped drafter(s) {unknown}; choose from {', '.join(SHIPPED)}")
    work_dir, out_root = Path(work_dir), Path(out_root)
    if train:
        pool = ensure_pool(work_dir, log=log, progress=progress)
        data = ensure_rollouts(work_dir, pool, log=log, progress=progress)
    else:
        data = work_dir / ROLLOUT_FILE
    done: dict[str, Path] = {}
    for name in names:
        run = work_dir / name
        if train:
            run = train_shipped(SHIPPED[name], data, work_dir, max_minutes=max_minutes, eval_every=eval_every,
                                progress=progress, log=log)
        done[name] = export_shipped(run, out_root / name, data=data) if export else run
    if export:
        from angelspec.eval.server import plot_learning_curves

        runs = {n: work_dir / n for n in SHIPPED if (work_dir / n / "training" / "eval_log.jsonl").is_file()}
        if runs:
            plot_learning_curves(runs, out_root / "learning_curves.png")
    return done

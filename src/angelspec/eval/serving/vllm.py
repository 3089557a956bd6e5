"""vLLM as a column of the serving sweep (`angelspec bench --vllm [DIR]`): the engine a CPU user would pick instead
of ours, measured on the same requests in the same run.

Every configuration vLLM can run the same way gets a vLLM cell per concurrency: AR (drafter none) and n-gram prompt
lookup at full depth without the speculation gate, the latter as vLLM's `{"method": "ngram"}` with our K as
`num_speculative_tokens` and our n-gram sizes as `prompt_lookup_max` / `prompt_lookup_min`. At each concurrency C,
vLLM serves exactly the N requests of our point (greedy, `max_new_tokens` each, stop tokens ignored) with
`max_num_seqs` = C, fp32 and its default compilation, after one untimed warm-up generate, and is timed as ours: the
wall time of generating all N. The row gets vLLM's tokens/s, ours / vLLM (> 1: ours is faster), vLLM's mean accepted
length (its counters: accepted drafts + 1 per verify step that had drafts, so steps where the n-gram found nothing
are not counted, unlike our MAL) and how many of vLLM's outputs equal this configuration's (all of them for AR at
T=0: same target, same fp32 greedy argmax). Configurations that share a vLLM setup (AR eager and AR compiled) share
its measurement. A depth policy, the gate or a model drafter gets "-": vLLM has nothing to match them with.

vLLM pins its own torch build, so it runs in its own venv (`make vllm-venv` builds .venv-vllm), one subprocess per
point (`vllm_point.py`), under `vllm_engine.CPU_ENV` (the engine in-process, one compute thread unless the caller
set OMP_NUM_THREADS, a 1 GiB KV cache), with this process's AngelSpec first on its path so both sides run the same
code. Its log goes to `vllm.log` in the results folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from angelspec.decoding.vllm_engine import CPU_ENV, VLLM_REQUIREMENT, SpecCounters, VllmUnavailableError
from angelspec.eval.serving.base import ServingRow

DEFAULT_VENV = Path(".venv-vllm")
VENV_HINT = (f"build it with `make vllm-venv` ({VLLM_REQUIREMENT} with AngelSpec in .venv-vllm; it pins its own "
             "torch, so never into this venv) or pass --vllm DIR")
CHILD = "angelspec.eval.serving.vllm_point"

VllmRunner = Callable[[dict[str, Any]], dict[str, Any]]  # one job (vllm_point.py) -> its result


class VllmRunError(RuntimeError):
    """A vLLM subprocess failed; the message holds its last line and where its log is."""


@dataclass(frozen=True)
class VllmSetup:
    """What vLLM runs for a configuration: plain decoding, or n-gram speculation with K drafts and n-gram sizes
    min_ngram..max_ngram."""

    method: str  # "ar" or "ngram"
    num_draft_tokens: int = 0
    max_ngram: int = 0
    min_ngram: int = 0

    @property
    def label(self) -> str:
        if self.method == "ar":
            return "AR"
        return f"ngram K={self.num_draft_tokens} n={self.min_ngram}..{self.max_ngram}"

    def speculative_config(self) -> dict[str, Any] | None:
        """vLLM's `speculative_config` (None for AR)."""
        if self.method == "ar":
            return None
        return {"method": "ngram", "num_speculative_tokens": self.num_draft_tokens,
                "prompt_lookup_max": self.max_ngram, "prompt_lookup_min": self.min_ngram}


@dataclass(frozen=True)
class VllmPoint:
    """One setup at one concurrency, measured by vLLM."""

    setup: VllmSetup
    concurrency: int
    requests: int
    output_tokens: int
    wall_s: float
    engine_s: float  # engine start-up, compilation included (not timed in tokens/s)
    mal: float | None  # accepted drafts + 1 per verify step with drafts; None without speculation
    outputs: list[list[int]]

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @classmethod
    def from_result(cls, setup: VllmSetup, result: Mapping[str, Any]) -> VllmPoint:
        counters = SpecCounters(int(result.get("drafts", 0)), 0, tuple(result.get("accepted_per_pos", ())))
        return cls(setup=setup, concurrency=int(result["concurrency"]), requests=int(result["requests"]),
                   output_tokens=int(result["output_tokens"]), wall_s=float(result["wall_s"]),
                   engine_s=float(result.get("engine_s", 0.0)),
                   mal=counters.mean_accepted_length if counters.drafts else None,
                   outputs=[list(map(int, o)) for o in result["outputs"]])


@dataclass
class VllmColumn:
    """The vLLM side of a sweep: the target folder vLLM loads, the runner that serves one job, and what the results'
    settings record about it (version, interpreter)."""

    target_dir: Path
    runner: VllmRunner
    info: dict[str, Any] = field(default_factory=dict)

    def measure(self, setups: Sequence[VllmSetup], points: Sequence[tuple[int, list[list[int]]]], *,
                max_new_tokens: int, warmup_tokens: int,
                log: Callable[[str], None] | None = print
                ) -> tuple[dict[tuple[VllmSetup, int], VllmPoint], str | None]:
        """Every setup at every (concurrency, that point's prompts) -> ({(setup, C): point}, None), or the points
        measured before a run failed and its one-line error (the sweep keeps our rows and says so)."""
        measured: dict[tuple[VllmSetup, int], VllmPoint] = {}
        for setup in setups:
            for concurrency, prompts in points:
                job = {"target": str(self.target_dir), "speculative_config": setup.speculative_config(),
                       "concurrency": concurrency, "prompts": prompts, "max_new_tokens": max_new_tokens,
                       "warmup_tokens": warmup_tokens}
                try:
                    point = VllmPoint.from_result(setup, self.runner(job))
                    if point.requests != len(prompts):
                        raise VllmRunError(f"vLLM answered {point.requests} requests for {setup.label} "
                                           f"C={concurrency}, expected {len(prompts)}")
                except VllmRunError as e:
                    return measured, str(e)
                measured[setup, concurrency] = point
                if log is not None:
                    mal = "" if point.mal is None else f", MAL {point.mal:.2f} (steps with drafts)"
                    log(f"vLLM {setup.label} C={concurrency}: {point.tokens_per_s:.1f} tok/s{mal} (engine start "
                        f"{point.engine_s:.0f} s, generate {point.wall_s:.1f} s)")
        return measured, None


def add_vllm(rows: Sequence[ServingRow], outputs: Sequence[list[list[int]]], setups: Mapping[str, VllmSetup | None],
             points: Mapping[tuple[VllmSetup, int], VllmPoint]) -> list[ServingRow]:
    """Each row whose configuration has a vLLM setup measured at its concurrency gets vLLM's tokens/s and MAL, and
    the count of vLLM outputs equal to the row's own (`outputs[i]` are row i's, in request order)."""
    merged = []
    for row, ours in zip(rows, outputs, strict=True):
        setup = setups.get(row.config)
        point = None if setup is None else points.get((setup, row.concurrency))
        if point is None:
            merged.append(row)
            continue
        same = sum(a == b for a, b in zip(ours, point.outputs, strict=True))
        merged.append(replace(row, vllm_tokens_per_s=point.tokens_per_s, vllm_mal=point.mal, vllm_identical=same))
    return merged


# --------------------------------------------------------------------------------------------------
# The vLLM venv, one subprocess per job
# --------------------------------------------------------------------------------------------------
def find_vllm_python(venv: str | Path) -> Path:
    """The interpreter of the vLLM venv `venv` (a venv folder, or its python), or one line naming `make vllm-venv`."""
    path = Path(venv)
    python = path if path.is_file() else path / "bin" / "python"
    if not python.is_file():
        raise VllmUnavailableError(f"--vllm: no vLLM venv at {path} ({python} does not exist); {VENV_HINT}")
    return python


@dataclass
class SubprocessRunner:
    """Runs `vllm_point.py` in the vLLM venv's `python`, its output appended to `log_path`."""

    python: Path
    log_path: Path

    def check(self) -> dict[str, Any]:
        """Whether that interpreter imports vLLM: {"version", "python"}, or VllmRunError with vLLM's one-line reason."""
        with tempfile.TemporaryDirectory(prefix="angelspec-vllm-") as tmp:
            self._run(["--check", str(Path(tmp) / "check.json")], Path(tmp), "importing vLLM")
            return json.loads((Path(tmp) / "check.json").read_text(encoding="utf-8"))

    def __call__(self, job: dict[str, Any]) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="angelspec-vllm-") as tmp:
            job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
            job_path.write_text(json.dumps(job), encoding="utf-8")
            method = (job.get("speculative_config") or {}).get("method", "AR")
            self._run([str(job_path), str(result_path)], Path(tmp), f"{method} at C={job['concurrency']}")
            return json.loads(result_path.read_text(encoding="utf-8"))

    def _run(self, args: list[str], tmp: Path, what: str) -> None:
        """Run the child with `args` (its output goes to the log), or VllmRunError."""
        import angelspec

        shim = tmp / "path"  # only our package goes first on the child's path, never this venv's site-packages
        shim.mkdir()
        (shim / "angelspec").symlink_to(Path(angelspec.__file__).resolve().parent, target_is_directory=True)
        env = {**CPU_ENV, **os.environ, "PYTHONPATH": str(shim)}
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"\n==== vLLM {what}: {self.python} -m {CHILD} {' '.join(args)}\n")
            log.flush()
            start = log.tell()
            proc = subprocess.run([str(self.python), "-m", CHILD, *args], env=env, stdin=subprocess.DEVNULL,
                                  stdout=log, stderr=subprocess.STDOUT, check=False)
        if proc.returncode != 0:
            lines = [ln.strip() for ln in self.log_path.read_text(encoding="utf-8", errors="replace")[start:]
                     .splitlines() if ln.strip()]
            last = next((ln for ln in reversed(lines) if ln.startswith("error:")), lines[-1] if lines else "no output")
            raise VllmRunError(f"vLLM ({what}) failed with exit code {proc.returncode}: "
                               f"{last.removeprefix('error:').strip()} (log: {self.log_path})")


def open_vllm_column(venv: str | Path, target_dir: Path, log_path: Path,
                     log: Callable[[str], None] | None = print) -> VllmColumn:
    """The vLLM column for `angelspec bench --vllm DIR`: finds the venv's interpreter, checks that it imports vLLM
    (a few seconds, before anything is timed) and returns the column."""
    runner = SubprocessRunner(find_vllm_python(venv), Path(log_path))
    info = runner.check()
    if log is not None:
        log(f"vLLM column: vLLM {info.get('version')} in {runner.python} (log: {log_path})")
    return VllmColumn(target_dir=Path(target_dir), runner=runner,
                      info={**info, "compiled": True, "dtype": "float32", "log": str(log_path)})

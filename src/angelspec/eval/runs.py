"""The measuring commands as library calls taking typed settings: `evaluate_drafters` (`angelspec eval`:
AR vs drafters on the same prompts, with the T=0 lossless check), `profile_cost_table` (`angelspec profile`: the
step-latency table C(B, N) of report §4.2), `calibrate` (`angelspec calibrate`: STS temperatures, report §4.1)
and `run_bench` (`angelspec bench`: the closed-loop serving sweep, its shape one `BenchSettings`).

Each checks every setting it can before the target's weights are loaded, then loads the target (on `placement`'s
device and dtype; None: `angelspec.models.device.resolve_placement()`) and the drafter, measures and writes. A bad
field of `BenchSettings` raises a `SettingError` that names the field (the command line shows its flag); the other
messages name the command-line flags, since that is where the values usually come from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import EVAL_PROMPTS, resolve_target_dir
from angelspec.data.prompts import load_prompts
from angelspec.decoding.drafter_spec import DrafterSpec, parse_drafter_spec
from angelspec.decoding.generate import build_depth_policy, parse_depth_policy, sampling_params
from angelspec.decoding.limits import MAX_BATCH_SIZE, MAX_REPEATS, MAX_REQUESTS, check_counts, check_fits_target
from angelspec.decoding.loading import (
    draft_depth,
    drafter_forms,
    encode_prompts,
    load_target_and_tokenizer,
    resolve_drafter,
)
from angelspec.decoding.settings import DecodeSettings
from angelspec.errors import SettingError, UsageError, require_range
from angelspec.eval.prompts import eval_prompts
from angelspec.fileio import check_output_path, check_writable_path, refuse_same_file, write_json_atomic

if TYPE_CHECKING:
    from angelspec.decoding.policies.costmodel import CostTable
    from angelspec.eval.serving import BenchSettings, ServingConfig, ServingReport
    from angelspec.eval.speculative import EvalReport
    from angelspec.models import DecoderConfig
    from angelspec.models.device import Placement

MAX_MISMATCHES_BANNER = 5  # mismatches the failed-lossless banner lists


@dataclass
class EvalRun:
    """`evaluate_drafters`' result: one report per drafter (all against one AR run) and what they were measured on."""

    reports: list[EvalReport]
    target_dir: Path
    prompts_path: Path
    calibrations: list[str | None]  # each drafter's STS calibration, described; None where it has none
    json_out: Path | None  # where the numbers were written as JSON
    comparison: str | None = None  # AR and every drafter side by side, when there are several

    @property
    def lossless(self) -> bool | None:
        """False when some drafter's T=0 outputs differ from AR's; None at T>0."""
        checked = [r.lossless for r in self.reports if r.lossless is not None]
        return all(checked) if checked else None

    def format(self) -> str:
        lines = [f"target {self.target_dir}", f"prompts {self.prompts_path}"]
        for report, calibration in zip(self.reports, self.calibrations, strict=True):
            if len(self.reports) > 1:
                lines.append("")
            if calibration is not None:
                lines.append(calibration)
            lines.append(report.format())
        if self.comparison is not None:
            lines += ["", "every drafter against the same AR run:", self.comparison]
        if self.json_out is not None:
            lines.append(f"wrote {self.json_out}")
        return "\n".join(lines)

    def lossless_banner(self) -> str:
        """The loud stderr message of a failed T=0 lossless check (one block per drafter that failed it)."""
        bar = "!" * 100
        blocks = []
        for report in self.reports:
            if report.lossless is not False:
                continue
            reason = report.lossless_line().removeprefix("lossless: NO: ")
            name = f" ({report.drafter})" if len(self.reports) > 1 else ""
            blocks.append(f"angelspec: LOSSLESS CHECK FAILED{name}: {reason}\n"
                          + "\n".join(m.describe() for m in report.failures[:MAX_MISMATCHES_BANNER]))
        return f"{bar}\n" + f"\n{bar}\n".join(blocks) + f"\n{bar}"


def _check_fits(model: Any, *, rows: int, num_draft_tokens: int | None, batch_flag: str = "--batch-size") -> None:
    """`check_fits_target` for a loaded target: its KV cache in its own dtype, checked where it lives (GPU or host)."""
    w = model.embed_tokens.weight
    check_fits_target(model.config, rows=rows, num_draft_tokens=num_draft_tokens, batch_flag=batch_flag,
                      dtype_bytes=w.element_size(), device=w.device)


def _target_config(target_dir: Path) -> DecoderConfig:
    """The target's config.json alone (no weights), for the bounds checked before they are loaded."""
    from angelspec.models import read_config

    return read_config(target_dir)


def evaluate_drafters(drafters: str | DrafterSpec | Sequence[str | DrafterSpec], settings: DecodeSettings | None = None,
                      *, target: str | Path | None = None, prompts: str | Path | None = None,
                      limit: int | None = None, json_out: str | Path | None = None, force: bool = False,
                      progress: bool = True, log: Callable[[str], None] | None = None,
                      placement: Placement | None = None) -> EvalRun:
    """Decode the same prompts autoregressively, once, and with each of `drafters` (`--drafter` specs other than
    none) under the same `settings` (`DecodeSettings`, None: its defaults; its policy applies to every drafter, K
    None is each drafter's trained depth; `angelspec.eval.speculative.evaluate_many`); write the numbers to
    `json_out` when given (one drafter: its report; several: a list under "runs").

    prompts: a prompts file whose lines may carry a "domain" key (None: the shipped held-out prompts);
    limit: at most that many prompts per domain; log: the cost-table profiler's progress.
    """
    from angelspec.decoding.drafters.calibrated import CalibratedDrafter
    from angelspec.eval.cost_profile import load_or_profile
    from angelspec.eval.speculative import EvalSettings, evaluate_many, format_comparison

    parsed = [parse_drafter_spec(d) for d in ([drafters] if isinstance(drafters, str | DrafterSpec) else drafters)]
    specs = [p.text for p in parsed]
    if not specs:
        raise UsageError(f"no drafter to evaluate; pass --drafter: {drafter_forms(include_none=False)}")
    if any(p.is_none for p in parsed):
        raise UsageError(f"--drafter none leaves nothing to compare with autoregressive decoding; "
                         f"choose a drafter: {drafter_forms(include_none=False)}")
    settings = settings or DecodeSettings()
    settings.check_counts(limit)
    batch_size, cost_table, compile = settings.batch_size, settings.cost_table, settings.compile
    if cost_table is not None and len(specs) > 1:
        raise UsageError(f"--cost-table holds one drafter's step costs, and {len(specs)} drafters were given; "
                         "evaluate them one at a time with --cost-table, or leave it out (each drafter then uses "
                         "its own cached table)")
    policy_specs = [parse_depth_policy(settings.policy, spec) for spec in specs]
    json_path = Path(json_out) if json_out is not None else None
    prompts_path = Path(prompts) if prompts is not None else EVAL_PROMPTS
    if json_path is not None:
        refuse_same_file(json_path, ("--prompts", prompts_path), ("--cost-table", cost_table), flag="--json")
        check_output_path(json_path, force, "--json", "eval.json")
    records = load_prompts(prompts_path)
    sampling = sampling_params(1, temperature=settings.temperature, top_k=settings.top_k, top_p=settings.top_p,
                               seed=settings.seed)[0]
    target_dir = resolve_target_dir(target)
    model, tokenizer = load_target_and_tokenizer(target_dir, placement)
    _check_fits(model, rows=batch_size, num_draft_tokens=settings.num_draft_tokens)
    chosen = eval_prompts(tokenizer, records, context=model.config.max_position_embeddings,
                          source=str(prompts_path), limit=limit, think=settings.think)
    runs, depths = [], []
    for spec, drafter_spec, policy_spec in zip(specs, parsed, policy_specs, strict=True):
        draft = resolve_drafter(drafter_spec, model, target_dir)
        assert draft is not None
        k = draft_depth(draft, settings.num_draft_tokens)  # default: the depth each drafter was trained for
        depth_policy = build_depth_policy(policy_spec, target=model, drafter=draft, num_draft_tokens=k,
                                          batch_size=batch_size, cost_table=cost_table, compile=compile,
                                          cost_source=load_or_profile, log=log)
        runs.append((spec, draft, depth_policy, settings.policy))
        depths.append(k)
    eval_settings = EvalSettings(max_new_tokens=settings.max_new_tokens, batch_size=batch_size,
                                 num_draft_tokens=depths[0], sampling=sampling, compile=compile,
                                 spec_gate=settings.spec_gate)  # evaluate gives request i the seed S + i
    baseline, reports = evaluate_many(model, runs, chosen, eval_settings, progress=progress, depths=depths)
    calibrations: list[str | None] = []  # described, for the printout
    numbers = []  # per drafter, for --json
    for (_, draft, _, _), report in zip(runs, reports, strict=True):
        calibrated = isinstance(draft, CalibratedDrafter)
        described = None
        if calibrated:
            note = draft.temperature_note(settings.temperature)
            described = draft.describe(settings.temperature) + ("" if note is None else f"\n{note}")
        calibrations.append(described)
        numbers.append({"calibration": draft.calibration.to_json() if calibrated else None, **report.to_dict()})
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(json_path, {"target": str(target_dir), "prompts_file": str(prompts_path),
                                      **(numbers[0] if len(numbers) == 1 else {"runs": numbers})})
    return EvalRun(reports=reports, target_dir=target_dir, prompts_path=prompts_path, calibrations=calibrations,
                   json_out=json_path,
                   comparison=format_comparison(baseline, reports) if len(reports) > 1 else None)


def profile_cost_table(drafter: str, *, target: str | Path | None = None, batch_sizes: Sequence[int] = (1, 2, 4, 8),
                       num_draft_tokens: int | None = None, repeats: int = 5, warmup: int = 2,
                       out: str | Path | None = None, force: bool = False, compile: bool = False,
                       log: Callable[[str], None] | None = None,
                       placement: Placement | None = None) -> tuple[CostTable, str]:
    """Measure (or reuse, when a cached table for this setup is up to date) the cost table C(B, N) of the target
    and `drafter`; returns (table, what happened). out: the table file (None: the per-setup cache file); compile:
    the table of a compiled engine (what `--compile` runs of eval and bench use)."""
    from angelspec.decoding.policies.costmodel import CostSettings
    from angelspec.eval.cost_profile import load_or_profile

    sizes = sorted(set(batch_sizes))
    check_counts(num_draft_tokens=num_draft_tokens)
    for b in sizes:
        require_range("--batch-sizes", b, 1, MAX_BATCH_SIZE)
    require_range("--repeats", repeats, 1, MAX_REPEATS)
    require_range("--warmup", warmup, 0, MAX_REPEATS)
    spec = parse_drafter_spec(drafter)
    if spec.is_none:
        raise UsageError("--drafter none has no speculative step to profile; choose a drafter: "
                         f"{drafter_forms(include_none=False)}")
    path = Path(out) if out is not None else None
    if path is not None and path.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name such as {path / 'costs.json'}")
    if path is not None:
        check_writable_path(path, "--out")  # a read-only folder fails now, not after the profiling
        if path.exists() and not force:  # a table of another setup is re-profiled; any other file is never replaced
            from angelspec.decoding.policies.costmodel import CostTable, CostTableError, StaleCostTableError

            try:
                CostTable.load(path)
            except StaleCostTableError:
                pass
            except CostTableError as e:
                raise UsageError(f"--out {path} exists and is not a cost table ({e}); give --out a new file, or pass "
                                 "--force to overwrite it") from None
    target_dir = resolve_target_dir(target)
    model, _ = load_target_and_tokenizer(target_dir, placement)
    if sizes:
        _check_fits(model, rows=sizes[-1], num_draft_tokens=num_draft_tokens, batch_flag="--batch-sizes")
    draft = resolve_drafter(spec, model, target_dir)
    assert draft is not None
    cost = CostSettings(batch_sizes=sizes, num_draft_tokens=draft_depth(draft, num_draft_tokens), repeats=repeats,
                        warmup=warmup, compile=compile)
    return load_or_profile(model, draft, cost, path, force=force, log=log)


def calibrate(drafter: str, prompts: str | Path, *, target: str | Path | None = None, max_new_tokens: int = 64,
              limit: int | None = None, num_draft_tokens: int | None = None, batch_size: int = 8,
              temperature: float = 0.0, force: bool = False, progress: bool = True,
              placement: Placement | None = None) -> str:
    """Fit STS temperatures for the confidences of the saved drafter `drafter` (DIR or KIND:DIR) on the held-out
    `prompts` (at most `limit`) decoded at sampling `temperature`, and store them as its fit at that temperature in
    calibration.json next to its checkpoint; returns the report."""
    from angelspec.eval.sts_fit import calibrate_drafter, check_writable
    from angelspec.eval.sts_fit import drafter_folder as calibration_folder

    check_counts(max_new_tokens=max_new_tokens, batch_size=batch_size, num_draft_tokens=num_draft_tokens, limit=limit)
    if not (math.isfinite(temperature) and temperature >= 0):
        raise UsageError(f"--temperature must be a number >= 0 (0 = greedy), got {temperature}")
    folder = calibration_folder(drafter)
    check_writable(folder, force, temperature)  # before anything is loaded or decoded
    records = load_prompts(prompts)[:limit]
    target_dir = resolve_target_dir(target)
    model, tokenizer = load_target_and_tokenizer(target_dir, placement)
    _check_fits(model, rows=min(batch_size, len(records)), num_draft_tokens=num_draft_tokens)
    prompt_ids = encode_prompts(tokenizer, records, context=model.config.max_position_embeddings, think=False,
                                source=str(prompts))
    draft = resolve_drafter(drafter, model, target_dir)
    assert draft is not None
    return calibrate_drafter(model, draft, prompt_ids, folder, name=drafter, max_new_tokens=max_new_tokens,
                             num_draft_tokens=draft_depth(draft, num_draft_tokens), batch_size=batch_size,
                             temperature=temperature, force=force, progress=progress)


DEFAULT_VLLM_VENV = ".venv-vllm"  # `make vllm-venv`: bench runs the vLLM column from it when it exists


def run_bench(configs: Sequence[ServingConfig | str], out: str | Path, settings: BenchSettings | None = None, *,
              target: str | Path | None = None, vllm: str | Path | None = None,
              log: Callable[[str], None] | None = None, placement: Placement | None = None,
              force: bool = False) -> ServingReport:
    """The closed-loop serving sweep (`angelspec.eval.serving.bench`) of `configs` (`ServingConfig`s or
    NAME=SPEC[@POLICY] texts) in the shape `settings` give (`BenchSettings`; None: the defaults), writing
    results.json, results.md and the plots into the folder `out`. `vllm`: the vLLM venv for the vLLM column
    (`eval.serving.vllm`; its log goes to `out`/vllm.log). Drafter folders and the vLLM venv are checked before the
    target is loaded; a folder that already holds a sweep is refused unless `force`."""
    from angelspec.decoding.policies.factory import PolicyError
    from angelspec.eval.serving import BenchSettings, ServingError, bench, check_configs, parse_config

    s = BenchSettings() if settings is None else settings
    try:
        parsed = [parse_config(c) if isinstance(c, str) else c for c in configs]
        check_configs(parsed)
    except (ServingError, PolicyError) as e:
        raise UsageError(str(e)) from None
    levels, num_draft_tokens, warmup_tokens = tuple(s.concurrency), s.num_draft_tokens, s.warmup_tokens
    check_counts(max_new_tokens=s.max_new_tokens, num_draft_tokens=num_draft_tokens, limit=s.limit)
    if not levels:
        raise SettingError("{concurrency} needs at least one level, e.g. 1,2,4")
    for c in levels:
        require_range("concurrency", c, 1, MAX_BATCH_SIZE)
    require_range("min_requests", s.min_requests, 1, MAX_REQUESTS)
    require_range("warmup_tokens", warmup_tokens, 0, 1 << 24)
    require_range("repeats", s.repeats, 1, 100)
    out_dir = Path(out)
    if out_dir.exists() and not out_dir.is_dir():
        raise UsageError(f"--out {out_dir} is a file; give a folder for results.json, results.md and the plots")
    if (out_dir / "results.json").exists() and not force:
        raise UsageError(f"--out {out_dir} already holds a sweep (results.json); pass --force to overwrite it or "
                         "give another --out")
    for c in parsed:  # a missing drafter folder fails before the target is loaded
        folder = parse_drafter_spec(c.drafter).folder
        if folder is not None and not folder.exists():
            raise UsageError(f"--config {c.name}={c.drafter}: drafter folder {folder} does not exist; train it with "
                             f"`angelspec train --drafter KIND --data DATA --out {folder}` or fix the path")
    target_dir = resolve_target_dir(target)
    config = _target_config(target_dir)
    from angelspec.models.device import placement_of

    where = placement_of(placement)  # the KV cache's device and dtype, before the weights are loaded
    check_fits_target(config, rows=max(levels, default=1), num_draft_tokens=num_draft_tokens,
                      batch_flag="--concurrency", dtype_bytes=where.dtype.itemsize, device=where.device,
                      with_weights=True)
    if warmup_tokens > config.max_position_embeddings:
        require_range("warmup_tokens", warmup_tokens, 0, config.max_position_embeddings, " (the target's context)")
    column = None
    if vllm is not None:
        from angelspec.eval.serving.vllm import find_vllm_python, open_vllm_column

        find_vllm_python(vllm)  # a missing venv fails at once, before the import check
        column = open_vllm_column(vllm, target_dir, out_dir / "vllm.log", log=log)
    model, tokenizer = load_target_and_tokenizer(target_dir, placement)
    return bench(model, tokenizer, target_dir, parsed, replace(s, concurrency=levels), out_dir=out_dir, vllm=column,
                 log=log)

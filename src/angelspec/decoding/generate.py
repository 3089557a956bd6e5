"""Completing a prompts file with the target (optionally a drafter under a depth policy): the work behind
`angelspec generate`, as one call taking a parsed `DrafterSpec` and a typed `DecodeSettings`.

Also the settings checks every decoding command shares: one `SamplingParams` per request (`sampling_params`),
a `--policy` spec checked before any weights load (`parse_depth_policy`) and built once the target and
drafter are loaded (`build_depth_policy`); and `preview_lines`, a completion shown in a terminal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec.assets import resolve_target_dir
from angelspec.data.prompts import load_prompts
from angelspec.decoding.drafter_spec import DrafterSpec, parse_drafter_spec
from angelspec.decoding.limits import check_fits_target
from angelspec.decoding.loading import (
    draft_depth,
    encode_prompts,
    load_target_and_tokenizer,
    resolve_drafter,
    run_engine,
)
from angelspec.decoding.settings import DecodeSettings
from angelspec.errors import UsageError
from angelspec.fileio import check_output_path, refuse_same_file, write_jsonl_atomic

if TYPE_CHECKING:
    from angelspec.decoding.drafters.base import Drafter
    from angelspec.decoding.metrics import DecodeMetrics
    from angelspec.decoding.policies.costmodel import CostSource
    from angelspec.decoding.policies.factory import PolicySpec
    from angelspec.decoding.sampling import SamplingParams
    from angelspec.models import Decoder
    from angelspec.models.device import Placement


def sampling_params(n: int, *, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
                    seed: int | None = None) -> list[SamplingParams]:
    """One `SamplingParams` per request; with seed S, request i gets seed S + i so identical prompts
    still draw independent samples while the whole run stays reproducible."""
    from angelspec.decoding.sampling import SamplingParams

    try:
        base = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    except ValueError as e:
        raise UsageError(f"invalid sampling settings: {e}") from None
    if base.seed is None:
        return [base] * n
    return [SamplingParams(base.temperature, base.top_k, base.top_p, base.seed + i) for i in range(n)]


def parse_depth_policy(policy: str, drafter: str = "none") -> PolicySpec:
    """Check `--policy` before any weights are loaded (a typo costs nothing); `drafter` is the --drafter spec."""
    from angelspec.decoding.policies.factory import PolicyError, parse_policy

    try:
        spec = parse_policy(policy)
    except PolicyError as e:
        raise UsageError(f"--policy: {e}") from None
    if spec.uses_drafts and drafter == "none":
        raise UsageError(f"--policy {policy} chooses how many drafts to verify, but --drafter is none; "
                         "pick a drafter or drop --policy")
    return spec


def build_depth_policy(spec: PolicySpec, *, target: Decoder, drafter: Drafter | None, num_draft_tokens: int,
                       batch_size: int, cost_table: str | Path | None = None, compile: bool = False,
                       cost_source: CostSource | None = None, log: Callable[[str], None] | None = None) -> Any:
    """The depth policy for the engine; a cost table covers batch sizes up to `batch_size`, measured compiled
    when the engine is (`compile`), and comes from `cost_source` (None: read from disk, never profiled;
    `policies.factory.make_policy`)."""
    from angelspec.decoding.policies.factory import PolicyError, cost_batch_sizes, make_policy

    try:
        return make_policy(spec, target=target, drafter=drafter, num_draft_tokens=num_draft_tokens,
                           cost_table_path=cost_table, batch_sizes=cost_batch_sizes(batch_size), compile=compile,
                           cost_source=cost_source, log=log)
    except PolicyError as e:
        raise UsageError(f"--policy: {e}") from None


@dataclass
class GenerateSummary:
    """What `generate_completions` wrote, and how fast."""

    out: Path
    completions: int
    metrics: DecodeMetrics
    batch_size: int
    drafter: str  # the --drafter spec
    policy: str  # the --policy spec

    def format(self) -> str:
        m = self.metrics
        policy = "" if self.policy == "full" else f", policy {self.policy}"
        mal = "" if self.drafter == "none" else f", MAL {m.mean_accepted_length:.2f} with K={m.num_draft_tokens}"
        return (f"wrote {self.completions} completions to {self.out}: {m.output_tokens} tokens in {m.wall_s:.2f} s "
                f"({m.tokens_per_s:.1f} tokens/s, batch size {min(self.batch_size, self.completions)}, "
                f"drafter {self.drafter}{policy}{mal})")


def generate_completions(prompts: str | Path, out: str | Path, drafter: str | DrafterSpec = "none",
                         settings: DecodeSettings | None = None, *, target: str | Path | None = None,
                         force: bool = False, progress: bool = True, log: Callable[[str], None] | None = None,
                         warn: Callable[[str], None] | None = None, placement: Placement | None = None,
                         cost_source: CostSource | None = None) -> GenerateSummary:
    """Complete every line of the JSONL prompts file `prompts` ({"prompt": str} or {"messages": [...]},
    rendered with the target's chat template) and write one JSON line per prompt to `out`: the input record
    plus completion, token_ids and finish_reason.

    drafter: a `--drafter` spec (`decoding.drafter_spec`); settings: how to decode (`DecodeSettings`; None: its
    defaults, K the depth the drafter was trained for); target: HF checkpoint folder (None: the embedded target);
    log: the cost-table profiler's progress; warn: a note when some prompts leave less than `max_new_tokens` of the
    context, or when the drafter's confidence calibration has no fit near the temperature; placement: the target's
    device and dtype (None: a GPU in bfloat16 where torch sees one, else the CPU in float32;
    `angelspec.models.device.resolve_placement`); cost_source: where a budget policy's cost table comes from
    (None: read from disk, never profiled; the command passes `eval.cost_profile.load_or_profile`). Everything
    that can be checked without the weights is checked before they are loaded.
    """
    settings = settings or DecodeSettings()
    settings.check_counts()
    spec = parse_drafter_spec(drafter)
    drafter = spec.text
    batch_size, max_new_tokens, cost_table = settings.batch_size, settings.max_new_tokens, settings.cost_table
    if settings.spec_gate and spec.is_none:
        raise UsageError("--spec-gate decides when to draft, but --drafter is none; pick a drafter or drop "
                         "--spec-gate")
    out = Path(out)
    refuse_same_file(out, ("--prompts", prompts), ("--cost-table", cost_table))
    check_output_path(out, force)
    policy_spec = parse_depth_policy(settings.policy, drafter)
    records = load_prompts(prompts)
    sampling = sampling_params(len(records), temperature=settings.temperature, top_k=settings.top_k,
                               top_p=settings.top_p, seed=settings.seed)
    target_dir = resolve_target_dir(target)
    model, tokenizer = load_target_and_tokenizer(target_dir, placement)
    check_fits_target(model.config, rows=min(batch_size, len(records)),
                      num_draft_tokens=0 if spec.is_none else settings.num_draft_tokens,
                      dtype_bytes=model.embed_tokens.weight.element_size(), device=model.embed_tokens.weight.device)
    context = model.config.max_position_embeddings
    prompt_ids = encode_prompts(tokenizer, records, context=context, think=settings.think, source=str(prompts))
    draft = resolve_drafter(spec, model, target_dir)
    num_draft_tokens = draft_depth(draft, settings.num_draft_tokens)
    depth_policy = build_depth_policy(policy_spec, target=model, drafter=draft, num_draft_tokens=num_draft_tokens,
                                      batch_size=batch_size, cost_table=cost_table, compile=settings.compile,
                                      cost_source=cost_source, log=log)
    from angelspec.decoding.drafters.calibrated import CalibratedDrafter

    note = draft.temperature_note(settings.temperature) if isinstance(draft, CalibratedDrafter) else None
    if note is not None and warn is not None:  # calibrated only far from `temperature`
        warn(note)
    capped = sum(len(ids) + max_new_tokens > context for ids in prompt_ids)
    if capped and warn is not None:
        warn(f"note: {capped} prompt(s) leave fewer than {max_new_tokens} tokens of the {context}-token "
             'context; they stop at the context limit (finish_reason "length")')

    results, metrics = run_engine(model, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                  batch_size=batch_size, drafter=draft, num_draft_tokens=num_draft_tokens,
                                  progress=progress, depth_policy=depth_policy, spec_gate=settings.spec_gate,
                                  compile=settings.compile)
    lines = []
    for p, res in zip(records, results, strict=True):
        ids = [int(t) for t in res.token_ids]
        lines.append({**p["record"], "completion": tokenizer.decode(ids, skip_special_tokens=True),
                      "token_ids": ids, "finish_reason": res.finish_reason})
    write_jsonl_atomic(out, lines)
    return GenerateSummary(out=out, completions=len(lines), metrics=metrics, batch_size=batch_size,
                           drafter=drafter, policy=settings.policy)


def preview_lines(text: str, max_lines: int, indent: str = "    ") -> list[str]:
    """A completion as indented lines for a terminal. Degenerate outputs are common from small or
    untrained models, so whitespace-only text is summarised instead of printed as a wall of blank lines."""
    rows = text.strip().splitlines()
    if not rows:
        return [f"{indent}(empty)" if not text else f"{indent}(whitespace only: {len(text)} chars, {text[:12]!r}...)"]
    out = [f"{indent}{row}" for row in rows[:max_lines]]
    if len(rows) > max_lines:
        out.append(f"{indent}... ({len(rows) - max_lines} more lines)")
    return out

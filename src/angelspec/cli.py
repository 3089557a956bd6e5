"""The `angelspec` command line.

Each subcommand is one small function; heavy modules (torch, the engine, the trainers) are imported
inside them so `angelspec --help` answers instantly. Errors that AngelSpec raises on purpose for bad
input (its own exception classes such as `CheckpointError`, `PromptFileError`, `UsageError`, plus
`FileExistsError` / `FileNotFoundError`) become one line on stderr and exit code 2; anything else is
a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec import __version__
from angelspec.assets import DEFAULT_TARGET

if TYPE_CHECKING:
    from angelspec.models import Decoder

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
DRAFTER_SPECS = "none | ngram | draft-lm:DIR | DIR"
MAX_SAMPLE_LINES = 12  # per sample printed; the full text is in build_info.json / the output file


class UsageError(ValueError):
    """Bad command-line input that argparse cannot see: values, combinations, missing artefacts."""


# --------------------------------------------------------------------------------------------------
# Shared helpers (also used by `angelspec.demo`)
# --------------------------------------------------------------------------------------------------
def resolve_target_dir(target: str | Path | None) -> Path:
    """The folder to load: `--target` if given, else the embedded target, which must be built first."""
    if target is not None:
        return Path(target)
    if not (DEFAULT_TARGET / "config.json").is_file():
        raise UsageError(
            f"the embedded target is not built yet ({DEFAULT_TARGET} has no config.json). Build it with "
            "`make data-sources && angelspec target build` (about 2 hours on 2 CPU cores; resumable with "
            "--resume), or pass --target DIR with a HF checkpoint folder"
        )
    return DEFAULT_TARGET


def load_target_and_tokenizer(target_dir: Path) -> tuple[Decoder, Any]:
    """Load the target's weights and its tokenizer from one HF-layout folder.

    The config and the tokenizer are read first so an unknown architecture or a missing file fails
    before the weights are read; the tokenizer must sit beside the weights because prompts are rendered
    with its chat template.
    """
    import torch

    from angelspec.data.tokenizer import TokenizerError, load_tokenizer
    from angelspec.models import load_target, read_config

    config = read_config(target_dir)
    try:
        tokenizer = load_tokenizer(target_dir)
    except TokenizerError as e:
        raise UsageError(f"cannot load the target's tokenizer: {e} (the target folder needs a Hugging Face fast "
                         "tokenizer beside the weights: tokenizer.json and tokenizer_config.json, with the chat "
                         "template in tokenizer_config.json or chat_template.jinja)") from None
    model = load_target(target_dir, dtype=torch.float32)
    if tokenizer.vocab_size > config.vocab_size:
        raise UsageError(f"{target_dir}: the tokenizer has {tokenizer.vocab_size} tokens but the model's vocabulary "
                         f"is {config.vocab_size}; the tokenizer files belong to another model")
    return model, tokenizer


def encode_prompts(tokenizer: Any, prompts: list[dict[str, Any]], *, context: int, think: bool,
                   source: str) -> list[list[int]]:
    """Render each prompt's messages with the chat template; refuse prompts that leave no room to generate."""
    encoded = [tokenizer.apply_chat_template(p["messages"], add_generation_prompt=True, enable_thinking=think)
               for p in prompts]
    too_long = [(p["line"], len(ids)) for p, ids in zip(prompts, encoded, strict=True) if len(ids) >= context]
    if too_long:
        line, n = too_long[0]
        more = f" ({len(too_long) - 1} more lines are too long)" if len(too_long) > 1 else ""
        raise UsageError(f"{source}:{line}: the prompt is {n} tokens after the chat template, but the target's "
                         f"context is {context} tokens, so no token can be generated{more}")
    return encoded


def run_engine(model: Decoder, prompt_ids: list[list[int]], *, max_new_tokens: int, sampling: list[Any],
               batch_size: int, drafter: Any = None, progress: bool = True) -> tuple[list[Any], Any]:
    """Generate for every prompt through the engine; returns the results (in prompt order) and the run's
    `DecodeMetrics` (tokens/s, steps, and acceptance once a drafter is used).

    Each request's budget is capped so prompt + completion fits the context; such rows end with
    finish_reason "length" like any other that ran out of tokens.
    """
    from angelspec.spec.engine import EngineConfig, Request, SpecEngine

    context = model.config.max_position_embeddings
    engine = SpecEngine(model, drafter=drafter, config=EngineConfig(max_batch_size=batch_size))
    requests = [Request(prompt_ids=ids, max_new_tokens=min(max_new_tokens, context - len(ids)), sampling=s,
                        request_id=i)
                for i, (ids, s) in enumerate(zip(prompt_ids, sampling, strict=True))]
    results = engine.generate(requests, progress=progress)
    return results, engine.metrics


def resolve_drafter(spec: str | None, target: Decoder, target_dir: Path) -> Any:
    """Turn `--drafter SPEC` into a drafter object for the engine (None = plain autoregressive decoding).

    Accepted specs: `none`, `ngram` (prompt lookup), `draft-lm:DIR` (an independent small LM with the
    target's tokenizer), or a drafter checkpoint DIR. Only `none` works until the speculative engine lands.
    """
    if spec is None or spec == "none":
        return None
    if spec == "ngram" or spec.startswith("draft-lm:") or Path(spec).is_dir():
        raise UsageError(f"drafter {spec!r} is not available yet: speculative decoding is still being built; "
                         "use --drafter none (plain autoregressive decoding)")
    raise UsageError(f"unknown drafter {spec!r}: expected {DRAFTER_SPECS} (no such directory: {spec})")


def write_jsonl_atomic(path: Path, records: list[dict[str, Any]]) -> None:
    """Write via a temp file + rename, so an interrupted run never leaves a half-written output."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for rec in records:
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _check_output_path(path: Path, force: bool) -> None:
    if path.is_dir():
        raise UsageError(f"--out {path} is a directory; give a file name such as {path / 'out.jsonl'}")
    if path.exists() and not force:
        raise FileExistsError(f"--out {path} already exists; pass --force to overwrite it")


def _sampling_params(args: argparse.Namespace, n: int) -> list[Any]:
    """One `SamplingParams` per request; with --seed S, request i gets seed S + i so identical prompts
    still draw independent samples while the whole run stays reproducible."""
    from angelspec.spec.sampling import SamplingParams

    try:
        base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(f"invalid sampling settings: {e}") from None
    if base.seed is None:
        return [base] * n
    return [SamplingParams(base.temperature, base.top_k, base.top_p, base.seed + i) for i in range(n)]


def _positive(name: str, value: int) -> None:
    if value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")


# --------------------------------------------------------------------------------------------------
# Subcommands
# --------------------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    """`angelspec generate`: complete every prompt of a JSONL file with the target (optionally a drafter)."""
    from angelspec.data.prompts import load_prompts

    _positive("--max-new-tokens", args.max_new_tokens)
    _positive("--batch-size", args.batch_size)
    out = Path(args.out)
    _check_output_path(out, args.force)
    prompts = load_prompts(args.prompts)
    sampling = _sampling_params(args, len(prompts))
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    context = model.config.max_position_embeddings
    prompt_ids = encode_prompts(tokenizer, prompts, context=context, think=args.think, source=args.prompts)
    drafter = resolve_drafter(args.drafter, model, target_dir)
    capped = sum(len(ids) + args.max_new_tokens > context for ids in prompt_ids)
    if capped:
        print(f"note: {capped} prompt(s) leave fewer than {args.max_new_tokens} tokens of the {context}-token "
              'context; they stop at the context limit (finish_reason "length")', file=sys.stderr)

    results, metrics = run_engine(model, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  batch_size=args.batch_size, drafter=drafter, progress=not args.quiet)
    records = []
    for p, res in zip(prompts, results, strict=True):
        ids = [int(t) for t in res.token_ids]
        records.append({**p["record"], "completion": tokenizer.decode(ids, skip_special_tokens=True),
                        "token_ids": ids, "finish_reason": res.finish_reason})
    write_jsonl_atomic(out, records)
    print(f"wrote {len(records)} completions to {out}: {metrics.output_tokens} tokens in {metrics.wall_s:.2f} s "
          f"({metrics.tokens_per_s:.1f} tokens/s, batch size {min(args.batch_size, len(records))}, "
          f"drafter {args.drafter})")
    return 0


def cmd_target_build(args: argparse.Namespace) -> int:
    """`angelspec target build`: build the corpus and tokenizer, train the target, export a HF folder."""
    from angelspec.train.target import PRESETS, build_target, with_overrides

    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; choose one of {', '.join(sorted(PRESETS))}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise UsageError(f"--max-minutes must be positive, got {args.max_minutes}")
    overrides: dict[str, str] = {}
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"setting {item!r} is not of the form key=value (e.g. steps=100)")
        overrides[key] = value
    try:
        config = with_overrides(PRESETS[args.preset](), overrides)
    except ValueError as e:
        raise UsageError(str(e)) from None
    out = Path(args.out) if args.out is not None else DEFAULT_TARGET
    report = build_target(out, work_dir=Path(args.work_dir), config=config, resume=args.resume, force=args.force,
                          progress=not args.quiet, max_minutes=args.max_minutes, log=print)
    print(format_build_report(report, out))
    return 0


def format_build_report(report: dict[str, Any], out: Path) -> str:
    """Human-readable summary of `build_target`'s report: size, held-out loss per domain, greedy samples."""
    lines = [f"target written to {out}: {report.get('parameters', 0) / 1e6:.2f}M parameters, "
             f"{report.get('steps', '?')} steps, {report.get('build_seconds', 0) / 60:.1f} min"]
    losses, ppl = report.get("heldout_loss", {}), report.get("heldout_ppl", {})
    if losses:
        lines.append("held-out loss per domain (nats/token, perplexity):")
        lines += [f"  {d:<6} {loss:.3f}  ({ppl.get(d, float('nan')):.1f})" for d, loss in losses.items()]
    for domain, sample in report.get("samples", {}).items():
        lines.append(f"[{domain}] {sample['prompt']}")
        lines += preview_lines(sample["greedy"], MAX_SAMPLE_LINES)
    return "\n".join(lines)


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


# --------------------------------------------------------------------------------------------------
# Parser and entry point
# --------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="angelspec",
        description="Train speculative-decoding drafters for a frozen target LLM and run them losslessly.",
    )
    parser.add_argument("--version", action="version", version=f"angelspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_generate(sub)
    _add_target(sub)
    return parser


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate", help="complete a JSONL file of prompts with the target",
        description='Complete every line of a JSONL prompts file ({"prompt": str} or {"messages": [...]}, '
                    "rendered with the target's chat template) and write one JSON line per prompt with "
                    "completion, token_ids and finish_reason.",
    )
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="input prompts, one JSON object per line")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output file (refused if it exists)")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--drafter", default="none", metavar="SPEC", help=f"{DRAFTER_SPECS} (default: none)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = disabled (default: 0)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="request i uses seed S+i (default: random)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per prompt (default: 256)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="concurrent requests (default: 8)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                   help="render the chat template in thinking mode (default: --no-think)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)


def _add_target(sub: argparse._SubParsersAction) -> None:
    target = sub.add_parser("target", help="build the embedded default target model",
                            description="Work on the target model that ships with AngelSpec.")
    tsub = target.add_subparsers(dest="target_command", metavar="ACTION", required=True)
    p = tsub.add_parser(
        "build", help="assemble the offline corpus, train tokenizer and target, export a HF folder",
        description="Assemble the offline corpus (code, chat, maths, docs), train a byte-level BPE tokenizer "
                    "with a chat template and a Qwen3-architecture target, and export a HF-layout folder. "
                    "Resumable; needs the data extra (`make data-sources`).",
    )
    p.add_argument("--out", metavar="DIR", help=f"output folder (default: the embedded target, {DEFAULT_TARGET})")
    p.add_argument("--work-dir", default=".cache/target-build", metavar="DIR",
                   help="corpus, tokenizer and checkpoints (default: .cache/target-build)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --work-dir")
    p.add_argument("--force", action="store_true", help="start over, overwriting --out and --work-dir")
    p.add_argument("--preset", default="embedded_target", metavar="NAME",
                   help="training preset: embedded_target (default) or tiny_debug")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop training after M minutes at a checkpoint and export (continue later with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override preset fields, e.g. steps=100")
    p.set_defaults(func=cmd_target_build)


def is_user_error(exc: BaseException) -> bool:
    """Bad input rather than a bug: our own exception classes, and missing / already-existing files."""
    if isinstance(exc, FileExistsError | FileNotFoundError):
        return True
    return isinstance(exc, Exception) and type(exc).__module__.split(".")[0] == "angelspec"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse has already printed usage or help
        return e.code if isinstance(e.code, int) else EXIT_BAD_INPUT
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("angelspec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as e:
        if not is_user_error(e):
            raise
        print(f"angelspec: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())

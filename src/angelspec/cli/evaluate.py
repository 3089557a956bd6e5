"""The measuring commands `eval`, `profile`, `calibrate` and `bench`: their parsers, and handlers that each call
one function of `angelspec.eval.runs` and print what it returns."""

from __future__ import annotations

import argparse
from pathlib import Path

from angelspec.cli.common import (
    DRAFTER_SPECS,
    EXIT_NOT_LOSSLESS,
    Subparsers,
    add_batch_size_flag,
    add_device_flags,
    add_num_draft_tokens_flag,
    add_policy_flags,
    add_sampling_flags,
    add_target_flag,
    add_think_flag,
    decode_settings,
    placement,
    warn,
)
from angelspec.errors import UsageError


def add_eval(sub: Subparsers) -> None:
    """Decode the same prompts autoregressively and with the drafter, in one process and with the same settings (after
    an untimed warm-up), and print MAL, acceptance p_1..p_K, the acceptance-length histogram, the time split,
    tokens/s and the speed-up over AR, per domain when prompt lines carry a "domain" key. With --drafter repeated,
    every drafter runs against the same AR run, and a table puts them side by side. At T=0 the outputs must be
    identical to AR's; if they are not, the command says so loudly and exits 1."""
    p = sub.add_parser("eval", help="measure a drafter against autoregressive decoding on the same prompts",
                       description=add_eval.__doc__)
    p.add_argument("--drafter", required=True, action="append", metavar="SPEC",
                   help=DRAFTER_SPECS + "; repeat it to evaluate several drafters against one AR run")
    add_target_flag(p)
    add_device_flags(p)
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help='prompts, one {"prompt"} or {"messages"} object per line, optional "domain" '
                        "(default: the shipped held-out prompts for code, math and chat)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="at most N prompts per domain")
    add_sampling_flags(p, seed=0, temperature_help="0 = greedy, with the token-for-token check against AR (default: 0)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="per prompt (default: 128)")
    add_num_draft_tokens_flag(p)
    add_batch_size_flag(p)
    add_think_flag(p)
    add_policy_flags(p)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target's forwards and the drafter's hot calls for both runs (the "
                        "untimed warm-up pays the compilation: about a minute on a 2-core CPU)")
    p.add_argument("--json", metavar="OUT", help="also write the numbers as JSON (refused if it exists)")
    p.add_argument("--force", action="store_true", help="overwrite --json if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args: argparse.Namespace) -> int:
    """`angelspec eval`: AR and each drafter on the same prompts; acceptance, speed-up and the T=0 lossless check."""
    from angelspec.decoding.drafter_spec import parse_drafter_spec
    from angelspec.eval.runs import evaluate_drafters

    run = evaluate_drafters(
        [parse_drafter_spec(d) for d in args.drafter], decode_settings(args, compile=args.compile),
        target=args.target, prompts=args.prompts, limit=args.limit, json_out=args.json, force=args.force,
        progress=not args.quiet, log=None if args.quiet else print, placement=placement(args))
    print(run.format())
    if run.lossless is False:
        warn(run.lossless_banner())
        return EXIT_NOT_LOSSLESS
    return 0


def add_profile(sub: Subparsers) -> None:
    """Time whole speculative steps (draft + select + pack + verify) of the target and a drafter for each batch
    size B and verified-token count N on synthetic prompts, and cache the table as JSON keyed by model, drafter,
    dtype, torch version and machine. A cached table for this setup is reused; a stale or foreign one is
    re-profiled."""
    p = sub.add_parser("profile", help="measure the step-latency table C(B, N) the verification budgets use",
                       description=add_profile.__doc__)
    add_target_flag(p)
    add_device_flags(p)
    p.add_argument("--drafter", required=True, metavar="SPEC", help=DRAFTER_SPECS.removeprefix("none | "))
    p.add_argument("--batch-sizes", default="1,2,4,8", metavar="B,B,...", help="(default: 1,2,4,8)")
    add_num_draft_tokens_flag(p)
    p.add_argument("--repeats", type=int, default=5, metavar="R", help="timed steps per cell, median kept (default: 5)")
    p.add_argument("--warmup", type=int, default=2, metavar="W", help="untimed steps per cell (default: 2)")
    p.add_argument("--out", metavar="FILE.json",
                   help="table file (default: .cache/angelspec-costs/<model>-<key digest>.json)")
    p.add_argument("--force", action="store_true", help="re-profile even when the cached table is up to date")
    p.add_argument("--compile", action="store_true",
                   help="profile a torch.compiled engine: the table that eval / bench --compile runs use (a table of "
                        "its own; a compiled step costs far less than an eager one)")
    p.set_defaults(func=cmd_profile)


def cmd_profile(args: argparse.Namespace) -> int:
    """`angelspec profile`: measure (or reuse) the cost table C(B, N) for a target and a drafter."""
    from angelspec.eval.runs import profile_cost_table

    try:
        batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    except ValueError:
        raise UsageError(f"--batch-sizes must be comma-separated integers, got {args.batch_sizes!r}") from None
    table, what = profile_cost_table(args.drafter, target=args.target, batch_sizes=batch_sizes,
                                     num_draft_tokens=args.num_draft_tokens, repeats=args.repeats,
                                     warmup=args.warmup, out=args.out, force=args.force, compile=args.compile,
                                     log=print, placement=placement(args))
    print(table.format())
    print(what)
    return 0


def add_calibrate(sub: Subparsers) -> None:
    """Decode held-out prompts with the drafter at full depth, record each draft position's confidence and
    whether the prefix up to it was accepted, fit Sequential Temperature Scaling, print the ECE per position
    before and after, and write calibration.json next to the drafter checkpoint; generate / eval / the budget
    policies then see calibrated confidences."""
    p = sub.add_parser("calibrate", help="fit per-position temperatures (STS) for a drafter's confidences",
                       description=add_calibrate.__doc__)
    add_target_flag(p)
    add_device_flags(p)
    p.add_argument("--drafter", required=True, metavar="DIR", help="drafter folder (DIR or KIND:DIR)")
    p.add_argument("--prompts", required=True, metavar="FILE.jsonl", help="held-out prompts, one per line")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="per prompt (default: 64)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="use at most N prompts")
    add_num_draft_tokens_flag(p)
    add_batch_size_flag(p)
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="decode at this sampling temperature and store the fit as the one at T (default: 0); fits at "
                        "other temperatures stay in calibration.json, and each request uses the nearest one")
    p.add_argument("--force", action="store_true", help="overwrite an existing fit at this temperature")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """`angelspec calibrate`: fit STS temperatures for a drafter's confidences and save calibration.json."""
    from angelspec.eval.runs import calibrate

    print(calibrate(args.drafter, args.prompts, target=args.target, max_new_tokens=args.max_new_tokens,
                    limit=args.limit, num_draft_tokens=args.num_draft_tokens, batch_size=args.batch_size,
                    temperature=args.temperature, force=args.force, progress=not args.quiet,
                    placement=placement(args)))
    return 0


def add_bench(sub: Subparsers) -> None:
    """For each --config and each concurrency C, run max(4C, --min-requests) greedy requests of --max-new-tokens tokens
    (a chat/code/math mix of the held-out prompts) through one engine with C rows (continuous batching = C
    closed-loop clients), compiled unless --no-compile, after an untimed warm-up; at each C every config runs beside
    the AR config's run. A drafter config without @POLICY runs the recommended serving setting `auto` (per step, the
    depth that commits most tokens per second at the current load, or plain steps where none beats them); @full or
    any other policy runs a fixed one. Print aggregate and per-user tokens/s, MAL, speed-up over the AR
    config, p50 / p95 time to first token and time per output token, the median per-step verify and draft (propose +
    on_commit) + select time, and whether D-cut beats full verification at the highest C (dcut, alg1, production and
    auto profile a cost table per drafter on first use, cached under .cache/angelspec-costs); write
    results.json, results.md and plots (needs matplotlib: pip install 'angelspec[bench]') into --out. vLLM (its own
    venv, `make vllm-venv`; --vllm DIR names another, --no-vllm skips it) serves the same requests at each C for
    every AR and full-depth n-gram config when its venv exists, and the table gains its tokens/s, ours/vLLM and
    whether its outputs equal ours. Exits 1 if a speculative output differs from AR's (a bug)."""
    p = sub.add_parser(
        "bench", help="closed-loop serving sweep: throughput vs concurrency for AR and drafters under depth policies",
        description=add_bench.__doc__)
    add_target_flag(p)
    add_device_flags(p)
    p.add_argument("--config", action="append", required=True, metavar="NAME=SPEC[@POLICY][+gate]",
                   help="one curve (repeatable): SPEC as --drafter takes it (none = AR), POLICY a depth policy "
                        "(default auto for a drafter: the recommended serving setting; full = every draft, a fixed "
                        "config), +gate the speculation gate (skip drafting where plain steps are faster), "
                        "+compile torch.compile in the engine (the default for every config; see --no-compile), "
                        "e.g. AR=none DFly=.cache/demo/dfly DFly-full=.cache/demo/dfly@full "
                        "DFly+D-cut=.cache/demo/dfly@dcut")
    p.add_argument("--concurrency", default="1,2,4,8,16,32", metavar="C,C,...",
                   help="concurrent requests per point (default: 1,2,4,8,16,32)")
    p.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="per request (default: 128)")
    add_num_draft_tokens_flag(p, "drafts per step for configs that do not name one")
    p.add_argument("--min-requests", type=int, default=8, metavar="N",
                   help="requests per point are max(4C, N) (default: 8)")
    p.add_argument("--repeats", type=int, default=1, metavar="R",
                   help="timed runs per point and config, the configs in turn each round (every other round in reverse "
                        "order, so that drift through a round favours none); the run with the median "
                        "throughput is reported, and the speed-up and p95 TPOT against AR's are the medians of each "
                        "round's ratio to AR's run of the same round, the speed-up with their range (default: 1; 3 or "
                        "more on a machine whose speed drifts)")
    p.add_argument("--warmup-tokens", type=int, default=8, metavar="N",
                   help="new tokens of the untimed warm-up batch per config (default: 8)")
    p.add_argument("--no-compile", dest="compile", action="store_false",
                   help="run eager (configs with +compile stay compiled); compiling costs about a minute per config "
                        "on a 2-core CPU")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help="workload prompts with a \"domain\" key (default: the shipped held-out prompts)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="use the first N prompts of each domain (default: every prompt that fits)")
    p.add_argument("--vllm", nargs="?", const=".venv-vllm", default=None, metavar="DIR",
                   help="run vLLM from the venv DIR (bare --vllm: .venv-vllm, which must exist) on the same requests "
                        "for every AR and full-depth n-gram config: its tokens/s, ours/vLLM, its MAL and whether its "
                        "outputs equal ours (log: --out/vllm.log); default: .venv-vllm when it exists "
                        "(`make vllm-venv`)")
    p.add_argument("--no-vllm", action="store_true", help="no vLLM column, even where .venv-vllm exists")
    p.add_argument("--out", required=True, metavar="DIR", help="folder for results.json, results.md and the plots")
    p.add_argument("--force", action="store_true", help="overwrite the sweep that --out already holds")
    p.add_argument("--breakeven", action="store_true",
                   help="also print the break-even committed length per drafter and concurrency (report Eq. 25)")
    p.add_argument("--quiet", action="store_true", help="print only the tables")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    """`angelspec bench`: closed-loop serving sweep of AR and drafters under depth policies."""
    from angelspec.assets import EVAL_PROMPTS
    from angelspec.eval.runs import DEFAULT_VLLM_VENV, run_bench
    from angelspec.eval.serving import BenchSettings, lossless, parse_concurrency

    if args.no_vllm and args.vllm is not None:
        raise UsageError("--vllm DIR and --no-vllm contradict each other; give one")
    vllm = None if args.no_vllm else args.vllm if args.vllm is not None else (
        DEFAULT_VLLM_VENV if (Path(DEFAULT_VLLM_VENV) / "bin" / "python").is_file() else None)
    settings = BenchSettings(concurrency=parse_concurrency(args.concurrency), max_new_tokens=args.max_new_tokens,
                             num_draft_tokens=args.num_draft_tokens, min_requests=args.min_requests,
                             warmup_tokens=args.warmup_tokens, compile=args.compile, limit=args.limit,
                             prompts=EVAL_PROMPTS if args.prompts is None else Path(args.prompts),
                             breakeven=args.breakeven, repeats=args.repeats)
    report = run_bench(args.config, args.out, settings, target=args.target, vllm=vllm,
                       log=None if args.quiet else print, placement=placement(args), force=args.force)
    return EXIT_NOT_LOSSLESS if lossless(report) is False else 0


def add_eval_server(sub: Subparsers) -> None:
    """Evaluate a training run while it trains (report §6): watch RUN_DIR (the --out folder of `angelspec train`)
    and, for each new checkpoint, decode held-out prompts with the real engine, AR and speculative side by side,
    and append MAL, p_1..p_K, the speed-up and the lossless check to RUN_DIR/training/eval_log.jsonl (and to
    TensorBoard when installed). Each checkpoint is evaluated once, also across restarts of the server or the
    trainer; the server only reads the trainer's files and stops when the run has finished."""
    p = sub.add_parser("eval-server", help="evaluate each new checkpoint of a training run",
                       description=add_eval_server.__doc__)
    p.add_argument("--watch", required=True, metavar="RUN_DIR", help="the --out folder of `angelspec train`")
    add_target_flag(p)
    add_device_flags(p)
    p.add_argument("--prompts", metavar="FILE.jsonl", help="held-out prompts (default: the shipped ones)")
    p.add_argument("--limit", type=int, default=4, metavar="N", help="prompts per domain (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="per prompt (default: 64)")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K",
                   help="drafts per step (default: a block drafter's block size - 1, else 4)")
    p.add_argument("--temperatures", default="0", metavar="T,T,...",
                   help="decode at each of these temperatures, e.g. 0,1 (default: 0)")
    p.add_argument("--poll", type=float, default=10.0, metavar="S", help="seconds between looks (default: 10)")
    p.add_argument("--idle-timeout", type=float, default=None, metavar="S",
                   help="stop after S seconds without a new checkpoint (default: wait for the run to finish)")
    p.add_argument("--once", action="store_true", help="evaluate what is there now and stop")
    p.add_argument("--wait", type=float, default=0.0, metavar="S",
                   help="wait up to S seconds for RUN_DIR to appear (default: 0)")
    p.add_argument("--trainer-pid", type=int, default=None, metavar="PID",
                   help="stop once process PID (the trainer) has exited and its last checkpoint is evaluated, "
                        "whatever RUN_DIR/train_report.json says (a resumed run keeps its previous segment's "
                        "report); default: stop when train_report.json exists")
    p.add_argument("--threads", type=int, default=1, metavar="N",
                   help="torch threads of the server (default: 1: beside a trainer, more threads wait on each other "
                        "and stretch its runs at random; the log's speedup_cpu stays comparable either way)")
    p.set_defaults(func=cmd_eval_server)


def cmd_eval_server(args: argparse.Namespace) -> int:
    """`angelspec eval-server --watch RUN_DIR`: call `run_eval_server`."""
    from angelspec.eval.server import EvalServerSettings, run_eval_server

    try:
        temps = tuple(float(t) for t in args.temperatures.split(","))
    except ValueError:
        raise UsageError(f"--temperatures: expected numbers separated by commas, got {args.temperatures!r}") from None
    settings = EvalServerSettings(limit=args.limit, max_new_tokens=args.max_new_tokens,
                                  num_draft_tokens=args.num_draft_tokens, temperatures=temps, poll_s=args.poll,
                                  idle_timeout_s=args.idle_timeout, threads=args.threads)
    n = run_eval_server(args.watch, args.target, prompts_path=args.prompts, settings=settings, once=args.once,
                        wait_s=args.wait, trainer_pid=args.trainer_pid, placement=placement(args))
    print(f"evaluated {n} checkpoint(s); log: {args.watch}/training/eval_log.jsonl")
    return 0

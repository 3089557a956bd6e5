"""Flag blocks several commands share, each defined once (`add_*_flags`), and the exit codes.

The checks behind the flags live in the library functions the handlers call (`angelspec.decoding.generate`
for sampling and `--policy`, `angelspec.fileio.check_output_path`, `angelspec.errors.require_positive`), so
Python callers get the same messages.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from angelspec.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_NOT_LOSSLESS

if TYPE_CHECKING:
    from angelspec.decoding.settings import DecodeSettings
    from angelspec.models.device import Placement  # torch is imported when a handler calls `placement`

# The flag each setting of the library's typed settings comes from, where a library error names it
# (`errors.SettingError`); a setting not listed keeps its field name.
SETTING_FLAGS = {
    "sp": "--sp", "distributed": "--distributed", "feature_workers": "--feature-workers",
    "feature_backend": "--feature-backend", "head": "--head", "init_from": "--init-from", "only": "--only",
    "concurrency": "--concurrency", "min_requests": "--min-requests", "warmup_tokens": "--warmup-tokens",
    "num_draft_tokens": "--num-draft-tokens", "max_new_tokens": "--max-new-tokens", "batch_size": "--batch-size",
    "limit": "--limit", "repeats": "--repeats",
}


def error_line(exc: BaseException) -> str:
    """The one line a user error is shown as (`errors.describe_error`), the settings a `SettingError` names
    spelled as the flags they come from (`SETTING_FLAGS`)."""
    from angelspec.errors import SettingError, describe_error

    if isinstance(exc, SettingError):
        return exc.worded(lambda name: SETTING_FLAGS.get(name, name))
    return describe_error(exc)


TARGET_HELP = "HF checkpoint folder (default: the embedded target)"
DRAFTER_SPECS = "none | ngram | ngram:N | draft-lm:DIR | DIR"
POLICY_HELP = ("drafts each request verifies per step: full | fixed:N | threshold:C | dcut | dcut:RHO | alg1 | "
               "alg1:TAU | production | auto | auto:slack=S (default: full; auto: per step the depth that commits "
               "most tokens per second at the current load, or plain steps, its lookup steps slowing no request by "
               "more than S = 0.05 of its time per token, none: no bound; dcut, alg1, production and auto read a "
               "measured cost table, profiled on first use and cached)")
THINK_HELP = "render the chat template in thinking mode (default: --no-think)"

Subparsers = argparse._SubParsersAction

__all__ = ["DRAFTER_SPECS", "EXIT_BAD_INPUT", "EXIT_INTERRUPTED", "EXIT_NOT_LOSSLESS", "POLICY_HELP", "Subparsers",
           "TARGET_HELP", "THINK_HELP", "add_batch_size_flag", "add_device_flags", "add_num_draft_tokens_flag",
           "add_overrides", "add_policy_flags", "add_sampling_flags", "add_target_flag", "add_think_flag", "placement",
           "warn"]

DEVICE_HELP = "cpu, cuda, cuda:N or mps (default: cuda:0 where torch sees a GPU, else cpu)"
ATTENTION_HELP = ("attention kernels: auto, sdpa, native, flex or expand (default auto: FlexAttention on a GPU, our "
                  "native kernel for decode and verify steps on a CPU; docs/devices.md)")
DTYPE_HELP = "float32, bfloat16 or float16 of the target (default: bfloat16 on a GPU, float32 elsewhere)"


def add_target_flag(p: argparse.ArgumentParser, help: str = TARGET_HELP) -> None:
    p.add_argument("--target", metavar="DIR", help=help)


def add_device_flags(p: argparse.ArgumentParser, dtype_help: str = DTYPE_HELP) -> None:
    """--device, --dtype and --attention of every command that loads a model (read back with `placement`)."""
    p.add_argument("--device", default=None, metavar="DEV", help=DEVICE_HELP)
    p.add_argument("--dtype", default=None, metavar="DTYPE", help=dtype_help)
    p.add_argument("--attention", default=None, metavar="KERNEL", help=ATTENTION_HELP)


def placement(args: argparse.Namespace) -> Placement:
    """--device, --dtype and --attention as the `Placement` the library takes; a device that is not there is a
    UsageError."""
    from angelspec.models.device import resolve_placement

    return resolve_placement(args.device, args.dtype, args.attention)


def add_sampling_flags(p: argparse.ArgumentParser, *, seed: int | None,
                       temperature_help: str = "0 = greedy (default: 0)",
                       seed_help: str = "request i uses seed S+i (default: 0)") -> None:
    """--temperature, --top-p, --top-k and --seed (default `seed`)."""
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help=temperature_help)
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus mass in (0, 1] (default: 1)")
    p.add_argument("--top-k", type=int, default=0, metavar="K", help="0 = disabled (default: 0)")
    p.add_argument("--seed", type=int, default=seed, metavar="S", help=seed_help)


DEPTH_DEFAULT_HELP = "default: the depth the drafter was trained for; 4 for n-gram lookup and the draft LM"


def add_num_draft_tokens_flag(p: argparse.ArgumentParser, help: str = "drafts proposed and verified per step") -> None:
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="K", help=f"{help} ({DEPTH_DEFAULT_HELP})")


def add_batch_size_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=int, default=8, metavar="B", help="concurrent requests (default: 8)")


def add_think_flag(p: argparse.ArgumentParser, help: str = THINK_HELP) -> None:
    p.add_argument("--think", action=argparse.BooleanOptionalAction, default=False, help=help)


def add_policy_flags(p: argparse.ArgumentParser) -> None:
    """--policy and --cost-table (the depth policy of `angelspec.decoding.policies.factory`)."""
    p.add_argument("--policy", default="full", metavar="SPEC", help=POLICY_HELP)
    p.add_argument("--cost-table", default=None, metavar="FILE.json",
                   help="cost table of --policy dcut / alg1 / production / auto (default: "
                        ".cache/angelspec-costs/<model>-<key digest>.json; re-profiled when stale)")
    p.add_argument("--spec-gate", action="store_true",
                   help="skip drafting on steps where plain decoding has been committing tokens faster at the "
                        "current batch size (measured online; outputs stay exact, sampled ones are not "
                        "bit-reproducible across runs)")


def decode_settings(args: argparse.Namespace, *, compile: bool = False) -> DecodeSettings:
    """The `DecodeSettings` of a decoding command's flags (`add_sampling_flags`, `add_num_draft_tokens_flag`,
    `add_batch_size_flag`, `add_think_flag`, `add_policy_flags`, --max-new-tokens)."""
    from angelspec.decoding.settings import DecodeSettings

    return DecodeSettings(num_draft_tokens=args.num_draft_tokens, max_new_tokens=args.max_new_tokens,
                          batch_size=args.batch_size, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                          seed=args.seed, think=args.think, policy=args.policy, cost_table=args.cost_table,
                          spec_gate=args.spec_gate, compile=compile)


def add_overrides(p: argparse.ArgumentParser) -> None:
    """The trailing `key=value` preset overrides of `train` and `target build`."""
    p.add_argument("overrides", nargs="*", metavar="key=value", help="override preset fields, e.g. steps=100")


def warn(message: str) -> None:
    """A note on stderr (stdout keeps the results)."""
    print(message, file=sys.stderr)

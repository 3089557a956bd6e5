"""Exceptions shared by every layer, the test that tells bad input from a bug, and the exit codes.

Bad input gets one of AngelSpec's own exception classes (this module's, or a module's own subclass of
`ValueError` such as `CheckpointError`); the command line turns those into one line on stderr and exit code 2
(`is_user_error`, `EXIT_BAD_INPUT`), and keeps the traceback of anything else, which is a bug.
"""

from __future__ import annotations

import errno
import re
from collections.abc import Callable

_SETTING = re.compile(r"\{(\w+)\}")


class UsageError(ValueError):
    """Bad input that argparse cannot see: values, combinations, missing artefacts. The message names the
    problem and the fix."""


class SettingError(UsageError):
    """Bad input in a field of a library call's typed settings (`TrainSettings.sp`, `BenchSettings.min_requests`,
    ...). The message names the settings it is about as `{field}` placeholders: `str()` spells each by its field
    name, and a caller that knows them by other names words it with `worded` (the command line: its flags)."""

    def __init__(self, template: str) -> None:
        self.template = template
        super().__init__(self.worded(str))

    @property
    def settings(self) -> tuple[str, ...]:
        """The fields the message names, in order."""
        return tuple(_SETTING.findall(self.template))

    def worded(self, name_of: Callable[[str], str]) -> str:
        """The message with every setting named `name_of(field)`."""
        return _SETTING.sub(lambda m: name_of(m.group(1)), self.template)


# Exit codes of the command line, the demo and the benchmarks.
EXIT_NOT_LOSSLESS = 1  # speculative outputs at T=0 differ from AR's: a bug in the engine, not bad input
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


# Faults of the file system a command cannot fix itself, with what the user can do (`describe_error`).
FILE_SYSTEM_FAULTS = {
    errno.ENOSPC: "the disk is full: free some space (or give an output on another disk) and run it again",
    errno.EDQUOT: "the disk quota is used up: free some space and run it again",
    errno.EROFS: "the file system is read-only: give an output on a writable one",
    errno.EACCES: "fix its permissions or give a path you can use",
    errno.EPERM: "fix its permissions or give a path you can use",
    errno.EIO: "the disk reported an input/output error: check it and run it again",
}


def is_user_error(exc: BaseException) -> bool:
    """Bad input rather than a bug: our own exception classes, missing / already-existing files, and faults of the
    file system (full, read-only, no permission: `FILE_SYSTEM_FAULTS`)."""
    if isinstance(exc, FileExistsError | FileNotFoundError):
        return True
    if isinstance(exc, OSError) and exc.errno in FILE_SYSTEM_FAULTS:
        return True
    return isinstance(exc, Exception) and type(exc).__module__.split(".")[0] == "angelspec"


def describe_error(exc: BaseException) -> str:
    """The one line a user error is shown as: its message, or for a fault of the file system the file, the fault
    and the fix (outputs are written to a temp file and renamed into place, so none is left half-written)."""
    if isinstance(exc, OSError) and exc.errno in FILE_SYSTEM_FAULTS and type(exc).__module__ == "builtins":
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror}; {FILE_SYSTEM_FAULTS[exc.errno]} (nothing half-written was left behind)"
    return str(exc)


def _refuse(name: str, problem: str) -> UsageError:
    """The error for `name` (a flag such as "--sp", or a setting's field name such as "sp": a `SettingError`)."""
    if name.isidentifier():
        return SettingError(f"{{{name}}} {problem}")
    return UsageError(f"{name} {problem}")


def require_positive(name: str, value: int) -> None:
    """Refuse a count below 1 (`name` is the flag, argument or setting the message names; a setting's field name
    raises a `SettingError`)."""
    if value < 1:
        raise _refuse(name, f"must be at least 1, got {value}")


def require_range(name: str, value: float, low: float, high: float, what: str = "") -> None:
    """Refuse a number outside [low, high], NaN included (`name` is the flag or setting the message names, as in
    `require_positive`; `what` says what the bound comes from, e.g. " (the target's context)")."""
    if not low <= value <= high:
        raise _refuse(name, f"must be at least {low} and at most {high}{what}, got {value}")

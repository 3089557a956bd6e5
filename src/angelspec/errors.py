"""Exceptions shared by every layer, the test that tells bad input from a bug, and the exit codes.

Bad input gets one of AngelSpec's own exception classes (this module's, or a module's own subclass of
`ValueError` such as `CheckpointError`); the command line turns those into one line on stderr and exit code 2
(`is_user_error`, `EXIT_BAD_INPUT`), and keeps the traceback of anything else, which is a bug.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input that argparse cannot see: values, combinations, missing artefacts. The message names the
    problem and the fix."""


# Exit codes of the command line, the demo and the benchmarks.
EXIT_NOT_LOSSLESS = 1  # speculative outputs at T=0 differ from AR's: a bug in the engine, not bad input
EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def is_user_error(exc: BaseException) -> bool:
    """Bad input rather than a bug: our own exception classes, and missing / already-existing files."""
    if isinstance(exc, FileExistsError | FileNotFoundError):
        return True
    return isinstance(exc, Exception) and type(exc).__module__.split(".")[0] == "angelspec"


def require_positive(name: str, value: int) -> None:
    """Refuse a count below 1 (`name` is the flag or argument the message names)."""
    if value < 1:
        raise UsageError(f"{name} must be at least 1, got {value}")

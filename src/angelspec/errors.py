"""Exceptions shared by every layer.

Bad input gets one of AngelSpec's own exception classes (this module's, or a module's own subclass of
`ValueError` such as `CheckpointError`); the command line turns those into one line on stderr and exit code 2,
and keeps the traceback of anything else, which is a bug.
"""

from __future__ import annotations


class UsageError(ValueError):
    """Bad input that argparse cannot see: values, combinations, missing artefacts. The message names the
    problem and the fix."""

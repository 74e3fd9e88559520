"""User-facing errors and the exit codes the CLI documents."""
from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Exit codes of the ``quiver`` command (also listed in docs/cli.md)."""

    OK = 0
    MISMATCH = 1  # verify/diff found differences
    USAGE = 2  # bad command line (argparse uses 2 too)
    NOT_FOUND = 3  # a source, object, file or dataset does not exist
    BAD_DIGEST = 4  # truncated, corrupted, foreign or future-version digest
    BAD_INPUT = 5  # a source that cannot be digested (empty, loop, bad name)
    PERMISSION = 6  # unreadable file, missing credentials, access denied
    BACKEND = 7  # storage unreachable after retries
    DAEMON = 8  # mountd/coordinator not running, or refused the request
    MOUNT = 9  # mount root problems (missing, busy, stale)
    CONFIG = 10  # the config file is missing, unreadable, not TOML, or has a bad key or value


class QuietError(Exception):
    """An error the CLI prints as one line, without a traceback."""

    def __init__(self, message: str, exitcode: ExitCode = ExitCode.BAD_INPUT) -> None:
        super().__init__(message)
        self.message = message
        self.exitcode = exitcode

    def __str__(self) -> str:
        return self.message


def quiet_error_in(group: BaseExceptionGroup) -> QuietError | None:
    """The user error that ended a daemon's tasks, where that is all a group holds
    (trio wraps a task's exception in a group at each nursery it leaves); None if it
    holds anything else, which is then a bug to show whole."""
    quiet, rest = group.split(QuietError)
    while isinstance(quiet, BaseExceptionGroup) and rest is None:
        quiet = quiet.exceptions[0]
    return quiet if isinstance(quiet, QuietError) else None

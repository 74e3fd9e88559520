"""What the store raises, and how a disk or SQLite error is told apart: damage to the
index (moved aside and rebuilt) from a full, busy or unreadable disk (tried again)."""
from __future__ import annotations

import contextlib
import errno
import sqlite3
from collections.abc import Iterator

import diskcache

# Errors of the process, not of an entry's file: the read fails, the entry stays.
PROCESS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# SQLite's primary result codes that say the index itself is damaged.
DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
# What a store operation may raise when the disk or the index fails.
STORE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)


class IntegrityError(Exception):
    """Content whose SHA-256 is not the one it was asked for."""


class StoreError(Exception):
    """The store could not answer (a disk or index error): the read that asked fails."""


class IndexDamaged(StoreError):
    """SQLite found the index damaged ("malformed", "not a database", quick_check)."""


class StoreBusy(StoreError):
    """The other side of the directory lock holds it: mountd opening or rebuilding the
    index, or a loader process writing while mountd wants to."""


def is_damage(exc: BaseException) -> bool:
    """Whether ``exc`` says the SQLite index is damaged (not busy, full or unreadable)."""
    code = getattr(exc, "sqlite_errorcode", None)
    return (isinstance(exc, sqlite3.DatabaseError) and code is not None
            and code & 0xFF in DAMAGE_CODES)


def describe(exc: BaseException) -> str:
    """A short reason: an OSError's strerror, SQLite's message, or what a diskcache
    Timeout hides (it is raised from the OperationalError that BEGIN met)."""
    if isinstance(exc, diskcache.Timeout):
        return (describe(exc.__context__) if exc.__context__ is not None
                else "the index stayed locked")
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


@contextlib.contextmanager
def damage_raised() -> Iterator[None]:
    """Raise SQLite's damage errors as IndexDamaged."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        if is_damage(exc):
            raise IndexDamaged(describe(exc)) from exc
        raise

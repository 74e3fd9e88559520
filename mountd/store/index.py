"""The store's index: diskcache on one directory, opened, checked and rebuilt here.

A damaged index (SQLite's "malformed" or "not a database", or a failed quick_check) is
moved aside and the store starts empty; value files no index row names are removed at
every open. A store that cannot even open is skipped (every read a miss) until it can.

Loader processes (``mountd.fetch.loader_process``) write into the same directory
through a ``StoreWriter``, which holds the index only under a shared lock on the
directory; the index is opened (and rebuilt) only under the exclusive lock, so it is
never moved aside, nor its files reclaimed, under a writer of another process.
"""
from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import gc
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable
from typing import Any

import diskcache
from diskcache.core import DBNAME

from mountd.store.disk_cache import (TIMEOUT, ContentBoundCache, TrackedDisk, directory_lock,
                                     open_cache)
from mountd.store.errors import (STORE_ERRORS, IndexDamaged, StoreBusy, damage_raised,
                                 describe, is_damage)
from mountd.store.health import WriteHealth
from mountd.store.value_files import VALUE_SUFFIX, ValueFiles, VerifiedDigests

log = logging.getLogger(__name__)

KEEP_DAMAGED = 2  # damaged indexes kept for a post-mortem (each as large as the index)
DAMAGED_SUFFIX = ".damaged-"  # cache.db.damaged-YYYYmmddTHHMMSS


@dataclasses.dataclass
class Index:
    """The two diskcache handles on one index: writes (LRU) and lock-free reads."""

    cache: ContentBoundCache
    reader: diskcache.Cache

    @property
    def disk(self) -> TrackedDisk:
        return self.cache.disk

    def close(self) -> None:
        """Close this thread's connections (each thread has its own)."""
        self.reader.close()
        self.cache.close()


class StoreIndex:
    """mountd's index on the store's directory: open (``current``), being rebuilt, or
    waiting to be tried again. It fills ``files`` with the value files the index names
    when it opens, and empties it and ``verified`` when it drops a damaged index."""

    def __init__(self, directory: str, size_limit: int, health: WriteHealth,
                 files: ValueFiles, verified: VerifiedDigests) -> None:
        self.directory = directory
        self.size_limit = size_limit
        self.health = health
        self.files = files
        self.verified = verified
        # Writers take turns here: cheaper than colliding in SQLite, whose busy handler
        # sleeps for milliseconds. Opening and rebuilding the index hold it too.
        self.write_lock = threading.Lock()
        self.current: Index | None = None
        self._damage: str | None = None  # why the index must be moved aside
        self._damaged_id: tuple[int, int] | None = None  # (st_dev, st_ino) of it
        self._opened_id: tuple[int, int] | None = None  # of the index ``current`` opened
        self._aside: str | None = None  # where the last damaged index went
        with self.write_lock:
            self.open()

    @property
    def db_path(self) -> str:
        return os.path.join(self.directory, DBNAME)

    def _connect(self) -> tuple[Index, set[str], ValueFiles]:
        """Open the index, check it page by page, and list the value files it names,
        and where each item's is (the most recently used, if more than MAX_KNOWN_FILES).
        Raises IndexDamaged if SQLite finds it damaged."""
        cache = open_cache(self.directory, self.size_limit)
        try:
            with damage_raised():
                reader = diskcache.Cache(self.directory, timeout=TIMEOUT)
        except BaseException:
            cache.close()
            raise
        reader.reset("eviction_policy", "least-recently-stored", update=False)
        index = Index(cache, reader)
        try:
            with damage_raised(), contextlib.closing(
                    sqlite3.connect(self.db_path, timeout=TIMEOUT)) as con:
                problems = [row[0] for row in con.execute("PRAGMA quick_check")]
                if problems != ["ok"]:
                    raise IndexDamaged(f"quick_check: {'; '.join(problems[:3])}")
                named, files = set(), ValueFiles(self.directory)
                for key, raw, name, tag in con.execute(
                        "SELECT key, raw, filename, tag FROM Cache "
                        "WHERE filename IS NOT NULL ORDER BY access_time"):
                    named.add(name)
                    if raw:  # keys are bytes, stored raw: another key is none of ours
                        files.learn(key, name, tag)
                with con:  # items kept in SQLite by a version that counted them as 0
                    con.execute("UPDATE Cache SET size = length(value) "
                                "WHERE filename IS NULL AND size = 0 AND value IS NOT NULL")
                (rows,) = con.execute("SELECT EXISTS (SELECT 1 FROM Cache "
                                      "WHERE filename IS NULL)").fetchone()
                files.complete = files.complete and not rows  # a row's entry has no file
        except BaseException:
            index.close()
            raise
        return index, named, files

    def open(self) -> None:
        """Open the index (moving a damaged one aside first), and remove the value files
        it does not name before anything is served. The caller holds the write lock."""
        try:
            with directory_lock(self.directory, fcntl.LOCK_EX):
                opened = self._open_index()
        except StoreBusy:
            log.debug("store %s: a loader process holds the index: opening it later",
                      self.directory)
            if self.health.error is None:
                self.health.note("a loader process holds the store's index")
            opened = None
        except (*STORE_ERRORS, IndexDamaged) as exc:
            self.write_failed(None, exc, "open the store")
            opened = None
        if opened is None:
            # A diskcache.Cache that failed halfway keeps its connection in a reference
            # cycle: free it now rather than hold its descriptors until a collection.
            gc.collect()
            return
        self.current, listed, reclaimed = opened
        self.files.adopt(listed)
        if self._damage is not None:
            log.warning("store %s: the index was damaged (%s): moved it to %s and started "
                        "with an empty store (%d value files removed)", self.directory,
                        self._damage, self._aside, reclaimed)
            self._damage = None
        elif reclaimed:
            log.warning("store %s: removed %d value files the index does not name (an "
                        "index lost or truncated, or writes cut short)", self.directory,
                        reclaimed)
        self.health.recovered()

    def _open_index(self) -> tuple[Index, ValueFiles, int] | None:
        """The open index, where its value files are, and how many value files were
        removed; None while a damaged index cannot be moved aside yet."""
        opened = None
        if self._damage is None:
            try:
                opened = self._connect()
            except IndexDamaged as exc:
                # the file this process just opened: it holds the directory's lock
                self._damage, self._damaged_id = str(exc), _file_id(self.db_path)
        if opened is None:  # out of the except block, whose traceback holds the index
            if not self._move_aside():
                self.health.note("the index is damaged: rebuilding the store")
                return None
            opened = self._connect()
        index, named, files = opened
        self._opened_id = _file_id(self.db_path)
        _make_private(self.directory)
        return index, files, self._reclaim(index, named)

    def _move_aside(self) -> bool:
        """Rename the damaged index (and its WAL) to DBNAME.damaged-STAMP, keeping the
        newest KEEP_DAMAGED; True where the index is to be opened afresh. False while a
        connection of this process still has it open (closing it later would delete the
        new index's WAL, which it knows by path), or while the file at its path cannot
        be told to be the one this process found damaged (then it is another's: not
        moved, and opened in its place when it is no longer the damaged one)."""
        gc.collect()  # connections of dropped handles wait in reference cycles
        if self._damaged_id is None:
            # never identified (the disk failed its stat): found damaged afresh, and
            # identified then, by the next try
            self._damage = None
            return False
        try:
            at_path = _file_id(self.db_path, strict=True)
        except OSError as exc:
            log.debug("store %s: cannot stat the damaged index: %s", self.directory, exc)
            return False
        if at_path is not None and at_path != self._damaged_id:
            log.warning("store %s: the damaged index was replaced by another file: "
                        "opening that one, not moving it aside", self.directory)
            self._damage = self._damaged_id = None
            return True
        if _open_in_process(self._damaged_id):
            log.debug("store %s: the damaged index is still open", self.directory)
            return False
        aside = f"{self.db_path}{DAMAGED_SUFFIX}{time.strftime('%Y%m%dT%H%M%S')}"
        self._aside = aside
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.db_path, aside)
        with contextlib.suppress(FileNotFoundError):
            os.replace(self.db_path + "-wal", aside + "-wal")
        with contextlib.suppress(FileNotFoundError):
            os.remove(self.db_path + "-shm")  # an index into the WAL, made again on open
        self._damaged_id = None
        kept = sorted(n for n in os.listdir(self.directory)
                      if n.startswith(DBNAME + DAMAGED_SUFFIX) and not n.endswith("-wal"))
        for name in kept[:-KEEP_DAMAGED]:
            for path in (name, name + "-wal"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, path))
        return True

    def _reclaim(self, index: Index, named: set[str]) -> int:
        """Remove the value files no index row names (left by an index lost, truncated
        or moved aside, or by a write a crash cut short); how many."""
        removed = 0
        for dirpath, _, files in os.walk(self.directory):
            if dirpath == self.directory:
                continue  # the index and its damaged copies; values live in subfolders
            for name in files:
                rel = os.path.relpath(os.path.join(dirpath, name), self.directory)
                if name.endswith(VALUE_SUFFIX) and rel not in named:
                    index.disk.remove(rel)  # and its folders, once empty
                    removed += 1
        return removed

    def drop_damaged(self, index: Index, reason: str) -> None:
        """Stop using a damaged index; the next use of the store rebuilds it (``open``).
        The caller holds the write lock."""
        if self.current is not index:
            return  # another thread got there first
        log.warning("store %s: the index is damaged (%s): rebuilding the store",
                    self.directory, reason)
        self.current = None
        # the file it opened: the path may name another's by now
        self._damage, self._damaged_id = reason, self._opened_id
        index.close()
        self.files.clear()
        self.verified.clear()
        self.health.retry_at = 0.0
        self.health.note("the index is damaged: rebuilding the store")

    def start_rebuild(self, index: Index, exc: BaseException) -> None:
        with self.write_lock:
            self.drop_damaged(index, describe(exc))
        del index  # other threads' connections to it close once it is collected
        self.usable()

    def usable(self) -> Index | None:
        """The open index; or, once the retry interval has passed, another try at
        opening it; None while the store cannot be used."""
        index = self.current
        if index is not None or not self.health.retry_due():
            return index
        with self.write_lock:
            if self.current is None and self.health.retry_due():
                self.health.retry_later()
                self.open()
            return self.current

    def for_writes(self) -> Index | None:
        """The index, unless the store waits to try writing again after a failure."""
        index = self.usable()
        return None if index is None or self.health.waiting() else index

    def write_failed(self, index: Index | None, exc: BaseException, doing: str) -> None:
        """Note a failed write: a damaged index is rebuilt, anything else is tried again
        after WRITE_RETRY_INTERVAL. The caller holds the write lock."""
        if index is not None:
            index.cache.close()  # with a transaction a failed COMMIT may have left open
            if is_damage(exc):
                self.drop_damaged(index, describe(exc))
                return
        self.health.failed(describe(exc), doing)

    def write(self, do: Callable[[Index, Any], int], arg: Any, doing: str,
              blocking: bool = True) -> int | None:
        """``do(index, arg)`` under the write lock; 0 if the store cannot write; None,
        unless ``blocking``, where another thread holds the lock."""
        index = self.for_writes()
        if not self.write_lock.acquire(blocking=blocking):
            return None
        try:
            if index is None or index is not self.current:
                return 0
            try:
                return do(index, arg)
            except STORE_ERRORS as exc:
                self.write_failed(index, exc, doing)
                return 0
        finally:
            self.write_lock.release()

    def query(self, ask: Callable[[Index], int]) -> int:
        """``ask(index)``; 0 while the store cannot answer."""
        index = self.usable()
        if index is None:
            return 0
        try:
            return ask(index)
        except STORE_ERRORS as exc:
            if is_damage(exc):
                self.start_rebuild(index, exc)
            log.debug("store %s: a query failed: %s", self.directory, describe(exc))
            return 0

    def close(self) -> None:
        with self.write_lock:
            index, self.current = self.current, None
            self.health.retry_at = float("inf")  # closed for good
        if index is not None:
            index.close()


def _make_private(directory: str) -> None:
    """Leave the store readable by root only: its index holds every user's keys (and,
    where an older version wrote it, small items). mountd's umask makes what it writes
    private; a store an older version wrote (its index readable by others) has its
    folders and files made so too."""
    os.chmod(directory, 0o700)
    db = os.path.join(directory, DBNAME)
    if not os.stat(db).st_mode & 0o077:
        return
    log.info("store %s: making its files readable by root only", directory)
    for dirpath, _, files in os.walk(directory):
        os.chmod(dirpath, 0o700)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o600)


def _file_id(path: str, strict: bool = False) -> tuple[int, int] | None:
    """``path``'s (st_dev, st_ino); None if there is no such file, or (unless
    ``strict``: then it raises) the disk fails the stat."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError:
        if strict:
            raise
        return None
    return st.st_dev, st.st_ino


def _open_in_process(file_id: tuple[int, int]) -> bool:
    """Whether a descriptor of this process refers to the file ``file_id`` (Linux)."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if (st.st_dev, st.st_ino) == file_id:
            return True
    return False

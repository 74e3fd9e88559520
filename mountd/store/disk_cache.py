"""The store's diskcache handle, with its settings: every item a value file of its own,
bounded by the items' bytes, evicting one entry at a time and noting which; and the
directory lock mountd shares with the loader processes that write through such a
handle (``mountd.store.index`` opens and rebuilds the index under it)."""
from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from typing import Any

import diskcache
from diskcache.core import EVICTION_POLICY, MODE_BINARY, UNKNOWN

from mountd.store.errors import StoreBusy, damage_raised

# diskcache settings (units in the comments).
CULL_LIMIT = 8  # most items an insert evicts (one at a time, until it fits: _cull)
# Bytes: values this large and larger are files, smaller ones rows of the index. Every
# value is a file, even an empty one: the native data plane serves a hit by reading its
# value file, and a row only Python can read, on the slow path. A store an older
# version wrote keeps its rows (read through ``ContentStore.get``) until they go.
DISK_MIN_FILE_SIZE = 0
SQLITE_MMAP_SIZE = 256 << 20  # bytes of the index mapped into memory
TIMEOUT = 60  # seconds a writer waits for SQLite's lock


class TrackedDisk(diskcache.Disk):
    """diskcache's Disk, remembering the value file it last named: a put that fails
    while or after writing it must remove it (diskcache leaves it behind). A value kept
    in SQLite (under DISK_MIN_FILE_SIZE) is given its length as its size, where
    diskcache says 0, so that the store's bound counts it (``ContentBoundCache``).
    A value file is written in one call."""

    last_file: str | None = None

    def filename(self, key: object = UNKNOWN, value: object = UNKNOWN) -> tuple[str, str]:
        name, full_path = super().filename(key, value)
        self.last_file = name
        return name, full_path

    def store(self, value: Any, read: bool, key: object = UNKNOWN
              ) -> tuple[int, int, str | None, Any]:
        if type(value) is bytes and len(value) >= self.min_file_size:
            # diskcache writes bytes from an io.BytesIO, whose iteration yields lines: a
            # JPEG of 100 KB becomes hundreds of write calls. Its own writer, given the
            # value as one piece, writes it in one:
            name, full_path = self.filename(key, value)
            self._write(full_path, (value,), "xb")
            return len(value), MODE_BINARY, name, None
        size, mode, filename, db_value = super().store(value, read, key=key)
        if filename is None and isinstance(db_value, (bytes, memoryview)):
            size = len(db_value)
        return size, mode, filename, db_value


class ContentBoundCache(diskcache.Cache):
    """diskcache's Cache, bounded by the bytes of the items it holds, as ``cache-size``
    says (rclone's and gcsfuse's cache sizes count their files' bytes too). diskcache's
    own volume adds the SQLite file's pages, so a store sized to a dataset would not
    hold it, and every pass over it would miss and cull anew. The index is on top of
    the bound (docs/operations.md)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._culled: list[bytes] = []  # the keys ``_cull`` evicted (``noting_culls``)

    def volume(self) -> int:
        return int(self.reset("size"))

    def _cull(self, now: float, sql: Any, cleanup: Any, limit: int | None = None) -> None:
        """Evict one entry at a time (by the eviction policy) until the volume is under
        the bound, at most ``cull_limit``, noting each one's key. diskcache's own evicts
        ``cull_limit`` entries whenever an insert reaches the bound: a small store lost
        a fifth of what it held at a time (8 of the demo's 40 items), items its jobs
        still needed. The victim's key is selected by the very statement diskcache
        selects its file and deletes its row by, in the same transaction."""
        victim = EVICTION_POLICY[self.eviction_policy]["cull"]
        for _ in range(self.cull_limit if limit is None else limit):
            if self.volume() < self.size_limit:
                return
            row = (sql(victim.format(fields="key, raw", now=now), (1,)).fetchone()
                   if victim is not None else None)
            super()._cull(now, sql, cleanup, limit=1)
            if row is not None and row[1] and isinstance(row[0], bytes):
                self._culled.append(row[0])

    @contextlib.contextmanager
    def noting_culls(self) -> Iterator[list[bytes]]:
        """Note the keys the puts inside evict to make room: the list it gives gets them
        once the block ends and their transaction has committed; where the block raises
        (rolled back), it stays empty."""
        self._culled = []
        evicted: list[bytes] = []
        try:
            yield evicted
            evicted.extend(self._culled)
        finally:
            self._culled = []


def open_cache(directory: str, size_limit: int) -> ContentBoundCache:
    """The index's writing handle, with the store's settings (IndexDamaged if SQLite
    finds it damaged)."""
    with damage_raised():
        return ContentBoundCache(  # diskcache culls once at its limit: bound inclusive
            directory, disk=TrackedDisk, size_limit=size_limit + 1,
            eviction_policy="least-recently-used", cull_limit=CULL_LIMIT,
            disk_min_file_size=DISK_MIN_FILE_SIZE, sqlite_mmap_size=SQLITE_MMAP_SIZE,
            timeout=TIMEOUT, statistics=False)


@contextlib.contextmanager
def directory_lock(directory: str, mode: int) -> Iterator[None]:
    """Hold ``directory``'s flock in ``mode`` (shared: a loader process writing;
    exclusive: mountd opening the index). Raises StoreBusy if the other side holds it."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreBusy("another process holds the store's index") from None
        yield
    finally:
        os.close(fd)  # and with it the lock

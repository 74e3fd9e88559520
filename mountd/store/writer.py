"""A loader process's handle on mountd's store directory (``StoreWriter``)."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
from collections.abc import Sequence

import google_crc32c

from mountd.store.errors import (STORE_ERRORS, IndexDamaged, IntegrityError, StoreError,
                                 damage_raised, describe)
from mountd.store.disk_cache import ContentBoundCache, TrackedDisk, directory_lock, open_cache
from mountd.store.value_files import ValueFile


class StoreWriter:
    """A loader process's handle on a ContentStore's directory, for puts from one thread.

    It holds the index, and the directory's shared lock that keeps mountd from opening
    or rebuilding it meanwhile, only while it writes: ``release()`` lets go when idle,
    and a write that fails lets go at once (a damaged index is mountd's to rebuild).
    """

    def __init__(self, directory: str, size_limit: int) -> None:
        self.directory = directory
        self.size_limit = size_limit
        self._lock: contextlib.ExitStack | None = None
        self._cache: ContentBoundCache | None = None
        self._evicted: list[bytes] = []  # by the last put_many, committed with it

    def put(self, digest: bytes, data: bytes) -> ValueFile | None:
        """Store ``data`` under ``digest`` after checking that it hashes to it; its value
        file (None if kept in the index). Raises IntegrityError, IndexDamaged, or
        StoreError (StoreBusy while mountd opens the index)."""
        if hashlib.sha256(data).digest() != digest:
            raise IntegrityError(f"content does not hash to {digest.hex()}")
        (outcome,) = self.put_many([(digest, data)])
        if isinstance(outcome, StoreError):
            raise outcome
        return outcome

    def put_many(self, items: Sequence[tuple[bytes, bytes]]
                 ) -> list[ValueFile | None | StoreError]:
        """Store (digest, data) pairs whose data the caller has hashed to their digests,
        in one transaction: each one's value file (None if kept in the index) or, for
        every item when the transaction fails, the same StoreError (IndexDamaged, or
        StoreBusy while mountd opens the index); nothing of a failed batch is kept."""
        try:
            cache = self._acquire()
        except StoreError as exc:
            return [exc] * len(items)
        disk: TrackedDisk = cache.disk
        files: list[ValueFile | None] = []
        disk.last_file = None
        try:
            with cache.noting_culls() as self._evicted, damage_raised(), cache.transact():
                for digest, data in items:
                    tag = google_crc32c.value(data)
                    disk.last_file = None
                    cache.set(digest, data, tag=tag)
                    files.append(None if disk.last_file is None
                                 else ValueFile(disk.last_file, tag))
        except (*STORE_ERRORS, IndexDamaged) as exc:
            # the rows are rolled back; their files, and one written in part, are not
            names = {f.name for f in files if f is not None}
            if disk.last_file is not None:
                names.add(disk.last_file)
            for name in names:
                disk.remove(name)
            self.release()
            error = exc if isinstance(exc, StoreError) else StoreError(describe(exc))
            return [error] * len(items)
        return files

    def take_culled(self) -> list[bytes]:
        """The digests the last ``put_many`` evicted to make room (committed with it)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _acquire(self) -> ContentBoundCache:
        if self._cache is not None:
            return self._cache
        lock = contextlib.ExitStack()
        try:
            lock.enter_context(directory_lock(self.directory, fcntl.LOCK_SH))
            self._cache = open_cache(self.directory, self.size_limit)
        except STORE_ERRORS as exc:
            lock.close()
            raise StoreError(describe(exc)) from exc
        except BaseException:
            lock.close()
            raise
        self._lock = lock
        return self._cache

    def release(self) -> None:
        """Close the index and let go of the lock (the next put takes both again)."""
        cache, self._cache = self._cache, None
        lock, self._lock = self._lock, None
        try:
            if cache is not None:
                cache.close()
        finally:
            if lock is not None:
                lock.close()

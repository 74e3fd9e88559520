"""The local SSD store: content keyed by SHA-256 in a size-bounded diskcache.

Every value is checked against its hash before it is stored, and carries a CRC32C tag
(hardware accelerated) that is checked on every read; an entry is also hashed in full
the first time it is served after a start, so a file corrupted on disk (even with a
matching tag) is dropped and fetched again instead of served. The scrubber
(``mountd.store.scrubber``) hashes every entry again in the background, and drops one
that fails without waiting for a read to find it (``scrub``: what it counted).

A hit costs no SQLite query: the store keeps in memory where each value file is and
its tag (``mountd.store.value_files``), read from the index once at open and kept by
its own writes and by the loader processes' replies, evictions included: so it also
knows which entries it holds (``ValueFiles.holds``). A hit whose pages are in the page
cache is served on mountd's loop (``get_nowait``) without a worker thread.

The parts: ``StoreIndex`` opens, checks and rebuilds the index (``mountd.store.index``);
``WriteHealth`` knows whether it can write (``mountd.store.health``); ``Recency``
writes the hits' recency and the spent marks (``mountd.store.recency``). A bad disk
costs reads, never the daemon. Loader processes write into the same directory through
a ``StoreWriter`` (``mountd.store.writer``); mountd records what they stored, evicted
and could not store (``stored_elsewhere``, ``culled``, ``write_failed_elsewhere``).
"""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

import google_crc32c

from mountd.store.background_writes import STUCK_AFTER, BackgroundWrites
from mountd.store.errors import (PROCESS_ERRNOS, STORE_ERRORS, IntegrityError, StoreError,
                                 describe, is_damage)
from mountd.store.health import StoreHealth, WriteHealth
from mountd.store.index import Index, StoreIndex
from mountd.store.recency import Recency
from mountd.store.value_files import ValueFile, ValueFiles, VerifiedDigests, open_cached

log = logging.getLogger(__name__)

# Bytes: an item up to this size whose content was not yet hashed in full in this run
# is hashed on mountd's loop, which costs the loop less than handing it to a worker
# thread; a larger one is hashed in a worker.
VERIFY_ON_LOOP_MAX = 32 << 10
EVICTION_NEWS = 1 << 16  # the latest evictions kept for ``ContentStore.evictions``


@dataclasses.dataclass
class ScrubCounts:
    """What the scrubber (``mountd.store.scrubber``) has done since the start, kept with
    the store so that status and metrics read it as they read ``corrupt_dropped``."""

    scrubbed_bytes: int = 0  # bytes re-hashed
    scrub_passes: int = 0  # passes over every entry of the store finished
    scrub_failures: int = 0  # entries that failed the re-hash, and were dropped


class ContentStore:
    """Bytes by SHA-256, bounded by ``size_limit`` bytes, evicting least-recently-used."""

    def __init__(self, directory: str, size_limit: int) -> None:
        self.directory = directory
        self.corrupt_dropped = 0
        self.scrub = ScrubCounts()
        self.write_health = WriteHealth(directory)
        self.files = ValueFiles(directory)  # where values kept in files live
        self.verified = VerifiedDigests()
        self.index = StoreIndex(directory, size_limit, self.write_health, self.files,
                                self.verified)
        self.recency = Recency(self.index)
        self.writes = BackgroundWrites(directory)  # what no read waits for
        # what puts evicted, oldest first, for those who track what is cached (the view,
        # mountd.view.view_jobs) to take; appended from any thread
        self.evictions: collections.deque[bytes] = collections.deque(maxlen=EVICTION_NEWS)

    @property
    def size_limit(self) -> int:
        return self.index.size_limit

    # -- reads ----------------------------------------------------------------------
    def get(self, digest: bytes) -> bytes | None:
        """The content for ``digest``, or None if absent (or found corrupted and dropped,
        or while the store cannot be opened). Raises StoreError if the store fails."""
        pending = self.writes.pending.get(digest)
        if pending is not None:  # checked when it was fetched; not stored yet
            return pending
        known = self.files.locate(digest)
        if known is not None:
            path, tag = known
            try:
                with open(path, "rb", buffering=0) as f:
                    value = f.read()
            except FileNotFoundError:  # evicted since: ask the index
                self.files.forget(digest)
            except OSError as exc:
                self._read_failed(self.index.current, digest, exc)
            else:
                return self._checked(digest, value, tag)
        index = self.index.usable()
        if index is None:
            return None
        try:
            handle, tag = index.reader.get(digest, default=None, read=True, tag=True)
            if handle is None:
                return None
            if isinstance(handle, bytes):  # a row: a small item an older version stored
                return self._checked(digest, handle, tag)
            with handle:
                value = handle.read()
        except STORE_ERRORS as exc:
            self._read_failed(index, digest, exc)
        self.files.learn(digest, os.path.relpath(handle.name, self.directory), tag)
        return self._checked(digest, value, tag)

    def get_nowait(self, digest: bytes, size: int) -> bytes | None:
        """The content for ``digest`` if it can be had without waiting: an entry whose
        value file is known, whose ``size`` bytes are all in the page cache and match
        its CRC32C, and whose content was hashed in full in this run or is hashed now
        (up to VERIFY_ON_LOOP_MAX). None otherwise; ``get`` (in a worker thread) then
        decides, and drops what is corrupt.

        The caller is an event loop, so this never waits for the disk or the index: the
        path is resolved only from the dentry cache (``open_cached``) and the pages
        come with RWF_NOWAIT. Nothing here writes."""
        pending = self.writes.pending.get(digest)
        if pending is not None:
            return pending
        known = self.files.locate(digest)
        if known is None:
            return None
        verified = digest in self.verified
        if not verified and size > VERIFY_ON_LOOP_MAX:
            return None
        path, tag = known
        try:
            fd = open_cached(path)
        except OSError:
            return None  # evicted since, its path not cached, or no O_NOATIME rights
        try:
            value = bytearray(size + 1)  # one byte more: a longer file reads it
            if os.preadv(fd, [value], 0, os.RWF_NOWAIT) != size:
                return None  # not all cached (or not this size): read it in a thread
        except OSError:
            return None
        finally:
            os.close(fd)
        data = bytes(memoryview(value)[:size])  # crc32c wants read-only bytes
        if google_crc32c.value(data) != tag:
            return None
        if not verified and hashlib.sha256(data).digest() != digest:
            return None
        self.verified.add(digest)  # and again: the native data plane serves it anew
        self.recency.hit(digest)
        self.files.seen(digest)
        return data

    def _read_failed(self, index: Index | None, digest: bytes,
                     exc: BaseException) -> NoReturn:
        """Raise StoreError for a failed read; first rebuild a damaged index, or drop an
        entry whose file failed (its next read fetches it again)."""
        if index is not None and is_damage(exc):
            self.index.start_rebuild(index, exc)
        elif isinstance(exc, OSError) and exc.errno not in PROCESS_ERRNOS:
            self.discard(digest)
        raise StoreError(describe(exc)) from exc

    def _checked(self, digest: bytes, value: bytes, tag: int) -> bytes | None:
        if tag != google_crc32c.value(value):
            why = "failed its checksum"
        elif digest not in self.verified and hashlib.sha256(value).digest() != digest:
            why = "does not hash to its digest"
        else:
            self.verified.add(digest)
            self.recency.hit(digest)
            self.files.seen(digest)
            return value
        log.warning("cache entry %s %s: dropping it", digest.hex(), why)
        self.corrupt_dropped += 1
        self.discard(digest)
        return None

    def __contains__(self, digest: bytes) -> bool:
        """Whether ``digest`` is stored (False while the store cannot answer). A value
        file known in memory that is on disk answers without a query of the index (a
        planner asks this of every item of a segment). May block on the disk."""
        if self.held_known(digest):
            return True
        return bool(self.index.query(lambda index: digest in index.reader))

    def held_known(self, digest: bytes) -> bool:
        """Whether ``digest`` is stored, as far as this process knows without asking the
        index or waiting for the disk (the caller may be mountd's trio loop): a value
        file known in memory (what a loader process or a put here stored) whose path
        the kernel resolves from its dentry cache (``open_cached``). False where that
        cannot tell at once."""
        if digest in self.writes.pending:
            return True
        known = self.files.locate(digest)
        if known is None:
            return False
        try:
            os.close(open_cached(known[0]))
        except OSError:
            return False
        self.files.seen(digest)
        return True

    def leading_known(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, are stored as far as this process
        knows at once (up to the first it cannot tell): found lately (SEEN_LATELY_S), or
        ``held_known``; for an event loop."""
        n = self.files.leading_seen(digests)
        while n < len(digests) and self.held_known(digests[n]):
            n += 1 + self.files.leading_seen(digests, n + 1)
        return n

    def leading_held(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, are stored (up to the first that is
        not). May block on the disk."""
        for n, digest in enumerate(digests):
            if digest not in self:
                return n
        return len(digests)

    def volume(self) -> int:
        """Bytes of the items held (what ``size_limit`` bounds; the index is on top); 0
        while the store cannot answer."""
        return self.index.query(lambda index: int(index.cache.volume()))

    def __len__(self) -> int:
        return self.index.query(lambda index: len(index.cache))

    # -- writes ---------------------------------------------------------------------
    def put(self, digest: bytes, data: bytes) -> bool:
        """Store ``data`` under ``digest`` after checking that it hashes to it; False if
        the store cannot write (the caller serves it uncached)."""
        if hashlib.sha256(data).digest() != digest:
            raise IntegrityError(f"content does not hash to {digest.hex()}")
        return self._put_checked(digest, data)

    def put_soon(self, digest: bytes, data: bytes) -> None:
        """Store ``data`` under ``digest`` after checking that it hashes to it, in the
        background (``BackgroundWrites``), waiting for it at most STUCK_AFTER, and not
        at all while the writer is stuck: the caller is a read, which does not wait for
        a hung writer. Served from memory until stored; not stored where too many puts
        wait."""
        if hashlib.sha256(data).digest() != digest:
            raise IntegrityError(f"content does not hash to {digest.hex()}")
        done = self.writes.put(digest, data, self._put_checked)
        if done is None:
            self.write_health.failures += 1  # served uncached
            log.debug("store %s: too many puts wait: %s not stored", self.directory,
                      digest.hex())
        elif not self.writes.stuck():
            done.wait(STUCK_AFTER)

    def _put_checked(self, digest: bytes, data: bytes) -> bool:
        """``put``, of content the caller has hashed to ``digest``."""
        tag = google_crc32c.value(data)
        index = self.index.for_writes()
        with self.index.write_lock:
            if index is None or index is not self.index.current:
                self.write_health.failures += 1
                return False
            index.disk.last_file = None
            try:
                with index.cache.noting_culls() as evicted:
                    index.cache.set(digest, data, tag=tag)
            except STORE_ERRORS as exc:
                if index.disk.last_file is not None:
                    index.disk.remove(index.disk.last_file)  # written in part, or unnamed
                self.write_health.failures += 1
                self.index.write_failed(index, exc, "write")
                return False
            self.write_health.recovered()
            if index.disk.last_file is None:  # kept in the index itself
                self.files.forget(digest)
            else:
                self.files.learn(digest, index.disk.last_file, tag)
            self.culled(evicted)  # after: it may be the put's own
        self.verified.add(digest)
        self.recency.stored(digest)
        return True

    def stored_elsewhere(self, digest: bytes, file: ValueFile | None) -> None:
        """Record a put a loader process made (it hashed the content in full), and its
        value ``file`` (None for an item kept in the index). Never blocks: a write
        failure it ends is cleared now, or by the next put."""
        if file is not None:
            self.files.learn(digest, file.name, file.tag)
        self.verified.add(digest)
        self.recency.stored(digest)
        lock = self.index.write_lock
        if self.write_health.error is not None and lock.acquire(blocking=False):
            try:
                if self.index.current is not None:
                    self.write_health.recovered()
            finally:
                lock.release()

    def culled(self, digests: Iterable[bytes]) -> None:
        """Entries a put evicted to make room (a loader process's, or one here): their
        files' places forgotten (``ValueFiles.holds`` then says they are gone), and
        the news put in ``evictions``. Where the news came late (another process stored
        one again since), its next read finds it through the index."""
        digests = list(digests)
        for digest in digests:
            self.files.forget(digest)
        self.evictions.extend(digests)

    def write_failed_elsewhere(self, reason: str, damaged: bool) -> None:
        """Record a put a loader process could not make, as if it were this store's own:
        a damaged index is rebuilt, anything else is tried again after
        WRITE_RETRY_INTERVAL. Never waits for the write lock (a hung writer may hold
        it): where another thread holds it, recorded in the background."""
        if not self._write_failed_elsewhere(reason, damaged, blocking=False):
            self.writes.submit(lambda: self._write_failed_elsewhere(reason, damaged))

    def _write_failed_elsewhere(self, reason: str, damaged: bool,
                                blocking: bool = True) -> bool:
        if not self.index.write_lock.acquire(blocking=blocking):
            return False
        try:
            self.write_health.failures += 1
            if damaged and self.index.current is not None:
                self.index.drop_damaged(self.index.current, reason)
            else:
                self.write_health.failed(reason, "write", by="a loader process ")
        finally:
            self.index.write_lock.release()
        return True

    def writable(self) -> bool:
        """Whether a put would write now: the index is open and no write failure waits
        for its retry (never blocks: the caller may be mountd's trio loop)."""
        return self.index.current is not None and not self.write_health.waiting()

    def health(self) -> StoreHealth:
        return self.write_health.report()

    def report(self, volume: int, items: int) -> dict[str, Any]:
        """The store in ``quiver status --json`` (``cache``), given its ``volume`` and
        ``items`` (which ask the index)."""
        health = self.health()
        return {"size_limit": self.size_limit, "used_bytes": volume, "items": items,
                "corrupt_dropped": self.corrupt_dropped, **dataclasses.asdict(self.scrub),
                "writable": health.writable, "write_error": health.write_error,
                "write_error_since": health.write_error_since,
                "write_failures": health.write_failures}

    def distrust(self, digest: bytes) -> None:
        """Forget what the read fast path knows of ``digest``'s entry (where its file is,
        that it was hashed in full): a read of it then asks the index and hashes it in
        full, until it is dropped."""
        self.files.forget(digest)
        self.verified.discard(digest)

    def discard(self, digest: bytes) -> None:
        """Drop ``digest``'s entry (left for LRU to evict while the store cannot write):
        from the index now, unless another thread writes it or a write hangs (the
        caller may be a read, which does not wait for a writer), then in the
        background. A read meanwhile that the index sends to its file finds it damaged
        again."""
        self.distrust(digest)
        if self.writes.stuck() or self.index.write(_delete, digest, "drop an entry",
                                                   blocking=False) is None:
            self.writes.submit(lambda: self.index.write(_delete, digest, "drop an entry"))

    def clear(self) -> None:
        """Drop every entry (nothing while the store cannot write)."""
        self.files.clear()
        self.verified.clear()
        self.index.write(lambda index, _: index.cache.clear(), None, "clear the store")

    def check(self) -> list:
        """diskcache's own consistency check; returns the warnings it found."""
        index = self.index.usable()
        if index is None:
            raise StoreError(f"the store is not open: {self.write_health.error}")
        return index.cache.check(fix=False)

    def close(self) -> None:
        """Make the writes still queued and record the last hits, for up to CLOSE_WAIT;
        a write that hangs (and the index it holds) is left to the process's exit."""
        self.writes.submit(self.recency.record, key="recency")
        self.writes.submit(self._close_connections)  # the writer thread's own
        if self.writes.close():
            self.index.close()

    def _close_connections(self) -> None:
        index = self.index.current
        if index is not None:
            index.close()


def _delete(index: Index, digest: bytes) -> int:
    return int(index.cache.delete(digest))

"""The local SSD store: content keyed by SHA-256 in a size-bounded diskcache.

Every value is checked against its hash before it is stored, and carries a
CRC32C tag (hardware accelerated) that is checked on every read, so a file
corrupted on disk is dropped and fetched again instead of served.

Eviction is least-recently-used. With diskcache's LRU policy every hit is a SQLite
write transaction, which caps hits at about a thousand a second; so hits go through a
second handle whose policy (in memory only) takes diskcache's lock-free read path, and
the hits' recency is written in one transaction per ``record_hits()`` call (mountd
calls it every second).
"""
from __future__ import annotations

import hashlib
import logging
import sqlite3
import threading

import diskcache
import google_crc32c

log = logging.getLogger(__name__)

# diskcache settings (units in the comments).
CULL_LIMIT = 8  # items evicted at once when an insert goes over the bound
DISK_MIN_FILE_SIZE = 32 << 10  # bytes: larger values are files, smaller ones sit in SQLite
SQLITE_MMAP_SIZE = 256 << 20  # bytes of the index mapped into memory
TIMEOUT = 60  # seconds a writer waits for SQLite's lock
MAX_KNOWN_FILES = 1_000_000  # entries whose file path is remembered (about 150 B each)


class IntegrityError(Exception):
    """Content whose SHA-256 is not the one it was asked for."""


class ContentStore:
    """Bytes by SHA-256, bounded by ``size_limit`` bytes, evicting least-recently-used."""

    def __init__(self, directory: str, size_limit: int) -> None:
        self.cache = diskcache.Cache(
            directory, size_limit=size_limit, eviction_policy="least-recently-used",
            cull_limit=CULL_LIMIT, disk_min_file_size=DISK_MIN_FILE_SIZE,
            sqlite_mmap_size=SQLITE_MMAP_SIZE, timeout=TIMEOUT, statistics=False)
        if self.cache.size_limit != size_limit:
            # diskcache keeps settings from an earlier run; the command line wins.
            self.cache.reset("size_limit", size_limit)
        self._reader = diskcache.Cache(directory, timeout=TIMEOUT)
        self._reader.reset("eviction_policy", "least-recently-stored", update=False)
        self.corrupt_dropped = 0
        # Writers take turns here: cheaper than colliding in SQLite, whose busy handler
        # sleeps for milliseconds.
        self._write_lock = threading.Lock()
        self._hits_lock = threading.Lock()
        self._hits: set[bytes] = set()
        # Where large values live, learnt on first read: later hits read the file
        # directly, without a query. A file evicted since is simply not found.
        self._files: dict[bytes, tuple[str, int]] = {}

    @property
    def size_limit(self) -> int:
        return int(self.cache.size_limit)

    def get(self, digest: bytes) -> bytes | None:
        """The content for ``digest``, or None if absent (or found corrupted and dropped)."""
        known = self._files.get(digest)
        if known is not None:
            path, tag = known
            try:
                with open(path, "rb", buffering=0) as f:
                    value = f.read()
            except FileNotFoundError:  # evicted since: ask the index
                self._files.pop(digest, None)
            else:
                return self._checked(digest, value, tag)
        try:
            handle, tag = self._reader.get(digest, default=None, read=True, tag=True,
                                           retry=True)
            if handle is None:
                return None
            if isinstance(handle, bytes):  # small values live in the index itself
                return self._checked(digest, handle, tag)
            with handle:
                value = handle.read()
        except (OSError, sqlite3.Error) as exc:
            log.warning("cache entry %s unreadable (%s): dropping it", digest.hex(), exc)
            self.discard(digest)
            return None
        if len(self._files) >= MAX_KNOWN_FILES:
            self._files.clear()
        self._files[digest] = (handle.name, tag)
        return self._checked(digest, value, tag)

    def _checked(self, digest: bytes, value: bytes, tag: int) -> bytes | None:
        if tag != google_crc32c.value(value):
            log.warning("cache entry %s failed its checksum: dropping it", digest.hex())
            self.corrupt_dropped += 1
            self.discard(digest)
            return None
        with self._hits_lock:
            self._hits.add(digest)
        return value

    def record_hits(self) -> int:
        """Write the recency of the hits since the last call, in one transaction."""
        with self._hits_lock:
            hits, self._hits = self._hits, set()
        if hits:
            with self._write_lock, self.cache.transact(retry=True):
                for digest in hits:
                    # an LRU get; read=True opens large values rather than reading them
                    handle = self.cache.get(digest, read=True, retry=True)
                    if hasattr(handle, "close"):
                        handle.close()
        return len(hits)

    def put(self, digest: bytes, data: bytes) -> None:
        """Store ``data`` under ``digest`` after checking that it hashes to it."""
        if hashlib.sha256(data).digest() != digest:
            raise IntegrityError(f"content does not hash to {digest.hex()}")
        tag = google_crc32c.value(data)
        with self._write_lock:
            self.cache.set(digest, data, tag=tag, retry=True)

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.cache

    def discard(self, digest: bytes) -> None:
        self._files.pop(digest, None)
        with self._write_lock:
            self.cache.delete(digest, retry=True)

    def clear(self) -> None:
        self._files.clear()
        with self._write_lock:
            self.cache.clear(retry=True)

    def volume(self) -> int:
        """Bytes used on disk (values plus the index)."""
        return int(self.cache.volume())

    def __len__(self) -> int:
        return len(self.cache)

    def check(self) -> list:
        """diskcache's own consistency check; returns the warnings it found."""
        return self.cache.check(fix=False)

    def close(self) -> None:
        self.record_hits()
        self._reader.close()
        self.cache.close()

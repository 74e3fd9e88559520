"""The store's scrubber: every entry hashed again, one pass after another, at a bounded
rate.

An entry is hashed in full when it enters the store. Its file is root's alone, in a
root-only directory, and never rewritten (a key names one content), so a read that
trusts it need not hash it again; a disk can still rot, or a file be changed by hand.
The scrubber walks the index in key order, from the value after the last one it
checked, and hashes each entry's bytes (a value file, or a value kept in the index)
with SHA-256: a file that does not hash to its key, that is shorter or longer than its
row says, that is missing or that the disk cannot read is corrupt. mountd then
withdraws it (``on_corrupt``: the kernel's pages of every inode naming it are
dropped), the entry is discarded, and the next read of it misses and fetches it again.

It is plain sync logic, driven by mountd (``Mountd._scrub``): ``step`` hashes at most
STEP_BYTES in a worker of mountd's limiter, so that a hit never waits long for a
worker; ``drop`` runs in a worker of its own; a ``ByteRate`` paces the steps to
``--scrub-mb-s``. A pass neither evicts hot pages nor leaves cold ones cached: a value
file is read without readahead (POSIX_FADV_RANDOM), and of each piece read, the pages
that were not in the page cache before (``cachestat``) are dropped after
(POSIX_FADV_DONTNEED); those that were stay. (A read with RWF_NOWAIT to find the cached
part starts readahead into the page cache: 2 MiB of a cold 3 MB file, measured.)

The index is read through a connection of its own, opened for each step and closed
before it returns: it never holds a damaged index open (which could then not be moved
aside), and follows a rebuilt one. Reading rows never updates an entry's recency.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import hashlib
import logging
import os
import sqlite3
import urllib.parse
from collections.abc import Callable
from typing import Any

from diskcache.core import DBNAME, MODE_RAW

from mountd.store.content_store import ContentStore
from mountd.store.errors import PROCESS_ERRNOS

log = logging.getLogger(__name__)

SCRUB_MB_S = 8.0  # the default rate: megabytes (10^6 bytes) hashed a second
STEP_BYTES = 1 << 20  # bytes hashed in one worker call, at most
STEP_ROWS = 64  # index rows read in one worker call, at most
# Bytes of the rate an entry costs besides its own: its row, its file's open, fstat,
# cachestat and close, and Python's work on each (about 0.1 ms: what SHA-256 hashes of
# 128 KiB here), so that a store of small items costs no more CPU a second than one of
# large (at 4 KiB, 8 MB/s walked 2,000 small entries a second: a fifth of mountd's CPU)
ENTRY_COST = 128 << 10
IDLE_WAIT = 1.0  # seconds between passes over an empty store, and after a failed step
# Seconds a step waits for SQLite's lock (a reader of a WAL index waits only while the
# WAL is reset): past it the step gives up, and the scrubber tries again after IDLE_WAIT.
INDEX_TIMEOUT = 1.0
DIGEST_LEN = 32  # a SHA-256: keys of any other length are none of the store's
_READ_FLAGS = os.O_RDONLY | os.O_NOATIME | os.O_CLOEXEC
PAGE = os.sysconf("SC_PAGE_SIZE")
_ROWS = ("SELECT key, filename, size, mode, value FROM Cache "
         "WHERE raw = 1 AND key > ? ORDER BY key LIMIT ?")
_FILENAME = "SELECT filename FROM Cache WHERE raw = 1 AND key = ?"

OnCorrupt = Callable[[bytes], None]


@dataclasses.dataclass(frozen=True)
class Corrupt:
    """An entry that failed its scrub: its digest, and why (for the log)."""

    digest: bytes
    why: str


@dataclasses.dataclass
class Step:
    """What one ``step`` did: the bytes it cost of the rate, the corrupt entries it
    found (for ``drop``), and whether it ended a pass that found nothing to hash."""

    cost: int = 0
    corrupt: list[Corrupt] = dataclasses.field(default_factory=list)
    idle: bool = False


@dataclasses.dataclass
class _Partial:
    """A value file hashed over several steps."""

    digest: bytes
    filename: str
    fd: int
    size: int
    done: int = 0
    hasher: Any = dataclasses.field(default_factory=hashlib.sha256)  # its SHA-256 so far


class ByteRate:
    """A token bucket over bytes: ``rate`` a second, of which at most ``burst`` may be
    spent ahead of time."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None

    def wait(self, spent: int, now: float) -> float:
        """Seconds to wait, from ``now``, once ``spent`` bytes were spent."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        self._tokens -= spent
        return 0.0 if self._tokens >= 0 else -self._tokens / self.rate


class Scrubber:
    """Hashes ``store``'s entries again, one pass after another; ``on_corrupt(digest)``
    withdraws an entry found corrupt before it is dropped. One step at a time."""

    def __init__(self, store: ContentStore, on_corrupt: OnCorrupt) -> None:
        self.store = store
        self.on_corrupt = on_corrupt
        self.counts = store.scrub
        db = urllib.parse.quote(os.path.abspath(os.path.join(store.directory, DBNAME)))
        self._db = f"file:{db}?mode=ro"  # a path with '?' or '%' quoted
        self._after = b""  # the last key checked in this pass
        self._pass_bytes = 0  # bytes hashed in this pass
        self._partial: _Partial | None = None

    def step(self, budget: int = STEP_BYTES) -> Step:
        """Hash the next entries, ``budget`` bytes at most (a worker thread's call)."""
        step = Step()
        if self.store.index.current is None:
            step.idle = True  # being rebuilt, or not open yet: reads open it, not this
            return step
        try:
            with contextlib.closing(sqlite3.connect(self._db, uri=True,
                                                    timeout=INDEX_TIMEOUT)) as con:
                self._walk(con, step, budget)
        except sqlite3.Error as exc:  # the store's own reads find and handle damage
            log.debug("store %s: the scrubber cannot read the index: %s",
                      self.store.directory, exc)
            step.idle = True
        return step

    def _walk(self, con: sqlite3.Connection, step: Step, budget: int) -> None:
        if self._partial is not None:
            self._hash_file(con, self._partial, step, budget)
        while step.cost < budget and self._partial is None:
            rows = con.execute(_ROWS, (self._after, STEP_ROWS)).fetchall()
            if not rows:
                self._end_pass(step)
                return
            for key, filename, size, mode, value in rows:
                self._after = key
                step.cost += ENTRY_COST
                if len(key) != DIGEST_LEN:
                    continue
                if filename is None:
                    if mode == MODE_RAW and isinstance(value, bytes):
                        self._hash_value(key, value, step)
                elif self._open(con, key, filename, size, step):
                    self._hash_file(con, self._partial, step, budget)
                if step.cost >= budget or self._partial is not None:
                    break

    def _end_pass(self, step: Step) -> None:
        self.counts.scrub_passes += 1
        step.idle = self._pass_bytes == 0
        self._after, self._pass_bytes = b"", 0

    def _hashed(self, n: int, step: Step) -> None:
        step.cost += n
        self._pass_bytes += n
        self.counts.scrubbed_bytes += n

    def _hash_value(self, digest: bytes, value: bytes, step: Step) -> None:
        """An entry kept in the index itself."""
        self._hashed(len(value), step)
        if hashlib.sha256(value).digest() != digest:
            step.corrupt.append(Corrupt(digest, "its value, kept in the index, does not "
                                        "hash to its digest"))
        else:
            self.store.verified.add(digest)

    def _open(self, con: sqlite3.Connection, digest: bytes, filename: str, size: int,
              step: Step) -> bool:
        """Start hashing ``digest``'s value file (``_partial``); False if it is not to be
        hashed: culled since, found corrupt already, or not readable now."""
        try:
            fd = os.open(os.path.join(self.store.directory, filename), _READ_FLAGS)
        except OSError as exc:
            self._failed(con, digest, filename, exc, step)
            return False
        try:
            actual = os.fstat(fd).st_size
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # this descriptor's reads only
        except OSError as exc:
            os.close(fd)
            self._failed(con, digest, filename, exc, step)
            return False
        if actual != size:
            os.close(fd)
            self._found(con, digest, filename, f"is {actual} bytes, not {size}", step)
            return False
        self._partial = _Partial(digest, filename, fd, size)
        return True

    def _hash_file(self, con: sqlite3.Connection, part: _Partial, step: Step,
                   budget: int) -> None:
        """Hash ``part`` on, within ``budget``; at its end, close it and judge it."""
        try:
            while part.done < part.size and step.cost < budget:
                n = min(part.size - part.done, max(budget - step.cost, 1 << 16))
                buf = bytearray(n)
                got = _read(part.fd, memoryview(buf), part.done)
                if got == 0:
                    self._close_partial()
                    self._found(con, part.digest, part.filename,
                                f"ends at {part.done} bytes, not {part.size}", step)
                    return
                part.hasher.update(memoryview(buf)[:got])
                part.done += got
                self._hashed(got, step)
        except OSError as exc:
            self._close_partial()
            self._failed(con, part.digest, part.filename, exc, step)
            return
        if part.done < part.size:
            return  # the next step goes on
        self._close_partial()
        if part.hasher.digest() != part.digest:
            self._found(con, part.digest, part.filename, "does not hash to its digest",
                        step)
        else:
            self.store.verified.add(part.digest)

    def _failed(self, con: sqlite3.Connection, digest: bytes, filename: str,
                exc: OSError, step: Step) -> None:
        """A value file could not be opened or read: corrupt, unless the process is
        short of something (tried again at the next pass)."""
        if exc.errno in PROCESS_ERRNOS:
            log.debug("store %s: the scrubber skipped %s: %s", self.store.directory,
                      digest.hex(), exc.strerror)
            return
        why = ("is missing" if isinstance(exc, FileNotFoundError)
               else f"cannot be read ({exc.strerror or exc})")
        self._found(con, digest, filename, why, step)

    def _found(self, con: sqlite3.Connection, digest: bytes, filename: str, why: str,
               step: Step) -> None:
        """``digest``'s value file ``filename`` is corrupt, if the index still names it
        (a file culled or stored again since is none of this pass's business)."""
        if con.execute(_FILENAME, (digest,)).fetchone() == (filename,):
            step.corrupt.append(Corrupt(digest, f"its file {filename} {why}"))

    def _close_partial(self) -> None:
        if self._partial is not None:
            os.close(self._partial.fd)
            self._partial = None

    def drop(self, bad: Corrupt) -> None:
        """Withdraw a corrupt entry (``on_corrupt``, first), discard it and count it.
        Runs in a worker that no read waits for: withdrawing it may wait in the kernel
        for a read of its inode."""
        # A read between the withdrawal and the drop hashes the entry in full, so no
        # bytes of it reach the kernel's pages again, even bytes forged with their CRC32C.
        self.store.distrust(bad.digest)
        self.on_corrupt(bad.digest)
        self.store.discard(bad.digest)
        self.counts.scrub_failures += 1
        log.warning("store %s: entry %s failed its scrub (%s): dropped it (its next read "
                    "fetches it again)", self.store.directory, bad.digest.hex(), bad.why)

    def close(self) -> None:
        """Close the file of a hash left halfway."""
        self._close_partial()


def _read(fd: int, buf: memoryview, offset: int) -> int:
    """Fill ``buf`` from ``offset`` (less at the file's end); the pages the read brought
    into the page cache are dropped after, those it found there are kept."""
    cold = _uncached(fd, offset, len(buf))
    got = os.preadv(fd, [buf], offset)
    for start, end in cold:  # whole pages: a page read in part is in the cache whole
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)
    return got


class _CacheStatRange(ctypes.Structure):
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class _CacheStat(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64) for name in (
        "nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


_libc = ctypes.CDLL(None, use_errno=True)
_SYS_CACHESTAT = ctypes.c_long(451)  # cachestat(2), Linux 6.5: one number on every architecture
_cachestat = True  # until the kernel lacks it


def _cached_pages(fd: int, offset: int, length: int) -> int | None:
    """How many pages of ``fd``'s bytes [offset, offset + length) the page cache holds,
    without reading any (cachestat); None where the kernel cannot tell."""
    global _cachestat
    if not _cachestat:
        return None
    at, stat = _CacheStatRange(offset, length), _CacheStat()
    if _libc.syscall(_SYS_CACHESTAT, ctypes.c_int(fd), ctypes.byref(at), ctypes.byref(stat),
                     ctypes.c_uint(0)) == 0:
        return stat.nr_cache
    if ctypes.get_errno() == errno.ENOSYS:
        log.debug("cachestat is not available: the scrubber drops every page it reads")
        _cachestat = False
    return None  # or a file system that cannot tell


def _uncached(fd: int, offset: int, length: int) -> list[tuple[int, int]]:
    """The (start, end) byte runs, whole pages, of [offset, offset + length) that the
    page cache does not hold (all of it where the kernel cannot tell)."""
    first, end = offset // PAGE * PAGE, -(-(offset + length) // PAGE) * PAGE
    cached = _cached_pages(fd, first, end - first)
    if cached is None or cached == 0:
        return [(first, end)]
    if cached >= (end - first) // PAGE:
        return []
    runs: list[tuple[int, int]] = []  # partly cached: page by page
    for page in range(first, end, PAGE):
        if _cached_pages(fd, page, PAGE):
            continue
        if runs and runs[-1][1] == page:
            runs[-1] = (runs[-1][0], page + PAGE)
        else:
            runs.append((page, page + PAGE))
    return runs

"""The local SSD store: content keyed by SHA-256 in a size-bounded diskcache.

Every value is checked against its hash before it is stored, and carries a
CRC32C tag (hardware accelerated) that is checked on every read; an entry is also
hashed in full the first time it is served after a start, so a file corrupted on
disk (even with a matching tag) is dropped and fetched again instead of served.

A hit costs no SQLite query: the store keeps in memory where each value file is and
its tag (``_ValueFiles``), read from the index once at open and kept by its own writes
and by the loader processes' replies. That is a hint, not the truth: a file another
process culled is not found, and the read asks the index. A hit whose pages are in
the page cache is served on mountd's loop (``get_nowait``) without a worker thread.

Eviction is least-recently-used. With diskcache's LRU policy every hit is a SQLite
write transaction, which caps hits at about a thousand a second; so hits go through a
second handle whose policy (in memory only) takes diskcache's lock-free read path, and
the hits' recency is written in one transaction per ``record_hits()`` call (mountd
calls it every second).

A bad disk costs reads, never the daemon. A store that cannot write (a full disk)
keeps serving what it holds, stores nothing, and tries writing again after
WRITE_RETRY_INTERVAL; one that cannot even open is skipped (every read a miss) until
it can. A damaged index (SQLite's "malformed" or "not a database") is moved aside and
the store starts empty; value files no index row names are removed at every open.

Loader processes (``mountd.fetch.loader_process``) write into the same directory through a
``StoreWriter``, which holds the index only under a shared lock on the directory; the
store opens (and rebuilds) the index only under the exclusive lock, so it never moves
aside or reclaims files under a writer of another process. mountd records what they
stored and could not store (``stored_elsewhere``, ``write_failed_elsewhere``).
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import fcntl
import gc
import hashlib
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NoReturn

import diskcache
import google_crc32c
from diskcache.core import DBNAME, MODE_BINARY, UNKNOWN

log = logging.getLogger(__name__)

# diskcache settings (units in the comments).
CULL_LIMIT = 8  # items evicted at once when an insert goes over the bound
# Bytes: larger values are files, smaller ones sit in SQLite. A file's hit is served on
# mountd's loop from the page cache (``get_nowait``); a row's takes a worker thread,
# a hand-off that costs a small item's read more than the read itself. So items of
# 4 KiB and more are files (diskcache's default is 32 KiB); a file costs a loader an
# open, a write and a close more, small beside a bucket fetch.
DISK_MIN_FILE_SIZE = 4 << 10
SQLITE_MMAP_SIZE = 256 << 20  # bytes of the index mapped into memory
TIMEOUT = 60  # seconds a writer waits for SQLite's lock
# Value files whose place is held in memory (``_ValueFiles``: about 155 B each, so at
# most 155 MB); a store of more is served the rest through its index.
MAX_KNOWN_FILES = 1_000_000
MAX_VERIFIED = 1_000_000  # digests remembered as hashed in full (about 100 B each)
# Seconds a read of an entry (or an open of its file) vouches that it is stored, to a
# planner's look-up (``leading_known``, which would otherwise open and close each file
# of a segment): an entry found at most 2 × this ago is taken as held. One culled since
# costs its read a miss, as one culled just after an open would. At most SEEN_LATELY_MAX
# are vouched for.
SEEN_LATELY_S = 1.0
SEEN_LATELY_MAX = 200_000
# Bytes: an item up to this size whose content was not yet hashed in full in this run
# is hashed on mountd's loop, which costs the loop less than handing it to a worker
# thread; a larger one is hashed in a worker.
VERIFY_ON_LOOP_MAX = 32 << 10
# Seconds between tries of a store that could not write or open (a full disk).
WRITE_RETRY_INTERVAL = 5.0
KEEP_DAMAGED = 2  # damaged indexes kept for a post-mortem (each as large as the index)
DAMAGED_SUFFIX = ".damaged-"  # cache.db.damaged-YYYYmmddTHHMMSS
VALUE_SUFFIX = ".val"  # diskcache's value files
# Errors of the process, not of an entry's file: the read fails, the entry stays.
PROCESS_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})
# SQLite's primary result codes that say the index itself is damaged.
DAMAGE_CODES = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
# What a store operation may raise when the disk or the index fails.
STORE_ERRORS = (OSError, sqlite3.Error, diskcache.Timeout)
_TAG_MASK = (1 << 32) - 1  # a CRC32C

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = ctypes.c_long(437)  # openat2(2): the same number on every architecture
_AT_FDCWD = ctypes.c_long(-100)
_RESOLVE_CACHED = 0x20  # Linux 5.12: EAGAIN where the path walk would wait for the disk
_READ_FLAGS = os.O_RDONLY | os.O_NOATIME | os.O_CLOEXEC


class IntegrityError(Exception):
    """Content whose SHA-256 is not the one it was asked for."""


class StoreError(Exception):
    """The store could not answer (a disk or index error): the read that asked fails."""


class IndexDamaged(StoreError):
    """SQLite found the index damaged ("malformed", "not a database", quick_check)."""


class StoreBusy(StoreError):
    """The other side of the directory lock holds it: mountd opening or rebuilding the
    index, or a loader process writing while mountd wants to."""


@dataclasses.dataclass(frozen=True)
class ValueFile:
    """Where a put left an item kept in a file: its name, relative to the store, and
    its CRC32C tag (what a loader process tells mountd's store)."""

    name: str
    tag: int


@dataclasses.dataclass
class StoreHealth:
    """Whether the store can write, and since when it cannot (for status and metrics)."""

    writable: bool
    write_error: str | None  # why the last write failed
    write_error_since: float | None  # Unix time of the first failure in a row
    write_failures: int  # items not stored because the store could not write


class _TrackedDisk(diskcache.Disk):
    """diskcache's Disk, remembering the value file it last named: a put that fails
    while or after writing it must remove it (diskcache leaves it behind). A value kept
    in SQLite (under DISK_MIN_FILE_SIZE) is given its length as its size, where
    diskcache says 0, so that the store's bound counts it (``_ContentBoundCache``).
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
            # JPEG of 100 KB becomes hundreds of write calls. Its own writer, given the value
            # as one piece, writes it in one:
            name, full_path = self.filename(key, value)
            self._write(full_path, (value,), "xb")
            return len(value), MODE_BINARY, name, None
        size, mode, filename, db_value = super().store(value, read, key=key)
        if filename is None and isinstance(db_value, (bytes, memoryview)):
            size = len(db_value)
        return size, mode, filename, db_value


class _ContentBoundCache(diskcache.Cache):
    """diskcache's Cache, bounded by the bytes of the items it holds, as ``cache-size``
    says (rclone's and gcsfuse's cache sizes count their files' bytes too). diskcache's
    own volume counts the SQLite file's pages, where an item under DISK_MIN_FILE_SIZE
    takes whole pages, so a store sized to a dataset of small items would not hold it,
    and every pass over it would miss and cull anew. The index is on top of the bound
    (docs/operations.md)."""

    def volume(self) -> int:
        return int(self.reset("size"))


@dataclasses.dataclass
class _Index:
    """The two diskcache handles on one index: writes (LRU) and lock-free reads."""

    cache: diskcache.Cache
    reader: diskcache.Cache

    @property
    def disk(self) -> _TrackedDisk:
        return self.cache.disk

    def close(self) -> None:
        """Close this thread's connections (each thread has its own)."""
        self.reader.close()
        self.cache.close()


class _ValueFiles:
    """Where the store's value files are: digest -> the file's name (its 128 random
    bits) and CRC32C tag, packed in one int. A hint that may be stale (another process
    culls and stores): a read that finds no file asks the index, and the tag and hash
    are checked as ever. Lock-free: each step is one dict operation, atomic under the
    GIL, and a race at worst leaves a hint stale or forgets one.

    Two generations bound it to MAX_KNOWN_FILES: when the newer is full it becomes the
    older, and the older is forgotten; an entry of the older that is read moves to the
    newer.

    It also knows which entries were found in the store lately (``seen``,
    ``seen_lately``), in two generations of SEEN_LATELY_S seconds each."""

    def __init__(self, directory: str) -> None:
        self._prefix = os.fsencode(directory) + b"/"
        self._new: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}
        self._seen_new: set[bytes] = set()
        self._seen_old: set[bytes] = set()
        self._seen_since = self._seen_old_since = time.monotonic()  # when each began

    def locate(self, digest: bytes) -> tuple[bytes, int] | None:
        """The value file's path and tag for ``digest``, if known."""
        entry = self._new.get(digest)
        if entry is None:
            entry = self._old.get(digest)
            if entry is None:
                return None
            self._add(digest, entry)
        name = b"%032x" % (entry >> 32)
        return (b"%s%s/%s/%s.val" % (self._prefix, name[:2], name[2:4], name[4:]),
                entry & _TAG_MASK)

    def learn(self, digest: bytes, name: str, tag: object) -> None:
        """Remember that ``digest``'s value is the file ``name`` (relative to the store)
        tagged ``tag``; a name or tag not of diskcache's making is forgotten instead."""
        bits = _random_bits(name)
        if bits is None or not isinstance(tag, int) or not 0 <= tag <= _TAG_MASK:
            self.forget(digest)
            return
        self._add(digest, bits << 32 | tag)

    def _add(self, digest: bytes, entry: int) -> None:
        if len(self._new) >= MAX_KNOWN_FILES // 2:
            self._old, self._new = self._new, {}
        self._new[digest] = entry

    def seen(self, digest: bytes) -> None:
        """``digest``'s entry was just found in the store (read, or its file opened)."""
        now = time.monotonic()
        if (now - self._seen_since >= SEEN_LATELY_S
                or len(self._seen_new) >= SEEN_LATELY_MAX // 2):
            self._seen_old, self._seen_old_since = self._seen_new, self._seen_since
            self._seen_new, self._seen_since = set(), now
        self._seen_new.add(digest)

    def seen_lately(self, digest: bytes) -> bool:
        """Whether ``digest``'s entry was found at most 2 × SEEN_LATELY_S seconds ago (and
        not forgotten since): a generation vouches while it began less than that ago."""
        now = time.monotonic()
        return ((now - self._seen_since < 2 * SEEN_LATELY_S and digest in self._seen_new)
                or (now - self._seen_old_since < 2 * SEEN_LATELY_S
                    and digest in self._seen_old))

    def forget(self, digest: bytes) -> None:
        self._new.pop(digest, None)
        self._old.pop(digest, None)
        self._seen_new.discard(digest)
        self._seen_old.discard(digest)

    def clear(self) -> None:
        self._new, self._old = {}, {}
        self._seen_new, self._seen_old = set(), set()


def _random_bits(name: str) -> int | None:
    """The 128 random bits that name a value file (diskcache's ``ab/cd/<28 hex
    digits>.val``); None for any other name. Done by hand, not by a regular expression:
    opening a store does it for every value file."""
    if len(name) != 38 or name[2] != "/" or name[5] != "/" or not name.endswith(VALUE_SUFFIX):
        return None
    digits = name[:2] + name[3:5] + name[6:34]
    try:
        bits = int(digits, 16)
    except ValueError:
        return None
    return bits if "%032x" % bits == digits else None  # not "+", "_", spaces, capitals


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


_CACHED_READ = _OpenHow(_READ_FLAGS, 0, _RESOLVE_CACHED)
_HOW_SIZE = ctypes.c_size_t(ctypes.sizeof(_CACHED_READ))
_resolve_cached = True  # until the kernel lacks openat2 (before 5.6) or RESOLVE_CACHED


def _open_cached(path: bytes) -> int:
    """A read-only descriptor of ``path``, found without waiting for the disk: openat2
    with RESOLVE_CACHED fails (EAGAIN) unless every component is in the kernel's dentry
    cache. Where the kernel lacks it, a plain open (the dentry of a file whose pages
    are cached is almost always cached too)."""
    global _resolve_cached
    if _resolve_cached:
        fd = _libc.syscall(_SYS_OPENAT2, _AT_FDCWD, ctypes.c_char_p(path),
                           ctypes.byref(_CACHED_READ), _HOW_SIZE)
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err not in (errno.ENOSYS, errno.EINVAL):
            raise OSError(err, os.strerror(err))
        log.debug("openat2's RESOLVE_CACHED is not available (%s): hits open their "
                  "files plainly", os.strerror(err))
        _resolve_cached = False
    return os.open(path, _READ_FLAGS)


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
def _damage_raised() -> Iterator[None]:
    """Raise SQLite's damage errors as IndexDamaged."""
    try:
        yield
    except sqlite3.DatabaseError as exc:
        if is_damage(exc):
            raise IndexDamaged(describe(exc)) from exc
        raise


class ContentStore:
    """Bytes by SHA-256, bounded by ``size_limit`` bytes, evicting least-recently-used."""

    def __init__(self, directory: str, size_limit: int) -> None:
        self.directory = directory
        self._size_limit = size_limit
        self.corrupt_dropped = 0
        self.write_failures = 0
        self.write_error: str | None = None
        self.write_error_since: float | None = None
        self._retry_at = 0.0  # time.monotonic() of the next try after a failure
        # Writers take turns here: cheaper than colliding in SQLite, whose busy handler
        # sleeps for milliseconds. Opening and rebuilding the index hold it too.
        self._write_lock = threading.Lock()
        self._hits_lock = threading.Lock()
        self._hits: set[bytes] = set()
        self._spent: set[bytes] = set()  # marked spent since the last record_hits
        # Entries marked spent and not stored again since: their reads after the mark
        # leave them the first to evict.
        self._spent_marked: set[bytes] = set()
        self._unspent: set[bytes] = set()  # marked entries wanted since the last record_hits
        # Where values kept in files live: hits read the file without a query.
        self._files = _ValueFiles(directory)
        # Digests whose content was hashed in full in this run (put, or served once).
        self._verified: set[bytes] = set()
        self._damage: str | None = None  # why the index must be moved aside
        self._damaged_id: tuple[int, int] | None = None  # (st_dev, st_ino) of it
        self._aside: str | None = None  # where the last damaged index went
        self._index: _Index | None = None
        with self._write_lock:
            self._open()

    # -- opening, damage, rebuilding ------------------------------------------------
    @property
    def _db_path(self) -> str:
        return os.path.join(self.directory, DBNAME)

    def _connect(self) -> tuple[_Index, set[str], _ValueFiles]:
        """Open the index, check it page by page, and list the value files it names,
        and where each item's is (the most recently used, if more than MAX_KNOWN_FILES).
        Raises IndexDamaged if SQLite finds it damaged."""
        cache = _open_cache(self.directory, self._size_limit)
        try:
            with _damage_raised():
                reader = diskcache.Cache(self.directory, timeout=TIMEOUT)
        except BaseException:
            cache.close()
            raise
        reader.reset("eviction_policy", "least-recently-stored", update=False)
        index = _Index(cache, reader)
        try:
            with _damage_raised(), contextlib.closing(
                    sqlite3.connect(self._db_path, timeout=TIMEOUT)) as con:
                problems = [row[0] for row in con.execute("PRAGMA quick_check")]
                if problems != ["ok"]:
                    raise IndexDamaged(f"quick_check: {'; '.join(problems[:3])}")
                named, files = set(), _ValueFiles(self.directory)
                for key, raw, name, tag in con.execute(
                        "SELECT key, raw, filename, tag FROM Cache "
                        "WHERE filename IS NOT NULL ORDER BY access_time"):
                    named.add(name)
                    if raw:  # keys are bytes, stored raw: another key is none of ours
                        files.learn(key, name, tag)
                with con:  # items kept in SQLite by a version that counted them as 0
                    con.execute("UPDATE Cache SET size = length(value) "
                                "WHERE filename IS NULL AND size = 0 AND value IS NOT NULL")
        except BaseException:
            index.close()
            raise
        return index, named, files

    def _open(self) -> None:
        """Open the index (moving a damaged one aside first), and remove the value files
        it does not name before anything is served. The caller holds the write lock."""
        try:
            with _directory_lock(self.directory, fcntl.LOCK_EX):
                opened = self._open_index()
        except StoreBusy:
            log.debug("store %s: a loader process holds the index: opening it later",
                      self.directory)
            if self.write_error is None:
                self._note_error("a loader process holds the store's index")
            opened = None
        except (*STORE_ERRORS, IndexDamaged) as exc:
            self._write_failed(None, exc, "open the store")
            opened = None
        if opened is None:
            # A diskcache.Cache that failed halfway keeps its connection in a reference
            # cycle: free it now rather than hold its descriptors until a collection.
            gc.collect()
            return
        self._index, self._files, reclaimed = opened
        if self._damage is not None:
            log.warning("store %s: the index was damaged (%s): moved it to %s and started "
                        "with an empty store (%d value files removed)", self.directory,
                        self._damage, self._aside, reclaimed)
            self._damage = None
        elif reclaimed:
            log.warning("store %s: removed %d value files the index does not name (an "
                        "index lost or truncated, or writes cut short)", self.directory,
                        reclaimed)
        if self.write_error is not None:
            self._writable_again()

    def _open_index(self) -> tuple[_Index, _ValueFiles, int] | None:
        """The open index, where its value files are, and how many value files were
        removed; None while a damaged index cannot be moved aside yet."""
        opened = None
        if self._damage is None:
            try:
                opened = self._connect()
            except IndexDamaged as exc:
                self._damage, self._damaged_id = str(exc), _file_id(self._db_path)
        if opened is None:  # out of the except block, whose traceback holds the index
            if not self._move_aside():
                self._note_error("the index is damaged: rebuilding the store")
                return None
            opened = self._connect()
        index, named, files = opened
        _make_private(self.directory)
        return index, files, self._reclaim(index, named)

    def _move_aside(self) -> bool:
        """Rename the damaged index (and its WAL) to DBNAME.damaged-STAMP, keeping the
        newest KEEP_DAMAGED. False while a connection of this process still has it
        open: closing it later would delete the new index's WAL, which it knows by path."""
        gc.collect()  # connections of dropped handles wait in reference cycles
        if self._damaged_id is not None and _open_in_process(self._damaged_id):
            log.debug("store %s: the damaged index is still open", self.directory)
            return False
        aside = f"{self._db_path}{DAMAGED_SUFFIX}{time.strftime('%Y%m%dT%H%M%S')}"
        self._aside = aside
        with contextlib.suppress(FileNotFoundError):
            os.replace(self._db_path, aside)
        with contextlib.suppress(FileNotFoundError):
            os.replace(self._db_path + "-wal", aside + "-wal")
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._db_path + "-shm")  # an index into the WAL, made again on open
        self._damaged_id = None
        kept = sorted(n for n in os.listdir(self.directory)
                      if n.startswith(DBNAME + DAMAGED_SUFFIX) and not n.endswith("-wal"))
        for name in kept[:-KEEP_DAMAGED]:
            for path in (name, name + "-wal"):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(self.directory, path))
        return True

    def _reclaim(self, index: _Index, named: set[str]) -> int:
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

    def _drop_damaged(self, index: _Index, reason: str) -> None:
        """Stop using a damaged index; the next use of the store rebuilds it (``_open``).
        The caller holds the write lock."""
        if self._index is not index:
            return  # another thread got there first
        log.warning("store %s: the index is damaged (%s): rebuilding the store",
                    self.directory, reason)
        self._index = None
        self._damage, self._damaged_id = reason, _file_id(self._db_path)
        index.close()
        self._files.clear()
        self._verified.clear()
        self._retry_at = 0.0
        self._note_error("the index is damaged: rebuilding the store")

    def _start_rebuild(self, index: _Index, exc: BaseException) -> None:
        with self._write_lock:
            self._drop_damaged(index, describe(exc))
        del index  # other threads' connections to it close once it is collected
        self._usable()

    def _usable(self) -> _Index | None:
        """The open index; or, once the retry interval has passed, another try at
        opening it; None while the store cannot be used."""
        index = self._index
        if index is not None or time.monotonic() < self._retry_at:
            return index
        with self._write_lock:
            if self._index is None and time.monotonic() >= self._retry_at:
                self._retry_at = time.monotonic() + WRITE_RETRY_INTERVAL
                self._open()
            return self._index

    # -- health ---------------------------------------------------------------------
    def _write_failed(self, index: _Index | None, exc: BaseException, doing: str) -> None:
        """Note a failed write: a damaged index is rebuilt, anything else is tried again
        after WRITE_RETRY_INTERVAL. The caller holds the write lock."""
        if index is not None:
            index.cache.close()  # with a transaction a failed COMMIT may have left open
            if is_damage(exc):
                self._drop_damaged(index, describe(exc))
                return
        reason = describe(exc)
        self._retry_at = time.monotonic() + WRITE_RETRY_INTERVAL
        if self.write_error is None:
            log.warning("store %s: cannot %s (%s): reads are served uncached; trying "
                        "again every %.0f s", self.directory, doing, reason,
                        WRITE_RETRY_INTERVAL)
        self._note_error(reason if doing == "write" else f"cannot {doing}: {reason}")

    def _note_error(self, message: str) -> None:
        if self.write_error is None:
            self.write_error_since = time.time()
        self.write_error = message

    def _writable_again(self) -> None:
        log.info("store %s can write again (after %.0f s; %d items not stored so far)",
                 self.directory, time.time() - (self.write_error_since or time.time()),
                 self.write_failures)
        self.write_error = self.write_error_since = None

    def writable(self) -> bool:
        """Whether a put would write now: the index is open and no write failure waits
        for its retry (never blocks: the caller may be mountd's trio loop)."""
        return self._index is not None and (self.write_error is None
                                            or time.monotonic() >= self._retry_at)

    def stored_elsewhere(self, digest: bytes, file: ValueFile | None) -> None:
        """Record a put a loader process made (it hashed the content in full), and its
        value ``file`` (None for an item kept in the index). Never blocks: a write
        failure it ends is cleared now, or by the next put."""
        if file is not None:
            self._files.learn(digest, file.name, file.tag)
        self._mark_verified(digest)
        self._stored(digest)
        if self.write_error is not None and self._write_lock.acquire(blocking=False):
            try:
                if self.write_error is not None and self._index is not None:
                    self._writable_again()
            finally:
                self._write_lock.release()

    def write_failed_elsewhere(self, reason: str, damaged: bool) -> None:
        """Record a put a loader process could not make, as if it were this store's own:
        a damaged index is rebuilt, anything else is tried again after
        WRITE_RETRY_INTERVAL."""
        with self._write_lock:
            self.write_failures += 1
            if damaged and self._index is not None:
                self._drop_damaged(self._index, reason)
                return
            self._retry_at = time.monotonic() + WRITE_RETRY_INTERVAL
            if self.write_error is None:
                log.warning("store %s: a loader process cannot write (%s): reads are served "
                            "uncached; trying again every %.0f s", self.directory, reason,
                            WRITE_RETRY_INTERVAL)
            self._note_error(reason)

    def health(self) -> StoreHealth:
        """Whether the last write worked (only a put that works clears a failure)."""
        return StoreHealth(self.write_error is None, self.write_error,
                           self.write_error_since, self.write_failures)

    @property
    def size_limit(self) -> int:
        return self._size_limit

    # -- reads ----------------------------------------------------------------------
    def get(self, digest: bytes) -> bytes | None:
        """The content for ``digest``, or None if absent (or found corrupted and dropped,
        or while the store cannot be opened). Raises StoreError if the store fails."""
        known = self._files.locate(digest)
        if known is not None:
            path, tag = known
            try:
                with open(path, "rb", buffering=0) as f:
                    value = f.read()
            except FileNotFoundError:  # evicted since: ask the index
                self._files.forget(digest)
            except OSError as exc:
                self._read_failed(self._index, digest, exc)
            else:
                return self._checked(digest, value, tag)
        index = self._usable()
        if index is None:
            return None
        try:
            handle, tag = index.reader.get(digest, default=None, read=True, tag=True)
            if handle is None:
                return None
            if isinstance(handle, bytes):  # small values live in the index itself
                return self._checked(digest, handle, tag)
            with handle:
                value = handle.read()
        except STORE_ERRORS as exc:
            self._read_failed(index, digest, exc)
        self._files.learn(digest, os.path.relpath(handle.name, self.directory), tag)
        return self._checked(digest, value, tag)

    def get_nowait(self, digest: bytes, size: int) -> bytes | None:
        """The content for ``digest`` if it can be had without waiting: an entry whose
        value file is known, whose ``size`` bytes are all in the page cache and match
        its CRC32C, and whose content was hashed in full in this run or is hashed now
        (up to VERIFY_ON_LOOP_MAX). None otherwise; ``get`` (in a worker thread) then
        decides, and drops what is corrupt.

        The caller is an event loop, so this never waits for the disk or the index: the
        path is resolved only from the dentry cache (``_open_cached``) and the pages
        come with RWF_NOWAIT. Nothing here writes."""
        known = self._files.locate(digest)
        if known is None:
            return None
        verified = digest in self._verified
        if not verified and size > VERIFY_ON_LOOP_MAX:
            return None
        path, tag = known
        try:
            fd = _open_cached(path)
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
        if not verified:
            if hashlib.sha256(data).digest() != digest:
                return None
            self._mark_verified(digest)
        with self._hits_lock:
            self._hits.add(digest)
        self._files.seen(digest)
        return data

    def _read_failed(self, index: _Index | None, digest: bytes,
                     exc: BaseException) -> NoReturn:
        """Raise StoreError for a failed read; first rebuild a damaged index, or drop an
        entry whose file failed (its next read fetches it again)."""
        if index is not None and is_damage(exc):
            self._start_rebuild(index, exc)
        elif isinstance(exc, OSError) and exc.errno not in PROCESS_ERRNOS:
            self.discard(digest)
        raise StoreError(describe(exc)) from exc

    def _checked(self, digest: bytes, value: bytes, tag: int) -> bytes | None:
        if tag != google_crc32c.value(value):
            why = "failed its checksum"
        elif digest not in self._verified and hashlib.sha256(value).digest() != digest:
            why = "does not hash to its digest"
        else:
            self._mark_verified(digest)
            with self._hits_lock:
                self._hits.add(digest)
            self._files.seen(digest)
            return value
        log.warning("cache entry %s %s: dropping it", digest.hex(), why)
        self.corrupt_dropped += 1
        self.discard(digest)
        return None

    def _mark_verified(self, digest: bytes) -> None:
        if len(self._verified) >= MAX_VERIFIED:
            self._verified.clear()  # costs a hash per entry again, never a wrong byte
        self._verified.add(digest)

    def __contains__(self, digest: bytes) -> bool:
        """Whether ``digest`` is stored (False while the store cannot answer). A value
        file known in memory that is on disk answers without a query of the index (a
        planner asks this of every item of a segment). May block on the disk."""
        if self.held_known(digest):
            return True
        return bool(self._query(lambda index: digest in index.reader))

    def held_known(self, digest: bytes) -> bool:
        """Whether ``digest`` is stored, as far as this process knows without asking the
        index or waiting for the disk (the caller may be mountd's trio loop): a value
        file known in memory (what a loader process or a put here stored) whose path
        the kernel resolves from its dentry cache (``_open_cached``). False where that
        cannot tell at once."""
        known = self._files.locate(digest)
        if known is None:
            return False
        try:
            os.close(_open_cached(known[0]))
        except OSError:
            return False
        self._files.seen(digest)
        return True

    def leading_known(self, digests: Sequence[bytes]) -> int:
        """How many of ``digests``, from the first, are stored as far as this process
        knows at once (up to the first it cannot tell): found lately (SEEN_LATELY_S), or
        ``held_known``; for an event loop."""
        for n, digest in enumerate(digests):
            if not (self._files.seen_lately(digest) or self.held_known(digest)):
                return n
        return len(digests)

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
        return self._query(lambda index: int(index.cache.volume()))

    def __len__(self) -> int:
        return self._query(lambda index: len(index.cache))

    def _query(self, ask: Callable[[_Index], int]) -> int:
        index = self._usable()
        if index is None:
            return 0
        try:
            return ask(index)
        except STORE_ERRORS as exc:
            if is_damage(exc):
                self._start_rebuild(index, exc)
            log.debug("store %s: a query failed: %s", self.directory, describe(exc))
            return 0

    # -- writes ---------------------------------------------------------------------
    def _writable(self) -> _Index | None:
        """The index, unless the store waits to try writing again after a failure."""
        index = self._usable()
        if index is None or (self.write_error is not None
                             and time.monotonic() < self._retry_at):
            return None
        return index

    def put(self, digest: bytes, data: bytes) -> bool:
        """Store ``data`` under ``digest`` after checking that it hashes to it; False if
        the store cannot write (the caller serves it uncached)."""
        if hashlib.sha256(data).digest() != digest:
            raise IntegrityError(f"content does not hash to {digest.hex()}")
        tag = google_crc32c.value(data)
        index = self._writable()
        with self._write_lock:
            if index is None or index is not self._index:
                self.write_failures += 1
                return False
            index.disk.last_file = None
            try:
                index.cache.set(digest, data, tag=tag)
            except STORE_ERRORS as exc:
                if index.disk.last_file is not None:
                    index.disk.remove(index.disk.last_file)  # written in part, or unnamed
                self.write_failures += 1
                self._write_failed(index, exc, "write")
                return False
            if self.write_error is not None:
                self._writable_again()
            if index.disk.last_file is None:  # kept in the index itself
                self._files.forget(digest)
            else:
                self._files.learn(digest, index.disk.last_file, tag)
        self._mark_verified(digest)
        self._stored(digest)
        return True

    def record_hits(self) -> int:
        """Write the recency of the hits since the last call, and make the entries
        marked ``spent`` the first to evict, in one transaction; how many hits (none
        while the store cannot write: those are forgotten)."""
        with self._hits_lock:
            hits, self._hits = self._hits | self._unspent, set()
            spent, self._spent, self._unspent = self._spent, set(), set()
            if len(self._spent_marked) + len(spent) > MAX_VERIFIED:
                self._spent_marked.clear()  # marks forgotten: left to plain LRU
            self._spent_marked |= spent
            spent |= hits & self._spent_marked
        if not hits and not spent:
            return 0
        return self._write(self._touch, (hits - spent, spent), "record hits")

    def spent(self, digests: Iterable[bytes]) -> None:
        """Mark entries no reader here is known to need again as the least recently
        used (from the next ``record_hits``, until ``wanted``): the store evicts them
        first."""
        with self._hits_lock:
            self._spent.update(digests)

    def marks_pending(self) -> bool:
        """Whether entries were marked spent, or wanted again after their mark was
        written, since the last ``record_hits``."""
        return bool(self._spent or self._unspent)

    def _stored(self, digest: bytes) -> None:
        """A put of a spent entry (a fetch begun before the mark) leaves it spent."""
        with self._hits_lock:
            if digest in self._spent_marked:
                self._spent.add(digest)

    def wanted(self, digests: Iterable[bytes]) -> None:
        """Undo ``spent`` marks: a reader here needs these entries again. Those whose
        mark was written get the current access time at the next ``record_hits``, as a
        hit would (else the store would still evict them first)."""
        with self._hits_lock:
            for digest in digests:
                self._spent.discard(digest)
                if digest in self._spent_marked:
                    self._spent_marked.discard(digest)
                    self._unspent.add(digest)

    @staticmethod
    def _touch(index: _Index, marks: tuple[set[bytes], set[bytes]]) -> int:
        # What diskcache's LRU get writes (``access_time``), without its read of each
        # value: one statement for all the hits. Keys are bytes, so stored raw. Spent
        # entries get the oldest access time there is.
        hits, spent = marks
        now = time.time()
        with index.cache.transact():
            index.cache._con.executemany(
                "UPDATE Cache SET access_time = ? WHERE key = ? AND raw = 1",
                [(now, digest) for digest in hits] + [(0.0, digest) for digest in spent])
        return len(hits)

    def discard(self, digest: bytes) -> None:
        """Drop ``digest``'s entry (left for LRU to evict while the store cannot write)."""
        self._files.forget(digest)
        self._verified.discard(digest)
        self._write(lambda index, key: int(index.cache.delete(key)), digest, "drop an entry")

    def clear(self) -> None:
        """Drop every entry (nothing while the store cannot write)."""
        self._files.clear()
        self._verified.clear()
        self._write(lambda index, _: index.cache.clear(), None, "clear the store")

    def _write(self, do: Callable[[_Index, Any], int], arg: Any, doing: str) -> int:
        """``do(index, arg)`` under the write lock; 0 if the store cannot write."""
        index = self._writable()
        with self._write_lock:
            if index is None or index is not self._index:
                return 0
            try:
                return do(index, arg)
            except STORE_ERRORS as exc:
                self._write_failed(index, exc, doing)
                return 0

    def check(self) -> list:
        """diskcache's own consistency check; returns the warnings it found."""
        index = self._usable()
        if index is None:
            raise StoreError(f"the store is not open: {self.write_error}")
        return index.cache.check(fix=False)

    def close(self) -> None:
        self.record_hits()
        with self._write_lock:
            index, self._index = self._index, None
            self._retry_at = float("inf")  # closed for good
        if index is not None:
            index.close()


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
        self._cache: diskcache.Cache | None = None

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
        disk: _TrackedDisk = cache.disk
        files: list[ValueFile | None] = []
        disk.last_file = None
        try:
            with _damage_raised(), cache.transact():
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

    def _acquire(self) -> diskcache.Cache:
        if self._cache is not None:
            return self._cache
        lock = contextlib.ExitStack()
        try:
            lock.enter_context(_directory_lock(self.directory, fcntl.LOCK_SH))
            self._cache = _open_cache(self.directory, self.size_limit)
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


def _open_cache(directory: str, size_limit: int) -> diskcache.Cache:
    """The index's writing handle, with the store's settings (IndexDamaged if SQLite
    finds it damaged)."""
    with _damage_raised():
        return _ContentBoundCache(  # diskcache culls once at its limit: bound inclusive
            directory, disk=_TrackedDisk, size_limit=size_limit + 1,
            eviction_policy="least-recently-used", cull_limit=CULL_LIMIT,
            disk_min_file_size=DISK_MIN_FILE_SIZE, sqlite_mmap_size=SQLITE_MMAP_SIZE,
            timeout=TIMEOUT, statistics=False)


@contextlib.contextmanager
def _directory_lock(directory: str, mode: int) -> Iterator[None]:
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


def _make_private(directory: str) -> None:
    """Leave the store readable by root only: its index holds every user's keys and
    small items. mountd's umask makes what it writes private; a store an older version
    wrote (its index readable by others) has its folders and files made so too."""
    os.chmod(directory, 0o700)
    db = os.path.join(directory, DBNAME)
    if not os.stat(db).st_mode & 0o077:
        return
    log.info("store %s: making its files readable by root only", directory)
    for dirpath, _, files in os.walk(directory):
        os.chmod(dirpath, 0o700)
        for name in files:
            os.chmod(os.path.join(dirpath, name), 0o600)


def _file_id(path: str) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except FileNotFoundError:
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

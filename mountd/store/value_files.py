"""What the store's read fast path knows without asking the index: where each value
file is and its CRC32C tag, which entries were found lately, which were hashed in full
in this run; and how a file is opened without waiting for the disk.

These are hints, not the truth: a file another process culled is not found, and the
read asks the index; the tag and hash are checked as ever."""
from __future__ import annotations

import ctypes
import dataclasses
import errno
import logging
import os
import time
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)

# Value files whose place is held in memory (``ValueFiles``: about 155 B each, so at
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
VALUE_SUFFIX = ".val"  # diskcache's value files
_TAG_MASK = (1 << 32) - 1  # a CRC32C

_libc = ctypes.CDLL(None, use_errno=True)
_SYS_OPENAT2 = ctypes.c_long(437)  # openat2(2): the same number on every architecture
_AT_FDCWD = ctypes.c_long(-100)
_RESOLVE_CACHED = 0x20  # Linux 5.12: EAGAIN where the path walk would wait for the disk
_READ_FLAGS = os.O_RDONLY | os.O_NOATIME | os.O_CLOEXEC


@dataclasses.dataclass(frozen=True)
class ValueFile:
    """Where a put left an item kept in a file: its name, relative to the store, and
    its CRC32C tag (what a loader process tells mountd's store)."""

    name: str
    tag: int


class ValueFiles:
    """Where the store's value files are: digest -> the file's name (its 128 random
    bits) and CRC32C tag, packed in one int. A hint that may be stale (another process
    culls and stores): a read that finds no file asks the index, and the tag and hash
    are checked as ever. Lock-free: each step is one dict operation, atomic under the
    GIL, and a race at worst leaves a hint stale or forgets one.

    Two generations bound it to MAX_KNOWN_FILES: when the newer is full it becomes the
    older, and the older is forgotten; an entry of the older that is read moves to the
    newer.

    It is ``complete`` while it has never let go of an entry it was told of but for an
    eviction or a drop: puts here and in loader processes tell it what they store and
    what they evict (``ContentStore.culled``), so it then knows every value file of
    the store (``holds``).

    It also knows which entries were found in the store lately (``seen``,
    ``leading_seen``), in two generations of SEEN_LATELY_S seconds each."""

    def __init__(self, directory: str) -> None:
        self._prefix = os.fsencode(directory) + b"/"
        self._new: dict[bytes, int] = {}
        self._old: dict[bytes, int] = {}
        self.complete = True
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

    def name(self, digest: bytes) -> bytes | None:
        """The 32 hex digits that name ``digest``'s value file, if known."""
        entry = self._new.get(digest)
        if entry is None:
            entry = self._old.get(digest)
        return None if entry is None else b"%032x" % (entry >> 32)

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
            self.complete = self.complete and not self._old
            self._old, self._new = self._new, {}
        self._new[digest] = entry

    def holds(self, digest: bytes) -> bool | None:
        """Whether the store holds ``digest``'s entry, as far as known without asking
        the index (a hint: a file may go or come meanwhile): True where its value file
        is known, False where every one is (``complete``) and it is not; else None."""
        if digest in self._new or digest in self._old:
            return True
        return False if self.complete else None

    def seen(self, digest: bytes) -> None:
        """``digest``'s entry was just found in the store (read, or its file opened)."""
        now = time.monotonic()
        if (now - self._seen_since >= SEEN_LATELY_S
                or len(self._seen_new) >= SEEN_LATELY_MAX // 2):
            self._seen_old, self._seen_old_since = self._seen_new, self._seen_since
            self._seen_new, self._seen_since = set(), now
        self._seen_new.add(digest)

    def leading_seen(self, digests: Sequence[bytes], start: int = 0) -> int:
        """How many of ``digests`` from ``start`` on were found at most 2 × SEEN_LATELY_S
        seconds ago (and not forgotten since), up to the first that was not (a segment's
        thousands, with the clock read once): a generation vouches while it began less
        than that ago."""
        now = time.monotonic()
        new = self._seen_new if now - self._seen_since < 2 * SEEN_LATELY_S else set()
        old = self._seen_old if now - self._seen_old_since < 2 * SEEN_LATELY_S else set()
        for n in range(start, len(digests)):
            if digests[n] not in new and digests[n] not in old:
                return n - start
        return len(digests) - start

    def forget(self, digest: bytes) -> None:
        self._new.pop(digest, None)
        self._old.pop(digest, None)
        self._seen_new.discard(digest)
        self._seen_old.discard(digest)

    def clear(self) -> None:
        """Forget every entry: the store is emptied, or closed until it is opened again."""
        self._new, self._old = {}, {}
        self._seen_new, self._seen_old = set(), set()
        self.complete = True

    def adopt(self, listed: ValueFiles) -> None:
        """Know what ``listed`` (read from a newly opened index) knows, and nothing else."""
        self._new, self._old = listed._new, listed._old
        self._seen_new, self._seen_old = set(), set()
        self.complete = listed.complete


class VerifiedWatcher(Protocol):
    """Who serves verified entries by their value files (mountd's native data plane)."""

    def verified(self, digest: bytes) -> None:
        """``digest`` is stored and was hashed in full in this run; its value file, if
        it has one, is known (``ValueFiles.name``)."""

    def withdrawn(self, digest: bytes) -> None:
        """``digest``'s entry is dropped: serve it no more."""


class VerifiedDigests:
    """The digests whose content was hashed in full in this run (put, or served once):
    their reads check only the CRC32C tag, and the native data plane (``watcher``)
    serves them from their files. Bounded by MAX_VERIFIED: when full it starts again,
    which costs a hash per entry, never a wrong byte (what the plane serves stays
    verified: only a drop withdraws it)."""

    def __init__(self) -> None:
        self._digests: set[bytes] = set()
        self.watcher: VerifiedWatcher | None = None

    def __contains__(self, digest: bytes) -> bool:
        return digest in self._digests

    def add(self, digest: bytes) -> None:
        if len(self._digests) >= MAX_VERIFIED:
            self._digests.clear()
        self._digests.add(digest)
        if self.watcher is not None:
            self.watcher.verified(digest)

    def discard(self, digest: bytes) -> None:
        self._digests.discard(digest)
        if self.watcher is not None:
            self.watcher.withdrawn(digest)

    def clear(self) -> None:
        self._digests.clear()


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


def open_cached(path: bytes) -> int:
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

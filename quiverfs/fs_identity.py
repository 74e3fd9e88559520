"""A user's file-system identity, and opening files as that user from a root daemon.

mountd runs as root but reads a user's ``file://`` dataset on that user's behalf. The
kernel must judge each open as it would judge the user's own, at the time of the open:
mode bits, ACLs, symlinks swapped in since registration. Linux keeps the credentials
that file access checks use (fsuid, fsgid, supplementary groups) per thread, so a
worker thread takes the user's for the length of one ``open`` and then gives them back.
Changing fsuid away from 0 also drops the thread's file capabilities
(CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH); changing it back restores them.

glibc's ``setgroups()`` applies to every thread of the process, so the supplementary
groups are set with the raw system call, which applies to the calling thread only.
"""
from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import errno
import os
import platform
import pwd
import stat
import threading
import time
from collections.abc import Iterator

NOBODY = 65534  # the overflow uid and gid: an identity to test acting as another user
# Seconds a user's current group list (from NSS) is reused before it is looked up again.
GROUPS_TTL = 60.0
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}  # per-thread setgroups(2), by machine

_NEEDS = "mountd needs CAP_SETUID and CAP_SETGID (see docs/operations.md)"
_libc = ctypes.CDLL(None, use_errno=True)


class IdentityUnavailable(PermissionError):
    """This process cannot take another user's file-system identity (it needs
    CAP_SETUID and CAP_SETGID, or the machine is not supported)."""


@dataclasses.dataclass(frozen=True)
class UserIdentity:
    """Who a registration reads as: uid, primary gid and supplementary groups."""

    uid: int
    gid: int
    groups: tuple[int, ...] = ()


_groups_lock = threading.Lock()
_groups_seen: dict[int, tuple[float, frozenset[int] | None]] = {}


def _current_groups(uid: int, gid: int) -> frozenset[int] | None:
    """The user's groups as the system lists them now (None: the uid has no account)."""
    now = time.monotonic()
    with _groups_lock:
        seen = _groups_seen.get(uid)
    if seen is not None and now - seen[0] < GROUPS_TTL:
        return seen[1]
    try:
        groups: frozenset[int] | None = frozenset(os.getgrouplist(pwd.getpwuid(uid).pw_name,
                                                                  gid))
    except KeyError:
        groups = None
    with _groups_lock:
        _groups_seen[uid] = (now, groups)
    return groups


def _effective_groups(user: UserIdentity) -> list[int]:
    """The groups an open runs with: those the user had at registration that the user
    still has now (a group taken away since is dropped; one added is not granted)."""
    groups = {user.gid, *user.groups}
    current = _current_groups(user.uid, user.gid)
    if current is not None:
        groups &= current | {user.gid}
    return sorted(groups)


def _setgroups_this_thread(groups: list[int]) -> None:
    arr = (ctypes.c_uint32 * len(groups))(*groups)
    if _libc.syscall(_SYS_SETGROUPS[platform.machine()], len(groups), arr) != 0:
        raise IdentityUnavailable(f"cannot take the groups of a user to read its files "
                                  f"({os.strerror(ctypes.get_errno())}): {_NEEDS}")


def _set_fs_ids(uid: int, gid: int) -> None:
    _libc.setfsgid(gid)
    _libc.setfsuid(uid)
    # setfsuid/setfsgid report failure only by leaving the value unchanged
    if _libc.setfsuid(-1) != uid or _libc.setfsgid(-1) != gid:
        raise IdentityUnavailable(f"cannot read files as uid {uid}: {_NEEDS}")


@contextlib.contextmanager
def acting_as(user: UserIdentity | None) -> Iterator[None]:
    """Run the body with ``user``'s file-system credentials in this thread (None: as is)."""
    if user is None or user.uid == os.geteuid():
        yield
        return
    if platform.machine() not in _SYS_SETGROUPS:
        raise IdentityUnavailable(f"reading files as another user is not supported on "
                                  f"{platform.machine()}")
    saved_groups = os.getgroups()
    saved_uid, saved_gid = _libc.setfsuid(-1), _libc.setfsgid(-1)
    _setgroups_this_thread(_effective_groups(user))
    try:
        _set_fs_ids(user.uid, user.gid)
        yield
    finally:
        _set_fs_ids(saved_uid, saved_gid)  # root's file capabilities come back with it
        _setgroups_this_thread(saved_groups)


def open_regular(path: str) -> int:
    """Open ``path`` read-only and return the descriptor; a path that is not a regular
    file (a FIFO, a device) is refused without blocking on it."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
    except OSError:
        os.close(fd)
        raise
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file", path)
    return fd


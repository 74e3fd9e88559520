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

The user's identity is not enough on its own: procfs judges ``/proc/self/...`` by the
process, and mountd is its own. Its magic links (``/proc/self/fd/N``) jump to mountd's
open files past the directories above them, and ``/proc/self/mem`` is its memory. So
``open_regular`` never follows a magic link (openat2's RESOLVE_NO_MAGICLINKS, or a walk
by hand where the kernel lacks it) and refuses every file on procfs. It also refuses
files of mountd's own mount: a worker reading one would wait for a worker to serve it.
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
import struct
import threading
import time
from collections.abc import Iterator

from quiverfs.mount_point import mount_device

NOBODY = 65534  # the overflow uid and gid: an identity to test acting as another user
# Seconds a user's current group list (from NSS) is reused before it is looked up again.
GROUPS_TTL = 60.0
_SYS_SETGROUPS = {"x86_64": 116, "aarch64": 159}  # per-thread setgroups(2), by machine

_NEEDS = "mountd needs CAP_SETUID and CAP_SETGID (see docs/operations.md)"
_libc = ctypes.CDLL(None, use_errno=True)

_SYS_OPENAT2 = 437  # openat2(2), Linux 5.6: the same number on every architecture
_RESOLVE_NO_MAGICLINKS = 0x02
_PROC_SUPER_MAGIC = 0x9FA0
_AT_FDCWD = -100
_MAX_SYMLINKS = 40  # as the kernel's path walk: more is ELOOP
_STATFS_BYTES = 256  # room for struct statfs (120 bytes on 64-bit Linux)
_DIR_FLAGS = os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64),
                ("resolve", ctypes.c_uint64)]


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


class PathRefused(PermissionError):
    """A path mountd will not read whatever the user may: procfs, or a file system this
    process serves."""


_served_devices: set[int] = set()


def refuse_device(device: int) -> None:
    """Refuse files on ``device`` from now on: a file system this process serves (its
    own mount), whose reads would wait for the workers reading them."""
    _served_devices.add(device)


def refuse_mount(mountpoint: str) -> str | None:
    """Refuse the files of the mount at ``mountpoint``, one this process serves (as
    ``refuse_device``); its ``MAJOR:MINOR``, or None where nothing is mounted there."""
    device = mount_device(mountpoint)
    if device is not None:
        refuse_device(os.makedev(*map(int, device.split(":"))))
    return device


def open_regular(path: str) -> int:
    """Open ``path`` read-only and return the descriptor. Refused: a path that is not a
    regular file (a FIFO, a device), any path that reaches procfs or passes through one
    of its magic links (``/proc/self/fd/N``, ``/dev/fd/N``, ``/proc/PID/root``: opened
    from mountd, those name mountd's own files and memory, past the permissions of the
    directories above them), and a file on a device given to ``refuse_device``.

    The path is resolved to an O_PATH descriptor, which opens nothing, and checked
    before the file is opened through it: no FIFO blocks the open, and no OPEN reaches
    mountd's own mount."""
    pinned = _pin(path)
    try:
        st = os.fstat(pinned)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        why = _refusal(pinned, st.st_dev)
        if why is not None:
            raise PathRefused(errno.EACCES, why, path)
        # This process's own descriptor, reopened: the kernel checks the file's mode as
        # the thread's user, as a plain open would.
        return os.open(f"/proc/self/fd/{pinned}",
                       os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    finally:
        os.close(pinned)


_have_openat2 = True  # until the kernel says ENOSYS (before 5.6, or a seccomp filter)


def _pin(path: str) -> int:
    """An O_PATH descriptor of ``path``, resolved without following a magic link:
    openat2 with RESOLVE_NO_MAGICLINKS where the kernel has it, else a walk by hand."""
    global _have_openat2
    if _have_openat2:
        how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_long(_AT_FDCWD),
                           ctypes.c_char_p(os.fsencode(path)), ctypes.byref(how),
                           ctypes.c_size_t(ctypes.sizeof(how)))
        if fd >= 0:
            return fd
        err = ctypes.get_errno()
        if err != errno.ENOSYS:
            raise OSError(err, os.strerror(err), path)
        _have_openat2 = False
    return _pin_walking(path)


def _pin_walking(path: str) -> int:
    """What openat2's RESOLVE_NO_MAGICLINKS does, for kernels without it: resolve
    ``path`` one component at a time with O_NOFOLLOW, following ordinary symlinks by
    their text, and refuse to enter procfs, where every magic link lives (or mountd's
    own mount). The kernel checks each step with the thread's credentials, as in a
    plain open."""
    pending = _components(path)
    dirfd = os.open("/" if path.startswith("/") else ".", _DIR_FLAGS)
    links = 0
    try:
        while pending:
            name = pending.pop(0)
            if stat.S_ISLNK(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode):
                links += 1
                if links > _MAX_SYMLINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), path)
                target = os.readlink(name, dir_fd=dirfd)
                pending[:0] = _components(target)
                if target.startswith("/"):
                    os.close(dirfd)
                    dirfd = os.open("/", _DIR_FLAGS)
                continue
            if not pending:  # a link swapped in since the stat is pinned as a link
                return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dirfd)
            parent, dirfd = dirfd, os.open(name, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dirfd)
            os.close(parent)
            why = _refusal(dirfd, os.fstat(dirfd).st_dev)
            if why is not None:
                raise PathRefused(errno.EACCES, why, path)
        return os.open(".", os.O_PATH | os.O_CLOEXEC, dir_fd=dirfd)
    finally:
        os.close(dirfd)


def _components(path: str) -> list[str]:
    return [p for p in path.split("/") if p and p != "."]


def _refusal(fd: int, device: int) -> str | None:
    """Why files on the file system of ``fd`` (on ``device``) are not read, or None. The
    device is looked at first: statfs of mountd's own mount would wait for a worker."""
    if device in _served_devices:
        return "in mountd's own mount: mountd would wait on itself"
    if _on_procfs(fd):
        return "on /proc: mountd reads no process's files"
    return None


def _on_procfs(fd: int) -> bool:
    buf = ctypes.create_string_buffer(_STATFS_BYTES)
    if _libc.fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return struct.unpack_from("l", buf)[0] == _PROC_SUPER_MAGIC  # f_type, a C long

"""The files that need per-open state: ``ROOT/.quiver`` (job control, mountd.fs.job_files)
and ``ROOT/.quiver/views/NAME`` (substitutable views, mountd.view.view_jobs).

They are served by a second FUSE connection (mountd.fs.control_mount) mounted on
``ROOT/.quiver``, because the datasets' connection (mountd.fs.datasets_fs) runs without OPEN: the
kernel then gives a read no handle of its own, while a job's control files keep what
an open wrote, and a view gives each open of a path its own item. The handlers here
are what that connection's requests reach; their inodes are mountd's own, so the
connection's root is CONTROL_INODE.
"""
from __future__ import annotations

import collections
import errno
import itertools
import os
import stat
from collections.abc import Callable
from typing import Protocol

import pyfuse3

from mountd.datasets.dataset import MountedDataset
from mountd.datasets.mount_table import MountTable
from mountd.fetch.item_reader import ItemReader, ReadFailed
from mountd.fs.datasets_fs import DATASET_TIMEOUT
from mountd.fs.job_files import CONTROL_INODE, ControlFiles, ControlHandle
from mountd.view.view_jobs import ViewJobs
from quiverfs.counters import FetchCause
from quiverfs.job_protocol import VIEWS_NAME

VIEWS_INODE = 4  # ROOT/.quiver/views
VIEW_TIMEOUT = 1.0  # seconds the kernel may cache names here: views come and go
# Bytes of a cached item handed over with the open of a view file that serves it: the
# process that forwards this connection's requests answers the file's READs with them.
HANDOVER_MAX = 1 << 20
# Bytes handed over for one uid's view files open at once: past it, its opens' bytes
# are read at their first READ and kept here, as they are above HANDOVER_MAX.
HANDOVER_PER_UID = 64 << 20
# On a view's open file: what the opening process was served (its SHA-256, hex, and path).
XATTR_SERVED_HASH = b"user.quiver.served.sha256"
XATTR_SERVED_PATH = b"user.quiver.served.path"


class Requester(Protocol):
    """Who sent a request: pyfuse3's RequestContext, or its copy from the connection."""

    uid: int
    gid: int
    pid: int
    umask: int


class _ViewFile:
    """An open view file: the item this open was given, and its bytes once read."""

    __slots__ = ("ds", "index", "cause", "keep", "hit", "opener", "uid", "data", "failed",
                 "handed", "recorded")

    def __init__(self, ds: MountedDataset, index: int, cause: FetchCause, keep: bool,
                 hit: bool, opener: tuple[int, int], uid: int) -> None:
        self.ds, self.index, self.cause, self.keep, self.hit = ds, index, cause, keep, hit
        self.opener = opener  # (pid, inode) of the open
        self.uid = uid  # of the opener
        self.data: bytes | None = None
        self.failed = False
        self.handed = 0  # bytes handed over with the open (HANDOVER_PER_UID)
        self.recorded = False  # the native plane was told of it (python_opened)


class ControlFS:
    """Handlers for ``ROOT/.quiver``: the jobs' control files and the views."""

    def __init__(self, table: MountTable, reader: ItemReader, control: ControlFiles,
                 views: ViewJobs) -> None:
        self.table = table
        self.reader = reader
        self.control = control
        self.views = views
        # (pid, inode) -> the handle of that process's latest open of a view file: its
        # fstat and fgetxattr (which FUSE sends by inode) answer for the item it got.
        self._served: dict[tuple[int, int], int] = {}
        self._fh = itertools.count(1)
        self._dir_handles: dict[int, list[tuple[bytes, int]]] = {}
        self._files: dict[int, _ViewFile | ControlHandle] = {}
        self._handed: collections.Counter[int] = collections.Counter()  # uid -> bytes
        # (pid, inode) -> the item that process's latest open of a view file there
        # serves, where the native plane opened it (mountd.fs.native_views)
        self.native_opened: Callable[[int, int], int | None] | None = None
        # tells the native plane of a view file opened (1) or released (-1 recorded, -2
        # not) here: the opener's GETATTRs of it are then this process's, not the plane's
        self.python_opened: Callable[[int, int, int], bool] | None = None

    # -- names and attributes ---------------------------------------------------------
    def _views_attr(self) -> pyfuse3.EntryAttributes:
        attr = self.control.getattr(CONTROL_INODE)
        attr.st_ino = VIEWS_INODE
        attr.attr_timeout = attr.entry_timeout = VIEW_TIMEOUT
        return attr

    def _view(self, inode: int) -> tuple[MountedDataset, int]:
        found = self.table.resolve(inode)
        if found is None or found[0].pools is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return found

    @staticmethod
    def _view_attr(ds: MountedDataset, node: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ds.inode_base + node
        attr.st_uid, attr.st_gid = ds.reg.uid, ds.reg.gid
        ns = int(ds.reg.registered_at * 1e9)
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = ns
        attr.st_blksize = 1 << 17
        # A view's own name may go at any time; below it, names and inodes are its
        # digest's, as long as it is mounted (and inodes are never used again), as in
        # the exact mount.
        timeout = VIEW_TIMEOUT if node == 0 else DATASET_TIMEOUT
        if ds.tree.is_dir(node):
            attr.st_mode = stat.S_IFDIR | (0o700 if node == 0 else 0o555)
            attr.st_nlink = 2
            attr.attr_timeout = attr.entry_timeout = timeout
        else:
            size = ds.digest.sizes[ds.tree.entry_index(node)]
            attr.st_mode = stat.S_IFREG | 0o444
            attr.st_nlink = 1
            attr.st_size, attr.st_blocks = size, (size + 511) // 512
            attr.entry_timeout = timeout
            attr.attr_timeout = 0  # a view file's size is the served item's: ask each time
        return attr

    @classmethod
    def _served_attr(cls, f: _ViewFile, inode: int) -> pyfuse3.EntryAttributes:
        """What fstat of the open view file ``f`` at ``inode`` says: the size of the item
        it serves."""
        attr = cls._view_attr(f.ds, inode - f.ds.inode_base)
        attr.st_size = f.ds.digest.sizes[f.index]
        attr.st_blocks = (attr.st_size + 511) // 512
        return attr

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        if inode == VIEWS_INODE:
            return self._views_attr()
        if self.control.owns(inode):
            return self.control.getattr(inode)
        ds, node = self._view(inode)
        return self._view_attr(ds, node)

    def _served_file(self, pid: int, inode: int) -> _ViewFile | None:
        """The view file ``pid`` has open at ``inode`` (its latest open), if any."""
        f = self._files.get(self._served.get((pid, inode), 0))
        return f if isinstance(f, _ViewFile) else None

    def _served_item(self, pid: int, inode: int) -> tuple[MountedDataset, int] | None:
        """The view and item that ``pid``'s open at ``inode`` serves: its open here, else
        one the native plane answered."""
        f = self._served_file(pid, inode)
        if f is not None:
            return f.ds, f.index
        item = None if self.native_opened is None else self.native_opened(pid, inode)
        found = None if item is None else self.table.resolve(inode)
        if found is None or found[0].pools is None or item >= len(found[0].digest):
            return None
        return found[0], item

    def fixed(self, inode: int, ctx: Requester) -> bool:
        """Whether what GETATTR of ``inode`` answers ``ctx`` now is what it will answer
        every process that has no view file open there, as long as the inode lives: a
        view file's own attributes (its digest's)."""
        if (inode == VIEWS_INODE or self.control.owns(inode)
                or self._served_item(ctx.pid, inode) is not None):
            return False
        found = self.table.resolve(inode)
        return found is not None and found[0].pools is not None and not found[0].tree.is_dir(
            found[1])

    async def getattr(self, inode: int, ctx: Requester) -> pyfuse3.EntryAttributes:
        served = self._served_file(ctx.pid, inode)
        if served is not None:  # fstat of an open view file: the size of what it reads
            return self._served_attr(served, inode)
        return self._attr(inode)

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: Requester) -> pyfuse3.EntryAttributes:
        text = os.fsdecode(name)
        if parent_inode == CONTROL_INODE and text == VIEWS_NAME:
            return self._views_attr()
        if parent_inode == VIEWS_INODE:
            ds = self.table.by_name.get(text)
            if ds is None or ds.pools is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._view_attr(ds, 0)
        if self.control.owns(parent_inode):
            return self.control.lookup(parent_inode, text)
        ds, node = self._view(parent_inode)
        if not ds.tree.is_dir(node):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        child = ds.tree.lookup(node, text)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._view_attr(ds, child)

    # -- directories ------------------------------------------------------------------
    def _entries(self, inode: int, uid: int) -> list[tuple[bytes, int]]:
        if inode == CONTROL_INODE:
            return self.control.entries(inode, uid) + [(VIEWS_NAME.encode(), VIEWS_INODE)]
        if inode == VIEWS_INODE:
            return [(ds.name.encode(), ds.inode_base) for ds in self.table.visible_to(uid)
                    if ds.pools is not None]
        if self.control.owns(inode):
            return self.control.entries(inode, uid)
        ds, node = self._view(inode)
        if not ds.tree.is_dir(node):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return [(name.encode(), ds.inode_base + child)
                for name, child in ds.tree.sorted_children[node]]

    async def opendir(self, inode: int, ctx: Requester) -> int:
        fh = next(self._fh)
        self._dir_handles[fh] = self._entries(inode, ctx.uid)
        return fh

    def entries_from(self, fh: int, start_id: int, limit: int
                     ) -> list[tuple[bytes, pyfuse3.EntryAttributes, int]]:
        """Up to ``limit`` of a directory handle's entries from ``start_id``: (name,
        attributes, the id that follows it)."""
        entries = self._dir_handles[fh]
        out = []
        for pos in range(start_id, min(len(entries), start_id + limit)):
            name, inode = entries[pos]
            try:
                out.append((name, self._attr(inode), pos + 1))
            except pyfuse3.FUSEError:
                continue  # gone since opendir
        return out

    async def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)

    # -- files ------------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: Requester) -> pyfuse3.FileInfo:
        fh = next(self._fh)
        if self.control.owns(inode):
            self._files[fh] = self.control.open(inode, flags)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        ds, node = self._view(inode)
        if ds.tree.is_dir(node):
            raise pyfuse3.FUSEError(errno.EISDIR)
        # The item this job gets in place of the path's. Another opener gets other
        # bytes under the same inode, so none of them may go to the page cache.
        choice = await self.views.choose(ds, ds.tree.entry_index(node), ctx.pid, ctx.uid)
        opener = (ctx.pid, inode)
        f = self._files[fh] = _ViewFile(ds, choice.index, choice.cause, choice.keep,
                                        choice.hit, opener, ctx.uid)
        self._served[opener] = fh
        if self.python_opened is not None:  # before the kernel has the reply
            f.recorded = self.python_opened(ctx.pid, inode, 1)
        return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)

    async def handover(self, fh: int) -> tuple[pyfuse3.EntryAttributes, bytes | None] | None:
        """For the open view file ``fh`` (just opened): what its fstat says, and the
        bytes it serves where they are cached (a hit), at most HANDOVER_MAX and within
        the opener's HANDOVER_PER_UID, read now and kept here no more (its READs are
        answered with them where it was opened); None for a control file. A failed read
        is the open's one attempt: its READs then fail, as they would have."""
        f = self._files.get(fh)
        if not isinstance(f, _ViewFile):
            return None
        attr = self._served_attr(f, f.opener[1])
        size = f.ds.digest.sizes[f.index]
        if (not f.hit or size > HANDOVER_MAX
                or self._handed[f.uid] + size > HANDOVER_PER_UID):
            return attr, None
        self._handed[f.uid] += size
        f.handed = size
        try:
            return attr, await self._data(f)
        except pyfuse3.FUSEError:
            return attr, None
        finally:
            f.data = None

    async def _data(self, f: _ViewFile) -> bytes:
        """The bytes of the item ``f`` serves, read once per open."""
        if f.data is None:
            if f.failed:  # one fetch attempt per open, however often the kernel retries
                raise pyfuse3.FUSEError(errno.EIO)
            try:
                f.data = await self.reader.read(f.ds, f.index, f.cause, f.keep)
            except ReadFailed:
                f.failed = True
                raise pyfuse3.FUSEError(errno.EIO) from None
        return f.data

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        f = self._files.get(fh)
        if f is None:
            raise pyfuse3.FUSEError(errno.EBADF)
        if isinstance(f, ControlHandle):
            return await f.read(off, size)
        return memoryview(await self._data(f))[off:off + size]

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        f = self._files.get(fh)
        if not isinstance(f, ControlHandle):
            raise pyfuse3.FUSEError(errno.EROFS)
        return await f.write(off, buf)

    async def release(self, fh: int) -> None:
        f = self._files.pop(fh, None)
        if not isinstance(f, _ViewFile):
            return
        if self._served.get(f.opener) == fh:
            del self._served[f.opener]
        if self.python_opened is not None:
            self.python_opened(*f.opener, -1 if f.recorded else -2)
        if f.handed:
            self._handed[f.uid] -= f.handed
            if not self._handed[f.uid]:
                del self._handed[f.uid]

    def connection_ended(self) -> None:
        """The connection's files and directories are closed with it: nothing of them
        is kept (what was handed over went with the process that served it)."""
        self._files.clear()
        self._served.clear()
        self._handed.clear()
        self._dir_handles.clear()

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: Requester) -> pyfuse3.EntryAttributes:
        return self.control.mkdir(parent_inode, os.fsdecode(name), ctx)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: Requester) -> None:
        self.control.rmdir(parent_inode, os.fsdecode(name), ctx)

    async def setattr(self, inode: int, ctx: Requester) -> pyfuse3.EntryAttributes:
        if not self.control.owns(inode):
            raise pyfuse3.FUSEError(errno.EROFS)
        return self.control.getattr(inode)  # truncating a control file changes nothing

    # -- metadata ---------------------------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, ctx: Requester) -> bytes:
        served = self._served_item(ctx.pid, inode)
        if served is None or name not in (XATTR_SERVED_HASH, XATTR_SERVED_PATH):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        digest, index = served[0].digest, served[1]
        return (digest.hash(index).hex().encode() if name == XATTR_SERVED_HASH
                else digest.path(index).encode())

    async def listxattr(self, inode: int, ctx: Requester) -> list[bytes]:
        served = self._served_item(ctx.pid, inode)
        return [] if served is None else [XATTR_SERVED_HASH, XATTR_SERVED_PATH]

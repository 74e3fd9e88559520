"""The FUSE operations: thin async handlers over the mount table and the item reader.

Every handler answers: an exception that is not a FUSEError is a bug or a fault below
(the store, a backend), so it is logged and answered with EIO, and mountd keeps serving
every other request. Left to propagate, it would end pyfuse3's main loop for all users.
"""
from __future__ import annotations

import errno
import functools
import inspect
import itertools
import logging
import os
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pyfuse3
import trio

from mountd.dataset import MountedDataset
from mountd.item_reader import ItemReader, ReadFailed
from mountd.job_files import CONTROL_INODE, CONTROL_NAME, ControlFiles, ControlHandle
from mountd.mount_table import MountTable
from mountd.read_stats import FetchCause
from mountd.view import ViewJobs

log = logging.getLogger(__name__)

# Seconds the kernel may cache names and attributes. Content under a dataset never
# changes; dataset names in the root can come and go, so they expire quickly.
DATASET_TIMEOUT = 3600.0
ROOT_ENTRY_TIMEOUT = 1.0
XATTR_HASH = b"user.quiver.sha256"
# On a view's open file: what the opening process was served (its SHA-256, hex, and path).
XATTR_SERVED_HASH = b"user.quiver.served.sha256"
XATTR_SERVED_PATH = b"user.quiver.served.path"


class _OpenFile:
    """An open file: which item, and its bytes once the first read fetched them."""

    __slots__ = ("ds", "index", "data", "failed", "pushed", "cause", "keep", "opener")

    def __init__(self, ds: MountedDataset, index: int, pushed: bool = False,
                 cause: FetchCause = FetchCause.EXACT, keep: bool = True,
                 opener: tuple[int, int] | None = None) -> None:
        self.ds = ds
        self.index = index
        self.data: bytes | None = None
        self.failed = False
        self.pushed = pushed  # its pages were pushed ahead (mountd.page_push)
        self.cause, self.keep = cause, keep  # how a miss of it is fetched, and whether kept
        self.opener = opener  # in a view: (pid, inode) of the open


class QuiverFS(pyfuse3.Operations):
    """A read-only tree per dataset at ROOT/NAME; file content comes from ItemReader."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, table: MountTable, reader: ItemReader, control: ControlFiles,
                 views: ViewJobs) -> None:
        super().__init__()
        self.table = table
        self.reader = reader
        self.control = control
        self.views = views
        # (pid, inode) -> the handle of that process's latest open of a view file: its
        # fstat and fgetxattr (which FUSE sends by inode) answer for the item it got.
        self._served: dict[tuple[int, int], int] = {}
        self._fh = itertools.count(1)
        self._dir_handles: dict[int, list[tuple[bytes, int]]] = {}
        self._files: dict[int, _OpenFile | ControlHandle] = {}
        self.started_ns = time.time_ns()
        self.initialized = trio.Event()  # the kernel's INIT answered: its settings are made

    def init(self) -> None:
        self.initialized.set()

    # -- attributes -------------------------------------------------------------------
    def _root_attr(self) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = pyfuse3.ROOT_INODE
        attr.st_mode = stat.S_IFDIR | 0o755
        attr.st_nlink = 2
        attr.st_uid = attr.st_gid = 0
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self.started_ns
        attr.attr_timeout = attr.entry_timeout = ROOT_ENTRY_TIMEOUT
        return attr

    @staticmethod
    def _node_attr(ds: MountedDataset, node: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ds.inode_base + node
        attr.st_uid = ds.reg.uid
        attr.st_gid = ds.reg.gid
        ns = int(ds.reg.registered_at * 1e9)
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = ns
        attr.st_blksize = 1 << 17
        if ds.tree.is_dir(node):
            attr.st_mode = stat.S_IFDIR | (0o700 if node == 0 else 0o555)
            attr.st_nlink = 2
        else:
            size = ds.digest.sizes[ds.tree.entry_index(node)]
            attr.st_mode = stat.S_IFREG | 0o444
            attr.st_nlink = 1
            attr.st_size = size
            attr.st_blocks = (size + 511) // 512
        timeout = ROOT_ENTRY_TIMEOUT if node == 0 else DATASET_TIMEOUT
        attr.attr_timeout = attr.entry_timeout = timeout
        if ds.pools is not None and not ds.tree.is_dir(node):
            attr.attr_timeout = 0  # a view file's size is the served item's: ask each time
        return attr

    def _served_file(self, pid: int, inode: int) -> _OpenFile | None:
        """The view file ``pid`` has open at ``inode`` (its latest open), if any."""
        f = self._files.get(self._served.get((pid, inode), 0))
        return f if isinstance(f, _OpenFile) else None

    def _resolve(self, inode: int) -> tuple[MountedDataset, int]:
        found = self.table.resolve(inode)
        if found is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return found

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        attr = self._attr(inode)
        served = self._served_file(ctx.pid, inode) if ctx is not None else None
        if served is not None:  # fstat of an open view file: the size of what it reads
            attr.st_size = served.ds.digest.sizes[served.index]
            attr.st_blocks = (attr.st_size + 511) // 512
        return attr

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        if self.table.is_root(inode):
            return self._root_attr()
        if self.control.owns(inode):
            return self.control.getattr(inode)
        ds, node = self._resolve(inode)
        return self._node_attr(ds, node)

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        text = os.fsdecode(name)
        if self.table.is_root(parent_inode):
            if text in (".", ".."):
                return self._root_attr()
            if text == CONTROL_NAME:
                return self.control.getattr(CONTROL_INODE)
            ds = self.table.by_name.get(text)
            if ds is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._node_attr(ds, 0)
        if self.control.owns(parent_inode):
            return self.control.lookup(parent_inode, text)
        ds, node = self._resolve(parent_inode)
        if text == ".":
            return self._node_attr(ds, node)
        if text == "..":
            return self._root_attr() if node == 0 else self._node_attr(ds, ds.tree.parent(node))
        if not ds.tree.is_dir(node):
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        child = ds.tree.lookup(node, text)
        if child is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return self._node_attr(ds, child)

    # -- directories ------------------------------------------------------------------
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if self.table.is_root(inode):
            entries = [(CONTROL_NAME.encode(), CONTROL_INODE)]
            entries += [(ds.name.encode(), ds.inode_base) for ds in self.table.visible_to(ctx.uid)]
        elif self.control.owns(inode):
            entries = self.control.entries(inode, ctx.uid)
        else:
            ds, node = self._resolve(inode)
            if not ds.tree.is_dir(node):
                raise pyfuse3.FUSEError(errno.ENOTDIR)
            entries = [(name.encode(), ds.inode_base + child)
                       for name, child in ds.tree.sorted_children[node]]
        fh = next(self._fh)
        self._dir_handles[fh] = entries
        return fh

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        entries = self._dir_handles[fh]
        for pos in range(start_id, len(entries)):
            name, inode = entries[pos]
            try:
                attr = self._attr(inode)
            except pyfuse3.FUSEError:
                continue  # unmounted since opendir
            if not pyfuse3.readdir_reply(token, name, attr, pos + 1):
                return

    async def releasedir(self, fh: int) -> None:
        self._dir_handles.pop(fh, None)

    # -- files ------------------------------------------------------------------------
    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext) -> pyfuse3.FileInfo:
        if self.control.owns(inode):
            fh = next(self._fh)
            self._files[fh] = self.control.open(inode, flags)
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        ds, node = self._resolve(inode)
        if ds.tree.is_dir(node):
            raise pyfuse3.FUSEError(errno.EISDIR)
        fh = next(self._fh)
        if ds.pools is not None:
            # A view: the item this job gets in place of the path's. Another opener gets
            # other bytes under the same inode, so none of them may go to the page cache.
            choice = await self.views.choose(ds, ds.tree.entry_index(node), ctx.pid, ctx.uid)
            opener = (ctx.pid, inode)
            self._files[fh] = _OpenFile(ds, choice.index, cause=choice.cause,
                                        keep=choice.keep, opener=opener)
            self._served[opener] = fh
            return pyfuse3.FileInfo(fh=fh, direct_io=True, keep_cache=False)
        pushed = self.reader.push.opened(inode)
        self._files[fh] = _OpenFile(ds, ds.tree.entry_index(node), pushed)
        # Content per inode never changes, so the kernel may keep its pages; a re-read
        # it serves from its page cache costs mountd an open and a release, nothing more.
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    async def read(self, fh: int, off: int, size: int) -> bytes | memoryview:
        f = self._files[fh]
        if isinstance(f, ControlHandle):
            return await f.read(off, size)
        if f.data is None:
            if f.failed:  # one fetch attempt per open, however often the kernel retries
                raise pyfuse3.FUSEError(errno.EIO)
            try:
                f.data = await self.reader.read(f.ds, f.index, f.cause, f.keep)
            except ReadFailed:
                f.failed = True
                raise pyfuse3.FUSEError(errno.EIO) from None
        return memoryview(f.data)[off:off + size]  # no copy: pyfuse3 takes any buffer

    async def release(self, fh: int) -> None:
        f = self._files.pop(fh, None)
        if isinstance(f, _OpenFile) and f.opener is not None:
            if self._served.get(f.opener) == fh:
                del self._served[f.opener]
            return
        if isinstance(f, _OpenFile) and f.data is None and not (f.failed or f.pushed):
            # opened and closed without a read reaching us: the kernel's page cache
            # served it (keep_cache), or nothing was read
            self.reader.stats.count(f.ds, "page_cache_opens")

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        f = self._files[fh]
        if not isinstance(f, ControlHandle):
            raise pyfuse3.FUSEError(errno.EROFS)
        return await f.write(off, buf)

    # -- the control area is the only writable place ----------------------------------
    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return self.control.mkdir(parent_inode, os.fsdecode(name), ctx)

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> None:
        self.control.rmdir(parent_inode, os.fsdecode(name), ctx)

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        if not self.control.owns(inode):
            raise pyfuse3.FUSEError(errno.EROFS)
        return self.control.getattr(inode)  # truncating a control file changes nothing

    async def _read_only(self, *args: object) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    create = mknod = unlink = rename = symlink = link = _read_only

    # -- metadata ---------------------------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if name in (XATTR_SERVED_HASH, XATTR_SERVED_PATH):
            served = self._served_file(ctx.pid, inode)
            if served is None:
                raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
            digest = served.ds.digest
            return (digest.hash(served.index).hex().encode() if name == XATTR_SERVED_HASH
                    else digest.path(served.index).encode())
        if name != XATTR_HASH or self.table.is_root(inode):
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        ds, node = self._resolve(inode)
        if ds.tree.is_dir(node) or ds.pools is not None:  # a view's path has no one content
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return ds.digest.hash(ds.tree.entry_index(node)).hex().encode()

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        found = None if self.table.is_root(inode) else self.table.resolve(inode)
        if found is None or found[0].tree.is_dir(found[1]):
            return []
        if found[0].pools is not None:
            served = self._served_file(ctx.pid, inode)
            return [] if served is None else [XATTR_SERVED_HASH, XATTR_SERVED_PATH]
        return [XATTR_HASH]

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        store = self.reader.store
        volume = await trio.to_thread.run_sync(store.volume, limiter=self.reader.limiter)
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_blocks = store.size_limit // 4096
        data.f_bfree = data.f_bavail = max(0, store.size_limit - volume) // 4096
        n_nodes = sum(ds.tree.n_nodes for ds in self.table.by_name.values())
        data.f_files = n_nodes + 1
        data.f_ffree = data.f_favail = 0
        data.f_namemax = 255
        return data


def _counted_and_guarded(name: str, handler: Callable[..., Awaitable[Any]]
                         ) -> Callable[..., Awaitable[Any]]:
    """Count the request under its opcode's name, and answer EIO for an exception
    that is not a FUSEError."""
    @functools.wraps(handler)
    async def guarded(fs: QuiverFS, *args: Any) -> Any:
        fs.reader.stats.fuse_requests[name] += 1
        try:
            return await handler(fs, *args)
        except pyfuse3.FUSEError:
            raise
        except Exception:
            log.exception("FUSE %s failed: answered EIO", name)
            raise pyfuse3.FUSEError(errno.EIO) from None

    return guarded


# Every request handler, pyfuse3's defaults included (they answer ENOSYS, and the kernel
# stops sending that request: flush is one).
for _name in dir(pyfuse3.Operations):
    _handler = getattr(QuiverFS, _name)
    if not _name.startswith("_") and inspect.iscoroutinefunction(_handler):
        setattr(QuiverFS, _name, _counted_and_guarded(_name, _handler))

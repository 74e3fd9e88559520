"""The datasets' FUSE connection: thin async handlers over the mount table and the item
reader. It is mounted read-only at ROOT; ``ROOT/.quiver`` is a second connection
(mountd.fs.control_mount), and each view's name here is a link to it.

No-open mode: with pyfuse3's ``read_with_inode`` (mountd/patches), OPEN is answered
ENOSYS, and the kernel sends no OPEN and no RELEASE from then on; a READ names its
inode. A dataset's content per inode never changes, so the kernel keeps its pages: a
cached file costs mountd its LOOKUP and its READs the first time, and nothing while the
kernel holds it (the mount is read-only, so reads do not make its attributes stale).
Without the patch, or with ``--fuse-opens``, files are opened with a handle, as before.

Every handler answers: an exception that is not a FUSEError is a bug or a fault below
(the store, a backend), so it is logged and answered with EIO, and mountd keeps serving
every other request. Left to propagate, it would end pyfuse3's main loop for all users.
"""
from __future__ import annotations

import collections
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

from mountd.datasets.dataset import MountedDataset
from mountd.datasets.mount_table import MountTable
from mountd.fetch.item_reader import ReadFailed
from mountd.fetch.services import ReadServices
from mountd.fs.job_files import CONTROL_INODE
from quiverfs.counters import ReadCounter
from quiverfs.job_protocol import CONTROL_NAME, VIEWS_NAME

log = logging.getLogger(__name__)

# Seconds the kernel may cache names and attributes. Content under a dataset never
# changes; dataset names in the root can come and go, so they expire quickly.
DATASET_TIMEOUT = 3600.0
ROOT_ENTRY_TIMEOUT = 1.0
XATTR_HASH = b"user.quiver.sha256"
# No-open mode: an item's bytes between the READs of one file (the kernel reads a file
# larger than one READ in several), at most this much in all, oldest dropped first.
READING_BYTES = 64 << 20
# No-open mode: after a failed read of a file, its READs fail without another fetch for
# this long: the kernel retries a failed readahead page by page, and each retry would
# fetch (and count a failure) again. Beyond it, a read tries afresh.
FAILED_HOLD = 1.0


def no_open_available() -> bool:
    """Whether this pyfuse3 passes the inode to ``read`` (mountd/patches)."""
    return hasattr(pyfuse3.Operations, "read_with_inode")


class _OpenFile:
    """An open file (with opens only): which item, and its bytes once read."""

    __slots__ = ("ds", "index", "data", "failed", "pushed")

    def __init__(self, ds: MountedDataset, index: int, pushed: bool) -> None:
        self.ds = ds
        self.index = index
        self.data: bytes | None = None
        self.failed = False
        self.pushed = pushed  # its pages were pushed ahead: PagePush counts its reads


class QuiverFS(pyfuse3.Operations):
    """A read-only tree per dataset at ROOT/NAME; file content comes from ItemReader."""

    supports_dot_lookup = True
    enable_writeback_cache = False
    enable_acl = False

    def __init__(self, table: MountTable, services: ReadServices, no_open: bool) -> None:
        super().__init__()
        self.table = table
        self.reader = services.reader
        self.stats = services.stats
        self.push = services.push
        self.store = services.store
        self.limiter = services.limiter
        self.no_open = no_open
        self.read_with_inode = no_open  # pyfuse3 (patched) then passes READ's inode
        self.direct_opens = False  # opens answered with direct I/O (serve_opens)
        self._fh = itertools.count(1)
        self._dir_handles: dict[int, list[tuple[bytes, int]]] = {}
        self._files: dict[int, _OpenFile] = {}
        self._reading: collections.OrderedDict[int, bytes] = collections.OrderedDict()
        self._reading_bytes = 0
        self._failed: collections.OrderedDict[int, float] = collections.OrderedDict()
        self.started_ns = time.time_ns()
        self.initialized = trio.Event()  # the kernel's INIT answered: its settings are made
        # called at the kernel's INIT, before its reply (the native data plane's choice)
        self.on_init: Callable[[], None] | None = None

    def init(self) -> None:
        if self.on_init is not None:
            self.on_init()
        self.initialized.set()

    def serve_opens(self, opens: bool, direct: bool = False) -> None:
        """Answer OPEN with a handle (``opens``; ``direct``: for direct I/O), or ENOSYS
        for no-open mode; before the first OPEN. With FUSE passthrough, the opens
        mountd answers here must be direct: the kernel refuses an inode opened with
        its page cache and through a backing file at once."""
        self.no_open = not opens
        self.read_with_inode = not opens
        self.direct_opens = direct

    # -- attributes -------------------------------------------------------------------
    def _dir_attr(self, inode: int, timeout: float) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.st_mode = stat.S_IFDIR | 0o755
        attr.st_nlink = 2
        attr.st_uid = attr.st_gid = 0
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self.started_ns
        attr.attr_timeout = attr.entry_timeout = timeout
        return attr

    def _root_attr(self) -> pyfuse3.EntryAttributes:
        return self._dir_attr(pyfuse3.ROOT_INODE, ROOT_ENTRY_TIMEOUT)

    @staticmethod
    def _view_link(ds: MountedDataset) -> bytes:
        return os.fsencode(os.path.join(CONTROL_NAME, VIEWS_NAME, ds.name))

    def _node_attr(self, ds: MountedDataset, node: int) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = ds.inode_base + node
        attr.st_uid = ds.reg.uid
        attr.st_gid = ds.reg.gid
        ns = int(ds.reg.registered_at * 1e9)
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = ns
        attr.st_blksize = 1 << 17
        if ds.pools is not None:  # a view: its name links to where it is served
            if node != 0:
                raise pyfuse3.FUSEError(errno.ENOENT)
            attr.st_mode = stat.S_IFLNK | 0o777
            attr.st_nlink = 1
            attr.st_size = len(self._view_link(ds))
        elif ds.tree.is_dir(node):
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
        return attr

    def _resolve(self, inode: int) -> tuple[MountedDataset, int]:
        found = self.table.resolve(inode)
        if found is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return found

    def _attr(self, inode: int) -> pyfuse3.EntryAttributes:
        if self.table.is_root(inode):
            return self._root_attr()
        if inode == CONTROL_INODE:  # seen only until the control mount covers it
            return self._dir_attr(CONTROL_INODE, DATASET_TIMEOUT)
        ds, node = self._resolve(inode)
        return self._node_attr(ds, node)

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext | None = None
                      ) -> pyfuse3.EntryAttributes:
        return self._attr(inode)

    async def lookup(self, parent_inode: int, name: bytes,
                     ctx: pyfuse3.RequestContext | None = None) -> pyfuse3.EntryAttributes:
        text = os.fsdecode(name)
        if self.table.is_root(parent_inode):
            if text in (".", ".."):
                return self._root_attr()
            if text == CONTROL_NAME:
                return self._attr(CONTROL_INODE)
            ds = self.table.by_name.get(text)
            if ds is None:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self._node_attr(ds, 0)
        if parent_inode == CONTROL_INODE:
            raise pyfuse3.FUSEError(errno.ENOENT)
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

    async def readlink(self, inode: int, ctx: pyfuse3.RequestContext) -> bytes:
        ds, node = self._resolve(inode)
        if ds.pools is None or node != 0:
            raise pyfuse3.FUSEError(errno.EINVAL)
        return self._view_link(ds)

    # -- directories ------------------------------------------------------------------
    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        if self.table.is_root(inode):
            entries = [(CONTROL_NAME.encode(), CONTROL_INODE)]
            entries += [(ds.name.encode(), ds.inode_base) for ds in self.table.visible_to(ctx.uid)]
        elif inode == CONTROL_INODE:
            entries = []
        else:
            ds, node = self._resolve(inode)
            if ds.pools is not None or not ds.tree.is_dir(node):
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
        if self.no_open:
            raise pyfuse3.FUSEError(errno.ENOSYS)  # no OPEN nor RELEASE from now on
        if flags & os.O_ACCMODE != os.O_RDONLY:
            raise pyfuse3.FUSEError(errno.EROFS)
        ds, node = self._resolve(inode)
        if ds.pools is not None or ds.tree.is_dir(node):
            raise pyfuse3.FUSEError(errno.EISDIR)
        fh = next(self._fh)
        self._files[fh] = _OpenFile(ds, ds.tree.entry_index(node),
                                    self.push.opened(inode))
        # Content per inode never changes, so the kernel may keep its pages; a re-read
        # it serves from its page cache costs mountd an open and a release, nothing more.
        if self.direct_opens:
            return pyfuse3.FileInfo(fh=fh, keep_cache=False, direct_io=True)
        return pyfuse3.FileInfo(fh=fh, keep_cache=True, direct_io=False)

    async def read(self, fh: int, off: int, size: int, inode: int | None = None
                   ) -> bytes | memoryview:
        if inode is not None:
            return await self._read_inode(inode, off, size)
        f = self._files[fh]
        if f.data is None:
            if f.failed:  # one fetch attempt per open, however often the kernel retries
                raise pyfuse3.FUSEError(errno.EIO)
            try:
                f.data = await self.reader.read(f.ds, f.index)
            except ReadFailed:
                f.failed = True
                raise pyfuse3.FUSEError(errno.EIO) from None
        return memoryview(f.data)[off:off + size]  # no copy: pyfuse3 takes any buffer

    async def _read_inode(self, inode: int, off: int, size: int) -> bytes | memoryview:
        """A no-open READ: the item's bytes, kept between the READs of a file that takes
        more than one, until its last byte is read."""
        data = self._reading.get(inode)
        if data is None:
            ds, node = self._resolve(inode)
            if ds.pools is not None or ds.tree.is_dir(node):
                raise pyfuse3.FUSEError(errno.EISDIR)
            if self._recently_failed(inode):
                raise pyfuse3.FUSEError(errno.EIO)
            self.push.read_reached(inode)  # the reader counts this read, not a push
            try:
                data = await self.reader.read(ds, ds.tree.entry_index(node))
            except ReadFailed:
                self._failed.pop(inode, None)
                self._failed[inode] = time.monotonic()
                raise pyfuse3.FUSEError(errno.EIO) from None
            if off + size < len(data) and inode not in self._reading:
                self._keep_reading(inode, data)
        elif off + size >= len(data):
            self._reading_bytes -= len(self._reading.pop(inode))
        return memoryview(data)[off:off + size]

    def forget_reading(self, inodes: list[int]) -> None:
        """Drop the bytes kept between the READs of these files (their item is dropped
        from the store: their next READs fetch it again)."""
        for inode in inodes:
            data = self._reading.pop(inode, None)
            if data is not None:
                self._reading_bytes -= len(data)

    def _recently_failed(self, inode: int) -> bool:
        now = time.monotonic()
        while self._failed and now - next(iter(self._failed.values())) > FAILED_HOLD:
            self._failed.popitem(last=False)
        return inode in self._failed

    def _keep_reading(self, inode: int, data: bytes) -> None:
        self._reading[inode] = data
        self._reading_bytes += len(data)
        while self._reading_bytes > READING_BYTES:
            _, dropped = self._reading.popitem(last=False)
            self._reading_bytes -= len(dropped)

    async def release(self, fh: int) -> None:
        f = self._files.pop(fh, None)
        if f is None:
            return
        reached = f.data is not None or f.failed  # a READ reached us
        if f.pushed:
            self.push.released(f.ds, f.index, reached)
        elif not reached:
            # opened and closed without a read reaching us: the kernel's page cache
            # served it (keep_cache), or nothing was read
            self.stats.count(f.ds, ReadCounter.PAGE_CACHE_OPENS)

    async def _read_only(self, *args: object) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    create = mknod = unlink = rename = symlink = link = mkdir = rmdir = _read_only
    setattr = write = _read_only

    # -- metadata ---------------------------------------------------------------------
    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        if name != XATTR_HASH or self.table.is_root(inode) or inode == CONTROL_INODE:
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        ds, node = self._resolve(inode)
        if ds.tree.is_dir(node) or ds.pools is not None:  # a view's path has no one content
            raise pyfuse3.FUSEError(pyfuse3.ENOATTR)
        return ds.digest.hash(ds.tree.entry_index(node)).hex().encode()

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        found = None if self.table.is_root(inode) else self.table.resolve(inode)
        if found is None or found[0].pools is not None or found[0].tree.is_dir(found[1]):
            return []
        return [XATTR_HASH]

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        store = self.store
        volume = await trio.to_thread.run_sync(store.volume, limiter=self.limiter)
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
        fs.stats.fuse_requests[name] += 1
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

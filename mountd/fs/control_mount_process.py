"""The process that serves ``ROOT/.quiver``'s FUSE connection for mountd.

pyfuse3 serves one FUSE connection per process, and the datasets' connection runs
without OPEN (mountd.fs.datasets_fs), so the files that need per-open state are mounted by this
child of mountd on ``ROOT/.quiver``. It forwards every request, with who sent it, over
a socket mountd made (mountd.fs.control_mount answers it with mountd.fs.control_fs) and
replies with the answer. It holds no state of its own and trusts nothing but mountd.

    python -m mountd.fs.control_mount_process FD MOUNTPOINT [--forward]

With ``--forward`` (mountd's native plane serves), once mounted this process sends
mountd the byte ``F`` with two descriptors (SCM_RIGHTS): its connection's ``/dev/fuse``
and one end of a new stream socket. mountd's plane then reads the connection, answers
the cached opens of view files itself (mountd.fs.native_views) and forwards every other
request, whole, to that socket, from which this process's session reads (custom I/O of
mountd.native._dataplane); replies still go to ``/dev/fuse``. Where it cannot, it sends
``N`` and reads ``/dev/fuse`` itself.

Wire: msgpack, each way a stream of arrays. Requests ``[id, op, args, who]`` (``who``
is ``[uid, gid, pid, umask]`` or None), replies ``[id, errno, result]`` (errno 0 for a
result). This process says ``[0, "mounted", []]`` once the mount is made, and tells of
a view file's release as a note, ``[NOTE_ID, "release", [fh], None]``, which has no
reply.

Each request to mountd is a round trip between two processes, the costliest part of a
view file's open. So the reply to an OPEN of a view file carries what its fstat says
and, where it serves a cached item, its bytes: this process answers that file's
GETATTRs from the opening process (by pid and inode, as mountd does) and its READs
itself until its release. A LOOKUP's or GETATTR's reply is ``[attributes, fixed]``:
where mountd says they are fixed (a view file's own), this process answers the
inode's GETATTRs with them from then on (the kernel asks before every open: a view
file's attributes are never cached there, since an open file's are the served
item's).
"""
from __future__ import annotations

import errno
import itertools
import logging
import signal
import socket
import sys
from typing import Any

import msgpack
import pyfuse3
import trio

from mountd.fs.fuse_limits import FUSE_TASKS, tune_connection
from quiverfs.mount_point import mount_device

log = logging.getLogger(__name__)

ATTR_FIELDS = ("st_ino", "generation", "entry_timeout", "attr_timeout", "st_mode",
               "st_nlink", "st_uid", "st_gid", "st_rdev", "st_size", "st_blksize",
               "st_blocks", "st_atime_ns", "st_ctime_ns", "st_mtime_ns")
READDIR_BATCH = 256  # entries asked of mountd per READDIR
MAX_MESSAGE = 64 << 20  # a reply larger than this is mountd's bug: end the connection
NOTE_ID = -1  # the id of a request that has no reply
NOTES = frozenset({"release"})  # the requests sent as notes
NOTE_DELAY = 0.05  # seconds a note may wait to go with a request (else it goes alone)
MAX_FIXED = 1 << 17  # view files' attributes kept here; past that, all are forgotten
FORWARD_FLAG = "--forward"
FORWARDING, NOT_FORWARDING = b"F", b"N"  # what this process says first with --forward


def attr_to_wire(attr: pyfuse3.EntryAttributes) -> list[Any]:
    return [getattr(attr, name) for name in ATTR_FIELDS]


def attr_from_wire(values: list[Any]) -> pyfuse3.EntryAttributes:
    attr = pyfuse3.EntryAttributes()
    for name, value in zip(ATTR_FIELDS, values, strict=True):
        setattr(attr, name, value)
    return attr


def _who(ctx: pyfuse3.RequestContext) -> list[int]:
    return [ctx.uid, ctx.gid, ctx.pid, ctx.umask]


class _Link:
    """Requests to mountd and their replies, matched by id."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel] = {}
        self._send_lock = trio.Lock()
        self._notes: list[bytes] = []  # notes not sent yet, packed
        self._noted = trio.Event()  # set while there are some

    def _with_notes(self, message: bytes) -> bytes:
        """``message`` after the notes not sent yet: mountd does them first."""
        if not self._notes:
            return message
        notes, self._notes = self._notes, []
        return b"".join(notes) + message

    async def call(self, op: str, *args: Any, ctx: pyfuse3.RequestContext | None = None
                   ) -> Any:
        rid = next(self._ids)
        send, receive = trio.open_memory_channel[list[Any]](1)
        self._waiting[rid] = send
        try:
            async with self._send_lock:
                await self.stream.send_all(self._with_notes(msgpack.packb(
                    [rid, op, list(args), None if ctx is None else _who(ctx)])))
            _, err, result = await receive.receive()
        except (trio.BrokenResourceError, trio.EndOfChannel, trio.ClosedResourceError):
            raise pyfuse3.FUSEError(errno.ENOTCONN) from None
        finally:
            self._waiting.pop(rid, None)
        if err:
            raise pyfuse3.FUSEError(err)
        return result

    async def receive_replies(self) -> None:
        """Hand each reply to its caller until mountd closes the socket."""
        unpacker = msgpack.Unpacker(max_buffer_size=MAX_MESSAGE)
        while data := await self.stream.receive_some(1 << 20):
            unpacker.feed(data)
            for reply in unpacker:
                send = self._waiting.get(reply[0])
                if send is not None:
                    send.send_nowait(reply)
        for send in self._waiting.values():
            send.close()

    async def say(self, what: str) -> None:
        async with self._send_lock:
            await self.stream.send_all(msgpack.packb([0, what, [], None]))

    def note(self, op: str, *args: Any) -> None:
        """Tell mountd of ``op`` (one of NOTES), expecting no reply: with the next
        request, or alone after NOTE_DELAY (send_notes). A view file's release costs a
        message of its own no more than every NOTE_DELAY."""
        self._notes.append(msgpack.packb([NOTE_ID, op, list(args), None]))
        self._noted.set()

    async def send_notes(self) -> None:
        """The notes that no request took along within NOTE_DELAY, until mountd is gone."""
        while True:
            await self._noted.wait()
            await trio.sleep(NOTE_DELAY)
            self._noted = trio.Event()
            try:
                async with self._send_lock:
                    if self._notes:
                        await self.stream.send_all(self._with_notes(b""))
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return  # mountd is gone: so is what the notes were about


class _Opened:
    """An open view file, as mountd's reply to its OPEN described it."""

    __slots__ = ("opener", "attr", "data")

    def __init__(self, opener: tuple[int, int], attr: pyfuse3.EntryAttributes,
                 data: bytes | None) -> None:
        self.opener = opener  # (pid, inode) of the open
        self.attr = attr  # what its fstat says
        self.data = data  # the bytes it serves, where mountd handed them over


class ForwardingOperations(pyfuse3.Operations):
    """Every request of this connection, asked of mountd."""

    supports_dot_lookup = False  # "." and ".." are the kernel's (a mount's root above all)

    link: _Link  # set once trio runs

    def __init__(self) -> None:
        super().__init__()
        self.initialized = trio.Event()  # the kernel's INIT answered: its settings are made
        self._opened: dict[int, _Opened] = {}  # fh -> an open view file
        # (pid, inode) -> the handle of that process's latest open of a view file: its
        # fstat (a GETATTR by inode) answers for the item it got (mountd's rule)
        self._served: dict[tuple[int, int], int] = {}
        # inode -> a view file's own attributes, which mountd said are fixed (as long as
        # the inode lives: mountd never uses an inode again); asked again after MAX_FIXED
        self._fixed: dict[int, pyfuse3.EntryAttributes] = {}

    def _entry(self, reply: list[Any]) -> pyfuse3.EntryAttributes:
        """The attributes of a LOOKUP's or GETATTR's reply, kept where mountd says they
        are fixed."""
        values, fixed = reply
        attr = attr_from_wire(values)
        if fixed:
            if len(self._fixed) >= MAX_FIXED:
                self._fixed.clear()
            self._fixed[attr.st_ino] = attr
        return attr

    def init(self) -> None:
        self.initialized.set()

    async def lookup(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                     ) -> pyfuse3.EntryAttributes:
        return self._entry(await self.link.call("lookup", parent_inode, name, ctx=ctx))

    async def getattr(self, inode: int, ctx: pyfuse3.RequestContext
                      ) -> pyfuse3.EntryAttributes:
        opened = self._opened.get(self._served.get((ctx.pid, inode), 0))
        if opened is not None:
            return opened.attr
        fixed = self._fixed.get(inode)
        if fixed is not None:
            return fixed
        return self._entry(await self.link.call("getattr", inode, ctx=ctx))

    async def setattr(self, inode: int, attr: pyfuse3.EntryAttributes,
                      fields: pyfuse3.SetattrFields, fh: int | None,
                      ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return attr_from_wire(await self.link.call("setattr", inode, ctx=ctx))

    async def opendir(self, inode: int, ctx: pyfuse3.RequestContext) -> int:
        return await self.link.call("opendir", inode, ctx=ctx)

    async def readdir(self, fh: int, start_id: int, token: pyfuse3.ReaddirToken) -> None:
        while True:
            entries = await self.link.call("readdir", fh, start_id, READDIR_BATCH)
            for name, attr, next_id in entries:
                if not pyfuse3.readdir_reply(token, name, attr_from_wire(attr), next_id):
                    return
                start_id = next_id
            if len(entries) < READDIR_BATCH:
                return

    async def releasedir(self, fh: int) -> None:
        await self.link.call("releasedir", fh)

    async def open(self, inode: int, flags: int, ctx: pyfuse3.RequestContext
                   ) -> pyfuse3.FileInfo:
        fh, direct_io, keep_cache, served = await self.link.call("open", inode, flags,
                                                                 ctx=ctx)
        if served is not None:  # a view file
            opener = (ctx.pid, inode)
            self._opened[fh] = _Opened(opener, attr_from_wire(served[0]), served[1])
            self._served[opener] = fh
        return pyfuse3.FileInfo(fh=fh, direct_io=direct_io, keep_cache=keep_cache)

    async def read(self, fh: int, off: int, size: int) -> bytes:
        opened = self._opened.get(fh)
        if opened is not None and opened.data is not None:
            return opened.data[off:off + size]
        return await self.link.call("read", fh, off, size)

    async def write(self, fh: int, off: int, buf: bytes) -> int:
        return await self.link.call("write", fh, off, buf)

    async def release(self, fh: int) -> None:
        opened = self._opened.pop(fh, None)
        if opened is None:  # a control file
            await self.link.call("release", fh)
            return
        if self._served.get(opened.opener) == fh:
            del self._served[opened.opener]
        self.link.note("release", fh)  # a view file's: the kernel need not wait

    async def mkdir(self, parent_inode: int, name: bytes, mode: int,
                    ctx: pyfuse3.RequestContext) -> pyfuse3.EntryAttributes:
        return attr_from_wire(await self.link.call("mkdir", parent_inode, name, mode, ctx=ctx))

    async def rmdir(self, parent_inode: int, name: bytes, ctx: pyfuse3.RequestContext
                    ) -> None:
        await self.link.call("rmdir", parent_inode, name, ctx=ctx)

    async def getxattr(self, inode: int, name: bytes, ctx: pyfuse3.RequestContext) -> bytes:
        return await self.link.call("getxattr", inode, name, ctx=ctx)

    async def listxattr(self, inode: int, ctx: pyfuse3.RequestContext) -> list[bytes]:
        return await self.link.call("listxattr", inode, ctx=ctx)

    async def statfs(self, ctx: pyfuse3.RequestContext) -> pyfuse3.StatvfsData:
        data = pyfuse3.StatvfsData()
        data.f_bsize = data.f_frsize = 4096
        data.f_namemax = 255
        return data

    async def _read_only(self, *args: object) -> None:
        raise pyfuse3.FUSEError(errno.EROFS)

    create = mknod = unlink = rename = symlink = link = _read_only


async def _serve(ops: ForwardingOperations, sock: socket.socket, mountpoint: str) -> None:
    link = ops.link = _Link(trio.SocketStream(trio.socket.from_stdlib_socket(sock)))
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_until_closed, link)
        nursery.start_soon(link.send_notes)
        nursery.start_soon(_on_signals)
        nursery.start_soon(_tune_kernel, ops, mountpoint)
        await link.say("mounted")
        # as many request tasks as the datasets' connection: a uid's reads waiting for
        # fetches (a view file's miss) hold at most WAITING_READS_PER_UID of them
        await pyfuse3.main(min_tasks=1, max_tasks=FUSE_TASKS)
        nursery.cancel_scope.cancel()


async def _tune_kernel(ops: ForwardingOperations, mountpoint: str) -> None:
    """Once INIT is answered, this connection's limits (mountd.fs.fuse_limits), like
    the datasets'. Its files are read with direct I/O: only what the kernel sends in the
    background (releases, asynchronous direct reads) counts against max_background."""
    await ops.initialized.wait()
    device = await trio.to_thread.run_sync(mount_device, mountpoint)
    if device is not None:
        await trio.to_thread.run_sync(tune_connection, device)


async def _until_closed(link: _Link) -> None:
    try:
        await link.receive_replies()
    except (trio.BrokenResourceError, msgpack.ExtraData, ValueError) as exc:
        log.error("the link to mountd failed: %s", exc)
    pyfuse3.terminate()  # mountd is gone: nobody can answer


async def _on_signals() -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
        async for _ in sigs:
            pyfuse3.terminate()


def _forward(sock: socket.socket) -> Any:
    """Hand mountd this connection (FORWARD_FLAG): its /dev/fuse descriptor, and a
    socket whose other end this session reads its requests from from now on. The native
    module, or None where it cannot (mountd is told, and this process reads /dev/fuse)."""
    try:
        from mountd.native import _dataplane  # noqa: PLC0415 (built by make; optional)
    except ImportError as exc:
        log.warning("the native data plane is not available here (%s)", exc)
        sock.sendall(NOT_FORWARDING)
        return None
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with theirs:
        try:
            dev = _dataplane.forward_session(pyfuse3.session_address(), ours.fileno())
        except (OSError, RuntimeError) as exc:
            log.warning("cannot forward this connection to mountd (%s)", exc)
            ours.close()
            sock.sendall(NOT_FORWARDING)
            return None
        ours.detach()  # the session's now
        socket.send_fds(sock, [FORWARDING], [dev, theirs.fileno()])
    return _dataplane


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s control-mount %(levelname)s %(message)s")
    fd, mountpoint = int(argv[0]), argv[1]
    sock = socket.socket(fileno=fd)
    options = set(pyfuse3.default_options)
    options |= {"fsname=quiver-control", "subtype=quiver", "allow_other"}
    ops = ForwardingOperations()
    pyfuse3.init(ops, mountpoint, options)
    forwarding = _forward(sock) if FORWARD_FLAG in argv[2:] else None
    try:
        trio.run(_serve, ops, sock, mountpoint)
    finally:
        if forwarding is not None:
            forwarding.forward_close()  # before the unmount, as libfuse does
        pyfuse3.close(unmount=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

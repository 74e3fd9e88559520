"""mountd's side of the ``ROOT/.quiver`` connection: the child process that mounts it
(mountd.fs.control_mount_process), and its requests answered by mountd.fs.control_fs.

The child is started once the datasets' connection serves (its mount looks ``.quiver``
up there) and stopped before that connection ends (its unmount does too). Should it
end on its own, its mount is detached and a new one started, again until one mounts.
Where the native plane serves (mountd.fs.native_views), the child hands mountd its
connection's descriptor before it says it is mounted, and the plane reads the
connection, forwarding to the child what it does not answer.
"""
from __future__ import annotations

import errno
import logging
import os
import signal
import socket
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgpack
import pyfuse3
import trio

from mountd.fs.control_fs import ControlFS
from mountd.fs.control_mount_process import (FORWARD_FLAG, FORWARDING, MAX_MESSAGE, NOTE_ID,
                                             NOTES, attr_to_wire)
from mountd.fs.job_files import CONTROL_INODE
from mountd.fs.native_views import NativeViews
from quiverfs.errors import ExitCode, QuietError
from quiverfs.failure_runs import FailureRuns
from quiverfs.fs_identity import refuse_mount
from quiverfs.job_protocol import CONTROL_NAME

log = logging.getLogger(__name__)

START_TIMEOUT = 30.0  # seconds for the child's mount to appear
STOP_TIMEOUT = 10.0  # seconds for it to unmount and exit before it is killed
RESTART_DELAY = 1.0


class _Who:
    """A request's sender, as the child saw it in its RequestContext."""

    __slots__ = ("uid", "gid", "pid", "umask")

    def __init__(self, uid: int, gid: int, pid: int, umask: int) -> None:
        self.uid, self.gid, self.pid, self.umask = uid, gid, pid, umask


def _inode(inode: int) -> int:
    """The connection's root is mountd's CONTROL_INODE."""
    return CONTROL_INODE if inode == pyfuse3.ROOT_INODE else inode


def _attr(attr: pyfuse3.EntryAttributes) -> list[Any]:
    values = attr_to_wire(attr)
    if values[0] == CONTROL_INODE:
        values[0] = pyfuse3.ROOT_INODE
    return values


class ControlMount:
    """Runs the child that mounts ``ROOT/.quiver`` and answers its requests."""

    def __init__(self, root: str, fs: ControlFS, requests: Counter[str]) -> None:
        self.mountpoint = os.path.join(root, CONTROL_NAME)
        self.fs = fs
        self.requests = requests  # counted by opcode, "control." before it
        self._proc: trio.Process | None = None
        self._stopping = False
        self._mounted = False  # the child said its mount is made
        self._running = False  # run() is under way: stop() waits for it to return
        self._ended = trio.Event()  # run() returned
        self._failures = FailureRuns(log)  # "serve" (a child) and "detach": retried
        self.native: NativeViews | None = None  # reads the connection, where it serves

    async def run(self, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the connection until stopped; started once it is mounted. Failing to
        mount it the first time is mountd's failure: it does not run without ``.quiver``.
        After that, a child that ends or fails is logged (once in a run of failures) and a
        new one started: left to propagate, a failure would end mountd for every user."""
        self._running = True
        try:
            await self._restarts(task_status)
        finally:
            self._ended.set()

    async def _restarts(self, task_status: trio.TaskStatus) -> None:
        """run()'s loop: a child, and a new one each time it ends, until stopped."""
        started = False

        def mounted() -> None:
            nonlocal started
            # each child's mount is a new device: a dataset's files there would be read
            # by the workers that serve them
            refuse_mount(self.mountpoint)
            if started:
                log.info("%s is mounted again", self.mountpoint)
            else:
                started = True
                task_status.started()
            self._failures.succeeded("serve")

        while True:
            try:
                code = await self._serve_child(mounted)
            except Exception:
                if not started:
                    raise
                if self._stopping:
                    return  # stop() ended a new child before it mounted
                self._failures.failed("serving %s failed; trying again in %g s",
                                      self.mountpoint, RESTART_DELAY, key="serve")
            else:
                if self._stopping:
                    return
                log.error("the process serving %s ended (exit status %s): mounting it again",
                          self.mountpoint, code)
            self.fs.connection_ended()
            await self._detach()
            await trio.sleep(RESTART_DELAY)
            if self._stopping:
                return

    async def _serve_child(self, mounted: Callable[[], object]) -> int:
        """Start a child, call ``mounted`` once its mount is made and answer its requests
        until it ends; its exit status. Raises when it cannot start or does not mount."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        native = self.native
        with ours:
            with theirs:
                self._proc = await trio.lowlevel.open_process(
                    [sys.executable, "-m", "mountd.fs.control_mount_process",
                     str(theirs.fileno()), self.mountpoint,
                     *([FORWARD_FLAG] if native is not None else [])],
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True)  # a terminal's ^C is mountd's to pass on
            if self._stopping:  # stop() came while it started, and saw the one before
                await self._end(self._proc)
                await self._detach()  # should it have mounted before it ended
                return self._proc.returncode
            try:
                if native is not None and not await self._take_connection(ours, native):
                    native = None
                made = await self._answer_child(ours, mounted)
            except BaseException:
                if native is not None and native.serving:
                    native.stop()
                raise
        try:
            code = await self._proc.wait()
        finally:
            if native is not None and native.serving:
                native.stop()  # the connection is gone with the child
        if not made:  # raised out of the nursery: not wrapped in an ExceptionGroup
            raise QuietError(f"cannot mount {self.mountpoint}: see the log", ExitCode.MOUNT)
        return code

    async def _take_connection(self, ours: socket.socket, native: NativeViews) -> bool:
        """The child's connection, for the native plane to read: whether it does. A
        child that hands none reads it itself; where the plane cannot take it, the child
        is ended (its session would wait for requests from the plane) and the next one
        reads its connection itself."""
        with trio.move_on_after(START_TIMEOUT):
            await trio.lowlevel.wait_readable(ours)
        try:
            said, fds, _, _ = socket.recv_fds(ours, 1, 2,
                                              socket.MSG_CMSG_CLOEXEC | socket.MSG_DONTWAIT)
        except OSError:  # nothing within START_TIMEOUT: the mount's wait says why
            return False
        if said != FORWARDING or len(fds) != 2:
            for fd in fds:
                os.close(fd)
            return False
        if native.start(fds[0], fds[1]):
            return True
        self.native = None
        if self._proc is not None:
            self._proc.kill()
        return False

    async def _answer_child(self, ours: socket.socket, mounted: Callable[[], object]) -> bool:
        """Answer the child's requests until it closes the socket, calling ``mounted``
        once it says it is mounted; whether it did (else it is killed)."""
        stream = trio.SocketStream(trio.socket.from_stdlib_socket(ours))
        self._mounted = False
        said = trio.Event()  # mounted, or the child ended first
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._answer, stream, said)
            with trio.move_on_after(START_TIMEOUT):
                await said.wait()
            made = self._mounted
            if made:
                mounted()
            else:
                self._proc.kill()  # its end of the socket closes: _answer ends
        return made

    async def stop(self) -> None:
        """Unmount ``ROOT/.quiver`` (the child does) and wait for the child to end, and
        for run() to return: a restart under way (its child starting while the one before
        is seen dead here) ends the child it started."""
        self._stopping = True
        proc = self._proc
        if proc is not None and proc.returncode is None:
            await self._end(proc)
        if self._running:
            # bounded: mountd's unmount must not wait on a restart that hangs
            with trio.move_on_after(2 * STOP_TIMEOUT):
                await self._ended.wait()
                return
            log.error("the restart of the process serving %s did not end", self.mountpoint)

    async def _end(self, proc: trio.Process) -> None:
        """Ask the child to unmount and end; killed, and its mount detached, if it does
        not within STOP_TIMEOUT."""
        proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(STOP_TIMEOUT):
            await proc.wait()
            return
        log.error("the process serving %s did not end: killed", self.mountpoint)
        proc.kill()
        await proc.wait()
        await self._detach()

    async def _detach(self) -> None:
        """Lazily unmount whatever is left at the mountpoint. Without fusermount3 that is
        logged, once in a run of restarts: a dead mount left there fails the next start,
        which is tried again."""
        try:
            await trio.to_thread.run_sync(lambda: subprocess.run(
                ["fusermount3", "-u", "-z", self.mountpoint], capture_output=True,
                check=False))
        except OSError:  # no fusermount3 on this system
            self._failures.failed("cannot detach %s with fusermount3", self.mountpoint,
                                  key="detach")
        else:
            self._failures.succeeded("detach")

    async def _answer(self, stream: trio.SocketStream, said: trio.Event) -> None:
        """Answer the child's requests until it closes the socket (it ended); set
        ``said`` once it has mounted, or when it ends before."""
        unpacker = msgpack.Unpacker(max_buffer_size=MAX_MESSAGE)
        send_lock = trio.Lock()
        async with trio.open_nursery() as nursery:
            try:
                while data := await stream.receive_some(1 << 20):
                    unpacker.feed(data)
                    for rid, op, args, who in unpacker:
                        if rid == 0:
                            if op == "mounted":
                                self._mounted = True
                                said.set()
                            continue
                        if rid == NOTE_ID:  # done before the requests that follow it
                            await self._noted(op, args)
                            continue
                        nursery.start_soon(self._reply, stream, send_lock, rid, op, args, who)
            except (trio.BrokenResourceError, ValueError, TypeError) as exc:
                log.error("the link to the process serving %s failed: %s",
                          self.mountpoint, exc)
            nursery.cancel_scope.cancel()
        said.set()

    async def _reply(self, stream: trio.SocketStream, send_lock: trio.Lock, rid: int,
                     op: str, args: list[Any], who: list[int] | None) -> None:
        self.requests[f"control.{op}"] += 1
        try:
            result = await self._dispatch(op, args, None if who is None else _Who(*who))
            err = 0
        except pyfuse3.FUSEError as exc:
            result, err = None, exc.errno
        except Exception:
            log.exception("FUSE control.%s failed: answered EIO", op)
            result, err = None, errno.EIO
        try:
            answer = msgpack.packb([rid, err, result])
        except (TypeError, ValueError, OverflowError):  # a bug here: left to propagate,
            # it would end the link, and the child serving every user's ``.quiver``
            log.exception("FUSE control.%s: its answer cannot be sent: answered EIO", op)
            answer = msgpack.packb([rid, errno.EIO, None])
        try:
            async with send_lock:
                await stream.send_all(answer)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # the child is gone; its kernel request went with it

    async def _noted(self, op: str, args: list[Any]) -> None:
        """A request the child answered itself and told of (a release): done here, with
        no reply. It waits for nothing (a release drops what mountd kept)."""
        self.requests[f"control.{op}"] += 1
        if op not in NOTES:
            log.error("the process serving %s sent a note of %r: ignored", self.mountpoint,
                      op)
            return
        try:
            await self._dispatch(op, args, None)
        except pyfuse3.FUSEError:
            pass  # the kernel has its answer already
        except Exception:
            log.exception("FUSE control.%s (noted) failed", op)

    async def _dispatch(self, op: str, args: list[Any], who: _Who | None) -> Any:
        fs = self.fs
        if op == "lookup":
            attr = await fs.lookup(_inode(args[0]), args[1], who)
            return [_attr(attr), who is not None and fs.fixed(attr.st_ino, who)]
        if op == "getattr":
            attr = await fs.getattr(_inode(args[0]), who)
            return [_attr(attr), who is not None and fs.fixed(attr.st_ino, who)]
        if op == "setattr":
            return _attr(await fs.setattr(_inode(args[0]), who))
        if op == "opendir":
            return await fs.opendir(_inode(args[0]), who)
        if op == "readdir":
            return [[name, _attr(attr), nxt]
                    for name, attr, nxt in fs.entries_from(args[0], args[1], args[2])]
        if op == "releasedir":
            return await fs.releasedir(args[0])
        if op == "open":
            info = await fs.open(_inode(args[0]), args[1], who)
            served = await fs.handover(info.fh)
            return [info.fh, info.direct_io, info.keep_cache,
                    None if served is None else [_attr(served[0]), served[1]]]
        if op == "read":
            return bytes(await fs.read(args[0], args[1], args[2]))
        if op == "write":
            return await fs.write(args[0], args[1], args[2])
        if op == "release":
            return await fs.release(args[0])
        if op == "mkdir":
            return _attr(await fs.mkdir(_inode(args[0]), args[1], args[2], who))
        if op == "rmdir":
            return await fs.rmdir(_inode(args[0]), args[1], who)
        if op == "getxattr":
            return await fs.getxattr(_inode(args[0]), args[1], who)
        if op == "listxattr":
            return await fs.listxattr(_inode(args[0]), who)
        raise pyfuse3.FUSEError(errno.ENOSYS)

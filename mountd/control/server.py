"""The local control socket: msgpack requests from ``quiver mount|umount|status``.

The caller's uid, gid and groups come from SO_PEERCRED, so a registration belongs to
the user who made it. A bad request gets an error reply, and so does a request that
finds a bug: the server stays up. Each uid may hold a bounded number of connections,
so no local user can take the daemon's descriptors.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import trio

from quiverfs import wire
from quiverfs.connection_slots import ConnectionSlots
from quiverfs.errors import ExitCode, QuietError
from quiverfs.fs_identity import UserIdentity

log = logging.getLogger(__name__)

_UCRED = struct.Struct("3i")
MAX_CONNECTIONS = 512  # control connections open at once, all users together
MAX_CONNECTIONS_PER_UID = 16  # and of one uid (root is not limited)
# Bytes of request frames held at once, from the header's arrival until the request is
# answered (a frame is held about twice over while it is decoded: its body, and the
# digest's bytes copied out of it): one uid's (root is not limited) and all users'. A
# frame waits for room. Frames under SMALL_FRAME are not counted: the connections bound
# them.
FRAME_BYTES_PER_UID = wire.MAX_FRAME
FRAME_BYTES_TOTAL = 4 * wire.MAX_FRAME
SMALL_FRAME = 1 << 20
FRAME_TIMEOUT = 60.0  # seconds a counted frame's body may take to arrive
# What a request may decode to: a map of a few fields, one of them a map (a key file's
# credentials, a few KiB), and the digest as bytes. Anything else is refused as it is
# decoded, at once and before it takes more memory than the frame's bytes. It is decoded
# on the loop: msgpack holds the GIL for a whole message, so a worker thread would free
# nothing, and what it decoded would stay in that thread's malloc arena.
REQUEST_LIMITS = wire.Limits(max_array_len=64, max_map_len=64, max_str_len=64 << 10,
                             max_bin_len=wire.MAX_FRAME, max_ext_len=0,
                             container_bytes=64 << 10)


@dataclasses.dataclass(frozen=True)
class Peer:
    """Who is on the other end of a control connection."""

    pid: int
    uid: int
    gid: int
    groups: frozenset[int]

    @property
    def user(self) -> UserIdentity:
        return UserIdentity(self.uid, self.gid, tuple(sorted(self.groups)))


Handler = Callable[[Peer, dict[str, Any]], Awaitable[dict[str, Any]]]


def peer_groups(pid: int, gid: int) -> frozenset[int]:
    """The supplementary groups of a connected process (from /proc), plus its gid."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return frozenset(groups)


class FrameBytes:
    """Bytes of large request frames held at once, per uid and in all."""

    def __init__(self, per_uid: int, total: int) -> None:
        self.per_uid = per_uid
        self.total = total
        self.held: collections.Counter[int] = collections.Counter()
        self._released = trio.Event()

    def _fits(self, uid: int, n: int) -> bool:
        return (sum(self.held.values()) + n <= self.total
                and (uid == 0 or self.held[uid] + n <= self.per_uid))

    @contextlib.asynccontextmanager
    async def hold(self, uid: int, n: int) -> AsyncIterator[None]:
        """Hold ``n`` bytes for ``uid`` in the body, once they fit (small frames at once)."""
        if n < SMALL_FRAME:
            yield
            return
        while not self._fits(uid, n):
            await self._released.wait()
        self.held[uid] += n
        try:
            yield
        finally:
            self.held[uid] -= n
            if not self.held[uid]:
                del self.held[uid]
            self._released.set()
            self._released = trio.Event()


def peer_of(sock: trio.socket.SocketType) -> Peer:
    pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    return Peer(pid, uid, gid, peer_groups(pid, gid))


class ControlServer:
    """Serves one request per frame on a unix socket, dispatching by ``op``."""

    def __init__(self, path: str, handlers: dict[str, Handler],
                 frames: FrameBytes | None = None, frame_timeout: float = FRAME_TIMEOUT
                 ) -> None:
        self.path = path
        self.handlers = handlers
        self._slots = ConnectionSlots(MAX_CONNECTIONS_PER_UID, MAX_CONNECTIONS)
        self.frames = frames or FrameBytes(FRAME_BYTES_PER_UID, FRAME_BYTES_TOTAL)
        self.frame_timeout = frame_timeout
        self._socket: socket.socket | None = None  # bound by ``bind``

    def bind(self) -> None:
        """Create the socket now, before the daemon mounts: a place that takes none
        fails the start with one line (PERMISSION)."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            directory = os.path.dirname(self.path)
            if not os.path.isdir(directory):
                os.makedirs(directory)
                os.chmod(directory, 0o755)  # past mountd's umask: every user reaches the socket
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
            sock.bind(self.path)
            os.chmod(self.path, 0o666)  # any local user may register their own datasets
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise QuietError(f"cannot create the control socket {self.path}: "
                             f"{exc.strerror or exc}: pick another --control-socket",
                             ExitCode.PERMISSION) from None
        self._socket = sock

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve requests on the socket ``bind`` created, removing it when done."""
        sock = trio.socket.from_stdlib_socket(self._socket)
        try:
            task_status.started()
            await trio.serve_listeners(self._connection, [trio.SocketListener(sock)])
        finally:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                peer = peer_of(stream.socket)
            except OSError:
                return  # gone before we could ask who it was
            with self._slots.hold(peer.uid, capped=peer.uid != 0) as admitted:
                if admitted:
                    await self._serve_peer(stream, peer)
                else:
                    await self._reply_error(stream, "too many control connections open: "
                                            "close some and try again", ExitCode.DAEMON)

    async def _serve_peer(self, stream: trio.SocketStream, peer: Peer) -> None:
        while True:
            try:
                length = await wire.recv_length(stream)
                async with self.frames.hold(peer.uid, length):
                    reply = await self._answer(stream, peer, length)
            except EOFError:
                return
            except wire.FrameError as exc:
                await self._reply_error(stream, str(exc), ExitCode.USAGE)
                return
            except trio.TooSlowError:
                await self._reply_error(stream, f"the request did not arrive within "
                                        f"{self.frame_timeout:g} s", ExitCode.USAGE)
                return
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            try:
                await wire.send_msg(stream, reply)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                return
            except (TypeError, ValueError, OverflowError):  # a reply msgpack cannot pack: a bug
                log.exception("control reply to uid %d cannot be sent", peer.uid)
                await self._reply_error(stream, "internal error: see mountd's log",
                                        ExitCode.DAEMON)

    async def _answer(self, stream: trio.SocketStream, peer: Peer, length: int
                      ) -> dict[str, Any]:
        """Receive a request of ``length`` bytes and answer it (its bytes are freed on
        return, with the room they held)."""
        with trio.fail_after(self.frame_timeout):
            body = await wire.recv_body(stream, length)
        return await self._dispatch(peer, body)

    async def _dispatch(self, peer: Peer, body: bytes | bytearray) -> dict[str, Any]:
        try:
            request = wire.unpack(body, REQUEST_LIMITS)
            if not isinstance(request, dict) or request.get("op") not in self.handlers:
                raise QuietError(f"unknown request (ops: {', '.join(sorted(self.handlers))})",
                                 ExitCode.USAGE)
            reply = await self.handlers[request["op"]](peer, request)
            return {"ok": True, **reply}
        except wire.FrameError as exc:
            return {"ok": False, "error": str(exc), "code": int(ExitCode.USAGE)}
        except QuietError as exc:
            return {"ok": False, "error": exc.message, "code": int(exc.exitcode)}
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "error": f"malformed request: {type(exc).__name__}: {exc}",
                    "code": int(ExitCode.USAGE)}
        except Exception as exc:  # a bug costs this request, not the daemon
            log.exception("control request from uid %d failed", peer.uid)
            return {"ok": False, "error": f"mountd failed on this request "
                    f"({type(exc).__name__}); see its log", "code": int(ExitCode.DAEMON)}

    @staticmethod
    async def _reply_error(stream: trio.SocketStream, message: str, code: ExitCode) -> None:
        try:
            await wire.send_msg(stream, {"ok": False, "error": message, "code": int(code)})
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass

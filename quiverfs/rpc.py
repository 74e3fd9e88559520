"""msgpack RPC over TCP for the cluster: peers and the coordinator.

A connection starts with mutual authentication against a shared cluster secret:
the server sends a random challenge, the client answers with HMAC-SHA256(secret,
challenge) and a challenge of its own, the server answers that. Nothing else is
served before. Then each frame (see ``quiverfs.wire``) is a request
``{"id", "op", "args"}`` or a reply ``{"id", "ok", "result" | "error"}``. Requests
are pipelined: a client may send many before reading replies, which come back by id.
A bad frame gets an error reply (and, when the stream cannot be trusted any more, the
connection is closed); the server stays up.

The port is reachable by anyone on the network, so connections that have not yet
authenticated are capped, overall and per source address: a flood of them is closed
at once instead of taking the daemon's file descriptors.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import logging
import os
import secrets
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from quiverfs import wire
from quiverfs.background import BackgroundTasks
from quiverfs.connection_slots import ConnectionSlots
from quiverfs.errors import ExitCode, QuietError
from quiverfs.heartbeat import MAX_CHUNKS, MAX_ENTRIES
from quiverfs.option_types import listen_error, parse_address

log = logging.getLogger(__name__)

MAGIC = b"quiver-rpc-1"
HANDSHAKE_TIMEOUT = 10.0  # seconds
MAX_FRAME = 64 << 20  # bytes: a batch of items, bounded
MAX_CONCURRENT = 64  # requests one connection may have in progress on a server
MAX_UNAUTHENTICATED = 256  # connections still in their handshake, all sources together
MAX_UNAUTHENTICATED_PER_HOST = 32  # and from one source address
MAX_AUTHENTICATED = 1024  # connections past the handshake (cluster members hold a few)
LISTEN_BACKLOG = 4096  # connections the kernel queues before accepting
# What a frame may decode to, sized to the largest messages: a heartbeat's lists of one
# number per chunk, its datasets by identity, a batch's items as bytes. Whatever its
# shape, a frame decodes to copies of its strings and bytes and at most MAX_FRAME bytes
# of arrays and maps (16 MiB of empty arrays once made 1.2 GB of lists).
LIMITS = wire.Limits(max_array_len=MAX_CHUNKS, max_map_len=MAX_ENTRIES,
                     max_str_len=1 << 20, max_bin_len=MAX_FRAME, max_ext_len=0,
                     container_bytes=MAX_FRAME)

Handler = Callable[[dict[str, Any]], Awaitable[Any]]


class RpcError(Exception):
    """The remote side answered with an error."""


class Unavailable(Exception):
    """The remote side cannot be reached (refused, closed, timed out, failed auth)."""


def load_secret(path: str | None) -> bytes:
    """The cluster secret from a file (or $QUIVER_CLUSTER_SECRET)."""
    if path:
        try:
            with open(path, "rb") as f:
                secret = f.read().strip()
        except OSError as exc:
            raise QuietError(f"cannot read cluster secret {path}: {exc.strerror}",
                             ExitCode.PERMISSION) from None
    else:
        secret = os.environ.get("QUIVER_CLUSTER_SECRET", "").encode()
    if len(secret) < 16:
        raise QuietError("a cluster secret of at least 16 bytes is required: pass "
                         "--cluster-secret-file FILE or set QUIVER_CLUSTER_SECRET",
                         ExitCode.USAGE)
    return secret


def _mac(secret: bytes, challenge: bytes, role: bytes) -> bytes:
    return hmac.new(secret, MAGIC + role + challenge, hashlib.sha256).digest()


class RpcServer:
    """Serves ``handlers[op](args)`` to authenticated clients."""

    def __init__(self, secret: bytes, handlers: dict[str, Handler],
                 max_frame: int = MAX_FRAME) -> None:
        self.secret = secret
        self.handlers = handlers
        self.max_frame = max_frame
        self._socket: socket.socket | None = None  # bound by ``bind``
        self.rejected = 0  # connections that failed authentication
        self._handshakes = ConnectionSlots(MAX_UNAUTHENTICATED_PER_HOST, MAX_UNAUTHENTICATED)
        self._sessions = ConnectionSlots(MAX_AUTHENTICATED, MAX_AUTHENTICATED)

    def bind(self, host: str, port: int, option: str) -> str:
        """Bind the server's port now, before the daemon starts serving (a taken port
        fails at once, with one line naming ``option``); the HOST:PORT bound."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            self._socket = socket.create_server((host, port), family=family,
                                                backlog=LISTEN_BACKLOG)
        except OSError as exc:  # the port is taken, or the host is not ours
            raise listen_error(option, host, port, exc) from None
        return f"{host}:{self._socket.getsockname()[1]}"

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Serve connections on the port ``bind`` took."""
        listener = trio.SocketListener(trio.socket.from_stdlib_socket(self._socket))
        task_status.started()
        await trio.serve_listeners(self._connection, [listener])

    async def _authenticate(self, stream: trio.SocketStream) -> bool:
        challenge = secrets.token_bytes(32)
        with trio.move_on_after(HANDSHAKE_TIMEOUT):
            try:
                await wire.send_msg(stream, {"challenge": challenge})
                hello = wire.unpack(await wire.recv_frame(stream, 4096))
                if (isinstance(hello, dict) and isinstance(hello.get("mac"), bytes)
                        and isinstance(hello.get("challenge"), bytes)
                        and hmac.compare_digest(hello["mac"],
                                                _mac(self.secret, challenge, b"client"))):
                    await wire.send_msg(stream, {"ok": True, "mac": _mac(
                        self.secret, hello["challenge"], b"server")})
                    return True
                await wire.send_msg(stream, {"ok": False, "error": "authentication failed"})
            except (EOFError, wire.FrameError, trio.BrokenResourceError):
                pass
        self.rejected += 1
        return False

    async def _connection(self, stream: trio.SocketStream) -> None:
        async with stream:
            try:
                host = str(stream.socket.getpeername()[0])
            except OSError:
                return  # gone already
            # over a cap, a connection is closed at once
            with self._handshakes.hold(host) as admitted:
                authenticated = admitted and await self._authenticate(stream)
            if authenticated:
                with self._sessions.hold(host) as admitted:
                    if admitted:
                        await self._serve_requests(stream)

    async def _serve_requests(self, stream: trio.SocketStream) -> None:
        send_lock = trio.Lock()
        slots = trio.Semaphore(MAX_CONCURRENT)
        async with trio.open_nursery() as nursery:
            while True:
                try:
                    body = await wire.recv_frame(stream, self.max_frame)
                except (EOFError, trio.BrokenResourceError, trio.ClosedResourceError):
                    break
                except wire.FrameError as exc:  # oversized: the stream is lost
                    await self._send(stream, send_lock, {"id": None, "ok": False,
                                                         "error": str(exc)})
                    break
                await slots.acquire()
                nursery.start_soon(self._request, stream, send_lock, slots, body)

    async def _request(self, stream: trio.SocketStream, send_lock: trio.Lock,
                       slots: trio.Semaphore, body: bytearray) -> None:
        try:
            reply = await self._dispatch(body)
            try:
                await self._send(stream, send_lock, reply)
            except (TypeError, ValueError, OverflowError):  # a result msgpack cannot pack
                log.exception("RPC reply to %r cannot be sent", reply.get("id"))
                await self._send(stream, send_lock, {"id": reply.get("id"), "ok": False,
                                                     "error": "internal error: reply"})
        finally:
            slots.release()

    async def _dispatch(self, body: bytearray) -> dict[str, Any]:
        rid = None
        try:
            request = wire.unpack(body, LIMITS)
            if not isinstance(request, dict):
                raise RpcError("a request must be a map")
            rid = request.get("id")
            if not isinstance(rid, int):  # echoed in the reply: nothing msgpack may refuse
                raise RpcError("a request's id must be an integer")
            handler = self.handlers.get(request.get("op"))  # type: ignore[arg-type]
            if handler is None:
                raise RpcError(f"unknown op {request.get('op')!r}")
            args = request.get("args", {})
            if not isinstance(args, dict):
                raise RpcError("args must be a map")
            return {"id": rid, "ok": True, "result": await handler(args)}
        except (wire.FrameError, RpcError, KeyError, TypeError, ValueError) as exc:
            return {"id": rid if isinstance(rid, int) else None, "ok": False,
                    "error": f"{type(exc).__name__}: {exc}"}
        except Exception as exc:  # a handler bug must cost one reply, not the server
            log.exception("RPC handler failed")
            return {"id": rid if isinstance(rid, int) else None, "ok": False,
                    "error": f"internal error: {type(exc).__name__}"}

    @staticmethod
    async def _send(stream: trio.SocketStream, lock: trio.Lock, msg: dict[str, Any]) -> None:
        async with lock:
            try:
                await wire.send_msg(stream, msg)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass


class RpcClient:
    """One authenticated, pipelined connection; ``tasks.run()`` must be running in a
    nursery (the connection's reader lives there)."""

    def __init__(self, host: str, port: int, secret: bytes, timeout: float = 30.0,
                 max_frame: int = MAX_FRAME,
                 connect_timeout: float = HANDSHAKE_TIMEOUT) -> None:
        self.host, self.port = host, port
        self.secret = secret
        self.timeout = timeout
        self.connect_timeout = connect_timeout  # seconds to connect and authenticate
        self.max_frame = max_frame
        self._stream: trio.SocketStream | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, trio.MemorySendChannel] = {}
        self._send_lock = trio.Lock()
        self._connect_lock = trio.Lock()
        self.tasks = BackgroundTasks()

    async def _connect(self) -> trio.SocketStream:
        async with self._connect_lock:
            if self._stream is not None:
                return self._stream
            if not self.tasks.running:
                raise Unavailable("client not running")
            try:
                with trio.fail_after(self.connect_timeout):
                    stream = await trio.open_tcp_stream(self.host, self.port)
                    stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    await client_handshake(stream, self.secret)
            except (OSError, trio.TooSlowError, EOFError, wire.FrameError,
                    trio.BrokenResourceError) as exc:
                raise Unavailable(f"{self.host}:{self.port}: {exc or type(exc).__name__}"
                                  ) from None
            self._stream = stream
            self.tasks.start_soon(self._reader, stream)
            return stream

    async def _reader(self, stream: trio.SocketStream) -> None:
        try:
            while True:
                reply = wire.unpack(await wire.recv_frame(stream, self.max_frame), LIMITS)
                rid = reply.get("id") if isinstance(reply, dict) else None
                # an id that is no call's (a list, say: unhashable) is ignored
                channel = self._waiting.pop(rid, None) if isinstance(rid, int) else None
                if channel is not None:
                    channel.send_nowait(reply)
        except (EOFError, wire.FrameError, trio.BrokenResourceError,
                trio.ClosedResourceError, OSError):
            pass
        finally:
            self._drop(stream)

    def _drop(self, stream: trio.SocketStream) -> None:
        if self._stream is stream:
            self._stream = None
        for channel in self._waiting.values():
            channel.send_nowait({"ok": False, "unavailable": True, "error": "connection lost"})
        self._waiting.clear()

    async def call(self, op: str, args: dict[str, Any] | None = None,
                   timeout: float | None = None) -> Any:
        """Send one request and wait for its reply (other calls may be in flight)."""
        stream = await self._connect()
        rid = next(self._ids)
        send, receive = trio.open_memory_channel[dict](1)
        self._waiting[rid] = send
        try:
            with trio.fail_after(timeout or self.timeout):
                async with self._send_lock:
                    await wire.send_msg(stream, {"id": rid, "op": op, "args": args or {}})
                reply = await receive.receive()
        except (trio.TooSlowError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            self._waiting.pop(rid, None)
            await self.close()
            raise Unavailable(f"{self.host}:{self.port}: {type(exc).__name__}") from None
        if reply.get("unavailable"):
            raise Unavailable(f"{self.host}:{self.port}: {reply['error']}")
        if not reply.get("ok"):
            raise RpcError(str(reply.get("error")))
        return reply.get("result")

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()


async def client_handshake(stream: trio.abc.Stream, secret: bytes) -> None:
    hello = wire.unpack(await wire.recv_frame(stream, 4096))
    if not isinstance(hello, dict) or not isinstance(hello.get("challenge"), bytes):
        raise wire.FrameError("no challenge from server")
    mine = secrets.token_bytes(32)
    await wire.send_msg(stream, {"mac": _mac(secret, hello["challenge"], b"client"),
                                 "challenge": mine})
    answer = wire.unpack(await wire.recv_frame(stream, 4096))
    if not (isinstance(answer, dict) and answer.get("ok") and isinstance(answer.get("mac"), bytes)
            and hmac.compare_digest(answer["mac"], _mac(secret, mine, b"server"))):
        raise wire.FrameError("server failed authentication (wrong cluster secret?)")


def call_once(address: str, secret: bytes, op: str, args: dict[str, Any] | None = None,
              timeout: float = 10.0) -> Any:
    """A blocking one-shot call, for the CLI."""
    host, port = parse_address(address)
    try:
        with socket.create_connection((host, port), timeout=timeout) as sock:
            hello = wire.sock_recv_msg(sock, 4096)
            mine = secrets.token_bytes(32)
            sock.sendall(wire.pack({"mac": _mac(secret, hello["challenge"], b"client"),
                                    "challenge": mine}))
            answer = wire.sock_recv_msg(sock, 4096)
            if not (answer.get("ok") and hmac.compare_digest(
                    answer.get("mac", b""), _mac(secret, mine, b"server"))):
                raise QuietError(f"{address} refused the cluster secret: check "
                                 "--cluster-secret-file", ExitCode.PERMISSION)
            sock.sendall(wire.pack({"id": 1, "op": op, "args": args or {}}))
            reply = wire.sock_recv_msg(sock)
    except (OSError, EOFError, wire.FrameError) as exc:
        raise QuietError(f"cannot reach {address}: {exc}", ExitCode.DAEMON) from None
    if not reply.get("ok"):
        raise QuietError(f"{address}: {reply.get('error')}", ExitCode.DAEMON)
    return reply["result"]

"""Length-prefixed msgpack frames, shared by the control socket and peer RPC.

A frame is a little-endian u32 length followed by that many bytes of msgpack.
Frames over the receiver's limit are refused before their body is read.
"""
from __future__ import annotations

import socket
import struct
from typing import Any

import msgpack
import trio

HEADER = struct.Struct("<I")
MAX_FRAME = 256 << 20  # a registration carries a whole digest (1.3 M entries ~ 110 MB)


class FrameError(Exception):
    """A frame that is oversized, truncated or not msgpack."""


def pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes) -> Any:
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False)
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise FrameError(f"not a msgpack message ({type(exc).__name__})") from None


def check_length(length: int, limit: int) -> None:
    if length > limit:
        raise FrameError(f"frame of {length} bytes exceeds the {limit}-byte limit")


async def _recv_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed mid-frame" if buf else "connection closed")
        buf += chunk
    return bytes(buf)


async def recv_length(stream: trio.abc.ReceiveStream, limit: int = MAX_FRAME) -> int:
    """Receive one frame's header: the length of its body, at most ``limit`` (EOFError
    when the peer closed cleanly between frames)."""
    (length,) = HEADER.unpack(await _recv_exactly(stream, HEADER.size))
    check_length(length, limit)
    return length


async def recv_body(stream: trio.abc.ReceiveStream, length: int) -> bytes:
    """Receive the ``length`` bytes of body that a frame's header announced."""
    return await _recv_exactly(stream, length)


async def recv_frame(stream: trio.abc.ReceiveStream, limit: int = MAX_FRAME) -> bytes:
    """Receive one frame's body (EOFError when the peer closed cleanly between frames)."""
    return await recv_body(stream, await recv_length(stream, limit))


async def send_msg(stream: trio.abc.SendStream, obj: Any) -> None:
    await stream.send_all(pack(obj))


def sock_recv_msg(sock: socket.socket, limit: int = MAX_FRAME) -> Any:
    """Blocking receive of one message from a plain socket."""
    def exactly(n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = sock.recv(min(n - len(buf), 1 << 20))
            if not chunk:
                raise EOFError("connection closed")
            buf += chunk
        return bytes(buf)

    (length,) = HEADER.unpack(exactly(HEADER.size))
    check_length(length, limit)
    return unpack(exactly(length))

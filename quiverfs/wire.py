"""Length-prefixed msgpack frames, shared by the control socket and peer RPC.

A frame is a little-endian u32 length followed by that many bytes of msgpack.
Frames over the receiver's limit are refused before their body is read, and a body
that would decode to more than the receiver's ``Limits`` allow is refused while it is
decoded: one byte of msgpack can make a 56-byte empty list.
"""
from __future__ import annotations

import dataclasses
import socket
import struct
import sys
from typing import Any

import msgpack
import trio

HEADER = struct.Struct("<I")
MAX_FRAME = 256 << 20  # a registration carries a whole digest (1.3 M entries ~ 110 MB)


# Bytes charged per element of a decoded array (per key and per value of a map), beyond
# the container's own size: its object where it is not shared (an int past 256 takes 28
# bytes, a short string or bytes 33 to 50).
ELEMENT_BYTES = 32


class FrameError(Exception):
    """A frame that is oversized, truncated or not msgpack."""


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one message may decode to: msgpack's own bounds on each array, map, string,
    bytes and extension, and ``container_bytes`` for all its arrays and maps together
    (their sizes and ELEMENT_BYTES per element), which bounds its memory whatever its
    shape. msgpack itself refuses nesting past 1,024 levels."""

    max_array_len: int
    max_map_len: int
    max_str_len: int
    max_bin_len: int
    max_ext_len: int
    container_bytes: int


class _Charge:
    """The hook msgpack calls with each array and map it completes: charges it against
    a message's ``container_bytes``, and stops the decoding once they are spent."""

    def __init__(self, budget: int) -> None:
        self.left = budget

    def __call__(self, container: list[Any] | dict[Any, Any]) -> Any:
        per_element = 2 * ELEMENT_BYTES if isinstance(container, dict) else ELEMENT_BYTES
        self.left -= sys.getsizeof(container) + per_element * len(container)
        if self.left < 0:
            raise FrameError("the message decodes to more objects than it may carry")
        return container


def pack(obj: Any) -> bytes:
    body = msgpack.packb(obj, use_bin_type=True)
    return HEADER.pack(len(body)) + body


def unpack(body: bytes | bytearray, limits: Limits | None = None) -> Any:
    """The message ``body`` holds, decoded within ``limits`` (without: within msgpack's
    defaults, which scale with the body: for messages from a trusted sender or of a few
    KiB)."""
    bounds: dict[str, Any] = {}
    if limits is not None:
        charge = _Charge(limits.container_bytes)
        bounds = {"list_hook": charge, "object_hook": charge,
                  **{f.name: getattr(limits, f.name) for f in dataclasses.fields(limits)
                     if f.name.startswith("max_")}}
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, **bounds)
    except FrameError:
        raise
    except (msgpack.UnpackException, ValueError, TypeError) as exc:
        raise FrameError(f"undecodable message ({type(exc).__name__}: {exc})") from None


def check_length(length: int, limit: int) -> None:
    if length > limit:
        raise FrameError(f"frame of {length} bytes exceeds the {limit}-byte limit")


async def _recv_exactly(stream: trio.abc.ReceiveStream, n: int) -> bytearray:
    # grown as bytes arrive and returned as it is: a copy would hold the frame twice
    buf = bytearray()
    while len(buf) < n:
        chunk = await stream.receive_some(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("connection closed mid-frame" if buf else "connection closed")
        buf += chunk
    return buf


async def recv_length(stream: trio.abc.ReceiveStream, limit: int = MAX_FRAME) -> int:
    """Receive one frame's header: the length of its body, at most ``limit`` (EOFError
    when the peer closed cleanly between frames)."""
    (length,) = HEADER.unpack(await _recv_exactly(stream, HEADER.size))
    check_length(length, limit)
    return length


async def recv_body(stream: trio.abc.ReceiveStream, length: int) -> bytearray:
    """Receive the ``length`` bytes of body that a frame's header announced."""
    return await _recv_exactly(stream, length)


async def recv_frame(stream: trio.abc.ReceiveStream, limit: int = MAX_FRAME) -> bytearray:
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

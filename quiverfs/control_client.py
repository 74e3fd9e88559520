"""Talking to a running mountd over its local control socket."""
from __future__ import annotations

import os
import socket
from typing import Any, TypeVar

import msgspec

from quiverfs import wire
from quiverfs.errors import ExitCode, QuietError

RUN_DIR = "/run/quiver"
DEFAULT_ROOT = "/mnt/quiver"
# A refusal's exit code: any but OK, which would tell the shell the command worked.
_REFUSAL_CODES = frozenset(int(c) for c in ExitCode if c is not ExitCode.OK)
T = TypeVar("T")


def default_socket(root: str) -> str:
    """The control socket of the mountd serving ``root``: /run/quiver/<escaped root>.sock."""
    escaped = os.path.abspath(root).strip("/").replace("-", "\\x2d").replace("/", "-") or "-"
    return os.path.join(RUN_DIR, f"mountd-{escaped}.sock")


def call(socket_path: str, request: dict[str, Any], root: str = "",
         timeout: float | None = 600.0) -> dict[str, Any]:
    """Send one request and return the reply, a map whose ``ok`` is true; a refusal, or a
    reply without a true or false ``ok``, becomes a QuietError."""
    where = root or socket_path
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sock.settimeout(timeout)
        sock.connect(socket_path)
    except (FileNotFoundError, ConnectionRefusedError):
        raise QuietError(f"no mountd is running for {where} (no control socket {socket_path}): "
                         "start it with 'quiver mountd --root ROOT --cache-dir DIR'",
                         ExitCode.DAEMON) from None
    except PermissionError:
        raise QuietError(f"cannot connect to {socket_path}: permission denied",
                         ExitCode.PERMISSION) from None
    except OSError as exc:  # e.g. a path longer than a socket address holds (107 bytes)
        raise QuietError(f"cannot connect to mountd for {where} at {socket_path}: "
                         f"{exc.strerror or exc}: give --control-socket a shorter path",
                         ExitCode.DAEMON) from None
    try:
        with sock:
            reply = exchange(sock, request)
    except (OSError, EOFError, wire.FrameError) as exc:
        raise QuietError(f"mountd for {where} did not answer: {exc}", ExitCode.DAEMON) from None
    op = request.get("op")
    if not isinstance(reply, dict) or not isinstance(reply.get("ok"), bool):
        raise malformed(op, "not a map with a true or false 'ok'")
    if not reply["ok"]:
        raise _refusal(reply, op)
    return reply


def exchange(sock: socket.socket, request: dict[str, Any]) -> Any:
    """Send ``request`` on a connected control socket and read the reply. mountd answers
    a connection it refuses (too many from one uid) and closes it without reading: a
    send that finds it closed may have the refusal waiting, so read it all the same."""
    try:
        sock.sendall(wire.pack(request))
    except (BrokenPipeError, ConnectionResetError):
        pass  # the refusal, if it came, is read next; else the read finds the close
    return wire.sock_recv_msg(sock)


def typed(reply: dict[str, Any], kind: type[T], op: str) -> T:
    """``reply`` as the record ``kind`` (a msgspec Struct of the fields the caller
    reads); a missing field or one of the wrong type is a QuietError naming it."""
    try:
        return msgspec.convert(reply, kind)
    except msgspec.ValidationError as exc:
        raise malformed(op, str(exc)) from None


def malformed(op: object, why: str) -> QuietError:
    """The one-line error of a reply that is not what mountd sends."""
    return QuietError(f"mountd sent a malformed reply to {op!r}: {why}", ExitCode.DAEMON)


def _refusal(reply: dict[str, Any], op: object) -> QuietError:
    """The error a refusal carries: its message (on one line) and its exit code."""
    message, code = reply.get("error"), reply.get("code")
    if not isinstance(message, str) or type(code) is not int or code not in _REFUSAL_CODES:
        return malformed(op, "a refusal needs an 'error' string and a 'code' from "
                         f"{min(_REFUSAL_CODES)} to {max(_REFUSAL_CODES)}")
    return QuietError(" ".join(message.splitlines()), ExitCode(code))


"""Talking to a running mountd over its local control socket."""
from __future__ import annotations

import os
import socket
from typing import Any

from quiverfs import wire
from quiverfs.errors import ExitCode, QuietError

RUN_DIR = "/run/quiver"
DEFAULT_ROOT = "/mnt/quiver"


def default_socket(root: str) -> str:
    """The control socket of the mountd serving ``root``: /run/quiver/<escaped root>.sock."""
    escaped = os.path.abspath(root).strip("/").replace("-", "\\x2d").replace("/", "-") or "-"
    return os.path.join(RUN_DIR, f"mountd-{escaped}.sock")


def call(socket_path: str, request: dict[str, Any], root: str = "",
         timeout: float | None = 600.0) -> dict[str, Any]:
    """Send one request and return the reply; a refusal becomes a QuietError."""
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
    try:
        with sock:
            sock.sendall(wire.pack(request))
            reply = wire.sock_recv_msg(sock)
    except (OSError, EOFError, wire.FrameError) as exc:
        raise QuietError(f"mountd for {where} did not answer: {exc}", ExitCode.DAEMON) from None
    if not isinstance(reply, dict) or not reply.get("ok"):
        message = reply.get("error", "malformed reply") if isinstance(reply, dict) else "?"
        code = reply.get("code", ExitCode.DAEMON) if isinstance(reply, dict) else ExitCode.DAEMON
        raise QuietError(str(message), ExitCode(code))
    return reply

"""Tell systemd a ``Type=notify`` service is ready (no-op outside systemd)."""
from __future__ import annotations

import os
import socket


def notify(state: str = "READY=1") -> bool:
    """Send ``state`` to $NOTIFY_SOCKET; return whether there was one to send to."""
    address = os.environ.get("NOTIFY_SOCKET")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]  # abstract namespace
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True

"""A stalled "bucket" on loopback: it answers every GET with ``200`` headers and then
one byte of the requested range every ``interval`` seconds (or, ``silent``, answers
nothing), and records its connections (opened, and open now) so that a test can see a
client give them up."""
from __future__ import annotations

import contextlib
import re
import select
import socket
import threading
from collections.abc import Iterator

RANGE = re.compile(rb"\r\nrange: bytes=(\d+)-(\d+)\r\n", re.IGNORECASE)
WHOLE = 1 << 20  # bytes a request without a Range is promised


class SlowListener:
    """Accepts on 127.0.0.1 (``url``); one thread per connection."""

    def __init__(self, interval: float, silent: bool = False) -> None:
        self.interval = interval
        self.silent = silent
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self.opened = 0  # connections accepted so far
        self.open = 0  # connections the client has not closed yet
        self._closing = threading.Event()

    def counts(self) -> tuple[int, int]:
        """(opened, open now)."""
        with self._lock:
            return self.opened, self.open

    def serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.opened += 1
                self.open += 1
            threading.Thread(target=self._trickle, args=(conn,), daemon=True).start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    request += piece
                found = RANGE.search(request)
                length = int(found[2]) - int(found[1]) + 1 if found else WHOLE
                if not self.silent:
                    conn.sendall(b"HTTP/1.1 200 OK\r\n"
                                 b"Content-Type: application/octet-stream\r\n"
                                 b"Content-Length: %d\r\n\r\n" % length)
                for _ in range(length):
                    readable, _, _ = select.select([conn], [], [], self.interval)
                    if self._closing.is_set() or (readable and not conn.recv(65536)):
                        return  # the client closed it (or sent another request: none do)
                    if not self.silent:
                        conn.sendall(b"x")
        except OSError:
            pass  # reset by the client
        finally:
            with self._lock:
                self.open -= 1

    def close(self) -> None:
        self._closing.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._server.close()


@contextlib.contextmanager
def slow_listener(interval: float, silent: bool = False) -> Iterator[SlowListener]:
    listener = SlowListener(interval, silent)
    thread = threading.Thread(target=listener.serve, daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        listener.close()
        thread.join()

"""A stalled "bucket" on loopback: it answers every GET with ``200`` headers and then
one byte of the requested range (or of a body of ``body_size`` bytes, whatever the
request asked for) every ``interval`` seconds (or, ``silent``, answers nothing), and
records its connections (opened, and open now) so that a test can see a client give
them up, and the requests it holds (whose headers arrived, now and the most at once) so
that a test can see how many fetches a client keeps waiting on it."""
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

    def __init__(self, interval: float, silent: bool = False,
                 body_size: int | None = None) -> None:
        self.interval = interval
        self.silent = silent
        self.body_size = body_size
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._lock = threading.Lock()
        self.opened = 0  # connections accepted so far
        self.open = 0  # connections the client has not closed yet
        self.held = 0  # requests whose headers arrived and whose answer has not ended
        self.most_held = 0  # the most requests held at once
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._closing = threading.Event()

    def counts(self) -> tuple[int, int]:
        """(opened, open now)."""
        with self._lock:
            return self.opened, self.open

    def held_counts(self) -> tuple[int, int]:
        """(requests held now, the most held at once)."""
        with self._lock:
            return self.held, self.most_held

    def serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            with self._lock:
                self.opened += 1
                self.open += 1
                self._conns.add(conn)
                thread = threading.Thread(target=self._trickle, args=(conn,), daemon=True)
                self._threads.append(thread)
            thread.start()

    def _trickle(self, conn: socket.socket) -> None:
        try:
            with conn:
                request = b""
                while b"\r\n\r\n" not in request:
                    piece = conn.recv(65536)
                    if not piece:
                        return
                    request += piece
                with self._lock:
                    self.held += 1
                    self.most_held = max(self.most_held, self.held)
                try:
                    self._answer(conn, request)
                finally:
                    with self._lock:
                        self.held -= 1
        except OSError:
            pass  # reset by the client, or cut by close
        finally:
            with self._lock:
                self.open -= 1
                self._conns.discard(conn)

    def _answer(self, conn: socket.socket, request: bytes) -> None:
        """Headers, then the body a byte every ``interval`` until it ends, the client
        closes the connection, or the listener is closed."""
        found = RANGE.search(request)
        if self.body_size is not None:
            length = self.body_size
        else:
            length = int(found[2]) - int(found[1]) + 1 if found else WHOLE
        if not self.silent:
            conn.sendall(b"HTTP/1.1 200 OK\r\n"
                         b"Content-Type: application/octet-stream\r\n"
                         b"Content-Length: %d\r\n\r\n" % length)
        for _ in range(length):
            readable, _, _ = select.select([conn], [], [], self.interval)
            if self._closing.is_set() or (readable and not conn.recv(65536)):
                return  # closed (by either side; or another request: none send one)
            if not self.silent:
                conn.sendall(b"x")

    def close(self) -> None:
        """Stop listening and cut every connection short (at once, not at the next
        byte); returns when every connection's thread has ended. Closing twice is
        harmless."""
        self._closing.set()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept
        self._server.close()
        with self._lock:
            conns, threads = list(self._conns), list(self._threads)
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's select
        for thread in threads:
            thread.join()


@contextlib.contextmanager
def slow_listener(interval: float, silent: bool = False,
                  body_size: int | None = None) -> Iterator[SlowListener]:
    """A SlowListener serving in a thread of its own until the block ends."""
    listener = SlowListener(interval, silent, body_size)
    thread = threading.Thread(target=listener.serve, daemon=True)
    thread.start()
    try:
        yield listener
    finally:
        listener.close()
        thread.join()

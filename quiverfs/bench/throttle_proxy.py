"""A bandwidth-capped TCP proxy on 127.0.0.1, to make a local "bucket" slower than the cache.

Benchmarks put it in front of the GCS emulator so that reading the bucket costs what a
shared bucket costs relative to a local SSD. Every byte that flows from the upstream
server to any client draws from one token bucket (``rate`` bytes per second, bursts of
``burst`` bytes), so the cap holds for all connections together, as a NIC's would.
Requests (client to upstream) are counted but not throttled.

    with throttled("http://127.0.0.1:9023", rate=20e6) as proxy:
        ... point clients at proxy.url ...
        print(proxy.bytes_down)
"""
from __future__ import annotations

import contextlib
import logging
import selectors
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterator

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RECV_SIZE = 64 << 10  # bytes read from a socket at once
DEFAULT_BURST = 256 << 10  # bytes that may pass at once after an idle spell
JOIN_TIMEOUT = 5.0  # seconds stop() waits for each thread


class TokenBucket:
    """A rate shared by threads: each call reserves its bytes and says how long to wait.

    A generic cell-rate algorithm: reservations queue in virtual time, so callers are
    served in the order they asked and no window longer than a burst exceeds ``rate``.
    """

    def __init__(self, rate: float, burst: int = DEFAULT_BURST) -> None:
        if rate <= 0:
            raise ValueError(f"rate must be positive, not {rate}")
        self.rate = rate
        self.burst = burst
        self._lock = threading.Lock()
        self._drained_at = time.monotonic()  # when everything reserved so far has passed

    def reserve(self, n: int) -> float:
        """Take ``n`` bytes; return the seconds the caller must wait before sending them."""
        with self._lock:
            now = time.monotonic()
            self._drained_at = max(self._drained_at, now) + n / self.rate
            return max(0.0, self._drained_at - now - self.burst / self.rate)


class _Link:
    """One proxied connection: its two sockets, closed when both directions are done."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self._open_directions = 2
        self._lock = threading.Lock()

    def cut(self) -> None:
        """Shut both sockets down, which ends both directions' blocking calls."""
        for s in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def direction_done(self) -> bool:
        """Count one direction finished; True (and the sockets closed) after the second."""
        with self._lock:
            self._open_directions -= 1
            last = self._open_directions == 0
        if last:
            self.client.close()
            self.upstream.close()
        return last


class ThrottleProxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``, capping download bandwidth."""

    def __init__(self, upstream_port: int, rate: float, burst: int = DEFAULT_BURST) -> None:
        self.upstream = (LOOPBACK, upstream_port)
        self.bucket = TokenBucket(rate, burst)
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port: int = self._listener.getsockname()[1]
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = socket.socketpair()
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._threads: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept_loop, name="proxy-accept",
                                          daemon=True)
        self.bytes_down = 0  # upstream -> clients
        self.bytes_up = 0  # clients -> upstream
        self.connections = 0

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def start(self) -> None:
        self._acceptor.start()
        log.debug("throttle proxy %s -> %s:%d at %.0f bytes/s", self.url, *self.upstream,
                  self.bucket.rate)

    def stop(self) -> None:
        """Stop accepting, cut every open connection, and join every thread."""
        self._stopping.set()
        self._wake_w.send(b"x")
        self._acceptor.join(JOIN_TIMEOUT)
        with self._lock:
            links, threads = list(self._links), list(self._threads)
        for link in links:
            link.cut()
        for t in threads:
            t.join(JOIN_TIMEOUT)
            if t.is_alive():
                log.warning("throttle proxy thread %s did not stop", t.name)
        for s in (self._listener, self._wake_r, self._wake_w):
            s.close()

    def __enter__(self) -> ThrottleProxy:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _accept_loop(self) -> None:
        with selectors.DefaultSelector() as sel:
            sel.register(self._listener, selectors.EVENT_READ)
            sel.register(self._wake_r, selectors.EVENT_READ)
            while not self._stopping.is_set():
                for key, _ in sel.select():
                    if key.fileobj is self._listener and not self._stopping.is_set():
                        self._accept()

    def _accept(self) -> None:
        try:
            client, _ = self._listener.accept()
        except OSError as exc:
            log.warning("throttle proxy: accept failed: %s", exc)
            return
        try:
            upstream = socket.create_connection(self.upstream)
        except OSError as exc:
            log.warning("throttle proxy: cannot reach %s:%d: %s", *self.upstream, exc)
            client.close()
            return
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        link = _Link(client, upstream)
        self.connections += 1
        pumps = [threading.Thread(target=self._pump, args=(link, upstream, client, True),
                                  name=f"proxy-down-{self.connections}", daemon=True),
                 threading.Thread(target=self._pump, args=(link, client, upstream, False),
                                  name=f"proxy-up-{self.connections}", daemon=True)]
        with self._lock:
            self._links.add(link)
            self._threads = [t for t in self._threads if t.is_alive()] + pumps
        for t in pumps:
            t.start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket, down: bool) -> None:
        """Copy ``src`` to ``dst`` until EOF; downloads wait for the token bucket."""
        try:
            while data := src.recv(RECV_SIZE):
                if down:
                    delay = self.bucket.reserve(len(data))
                    if delay and self._stopping.wait(delay):
                        break
                dst.sendall(data)
                with self._lock:
                    if down:
                        self.bytes_down += len(data)
                    else:
                        self.bytes_up += len(data)
            else:
                dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:
            link.cut()  # one side went away (or stop() cut it): end the other direction too
        finally:
            if link.direction_done():
                with self._lock:
                    self._links.discard(link)


@contextlib.contextmanager
def throttled(upstream_url: str, rate: float, burst: int = DEFAULT_BURST
              ) -> Iterator[ThrottleProxy]:
    """A started proxy in front of ``http://127.0.0.1:PORT``; always stopped on exit."""
    parts = urllib.parse.urlsplit(upstream_url)
    if parts.hostname != LOOPBACK or parts.port is None:
        raise ValueError(f"the throttle proxy only forwards to {LOOPBACK}:PORT, "
                         f"not {upstream_url!r}")
    with ThrottleProxy(parts.port, rate, burst) as proxy:
        yield proxy

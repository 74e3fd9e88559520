"""A bandwidth-capped TCP proxy on 127.0.0.1, to make a local "bucket" slower than the cache.

Benchmarks put it in front of the GCS emulator so that reading the bucket costs what a
shared bucket costs relative to a local SSD. Every byte that flows from the upstream
server to any client draws from one token bucket (``rate`` bytes per second, bursts of
``burst`` bytes), so the cap holds for all connections together, as a NIC's would.
Requests (client to upstream) are counted but not throttled.

With a ``latency``, the first byte of every response waits that long before it takes
its turn at the cap, as a cloud bucket's time to first byte does. Each connection
waits on its own (one thread per direction), so requests in flight on different
connections wait at the same time, and the cap serves other connections meanwhile.
A response is the first data from upstream after the client sent something (HTTP/1.1
keeps one request at a time on a connection).

The bytes sent to clients are also kept in time bins (``sent``), so that a benchmark
can ask how busy the bucket was during given intervals. With a ``request_log``, the
HTTP requests clients send are recorded there, headers and all, before they go upstream.

    with throttled("http://127.0.0.1:9023", rate=20e6, latency=0.03) as proxy:
        ... point clients at proxy.url ...
        print(proxy.bytes_down)
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import selectors
import socket
import threading
import time
import urllib.parse
from collections.abc import Iterable, Iterator

from quiverfs.bench.request_log import RequestLog, RequestParser

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
RECV_SIZE = 64 << 10  # bytes read from a socket at once
DEFAULT_BURST = 256 << 10  # bytes that may pass at once after an idle spell
JOIN_TIMEOUT = 5.0  # seconds stop() waits for each thread
BIN_S = 0.05  # seconds per bin of the record of bytes sent
UNCAPPED = 1e12  # bytes/s: a rate that caps nothing (a proxy only to delay responses)


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


class SentBytes:
    """Bytes sent, in bins of ``bin_s`` seconds of wall-clock time (``time.time()``, which
    job processes can stamp their own intervals with)."""

    def __init__(self, bin_s: float = BIN_S) -> None:
        self.bin_s = bin_s
        self._bins: collections.Counter[int] = collections.Counter()
        self._lock = threading.Lock()

    def add(self, n: int, at: float) -> None:
        with self._lock:
            self._bins[math.floor(at / self.bin_s)] += n

    def within(self, intervals: Iterable[tuple[float, float]]) -> float:
        """Bytes sent during ``intervals`` (disjoint ``(start, end)`` pairs); a bin that
        an interval covers in part counts for that part."""
        with self._lock:
            bins = dict(self._bins)
        total = 0.0
        for start, end in intervals:
            first, last = start / self.bin_s, end / self.bin_s  # in bins
            for b in range(math.floor(first), math.floor(last) + 1):
                if b in bins:
                    total += bins[b] * max(0.0, min(last, b + 1) - max(first, b))
        return total


class _Link:
    """One proxied connection: its two sockets, closed when both directions are done."""

    def __init__(self, client: socket.socket, upstream: socket.socket,
                 parser: RequestParser | None) -> None:
        self.client = client
        self.upstream = upstream
        self.parser = parser  # of the requests it carries, when they are recorded
        # Set when the client sends, cleared by the first response byte: that byte waits
        # for the latency.
        self.awaiting_response = threading.Event()
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
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``upstream_port``, capping download
    bandwidth and delaying each response's first byte by ``latency`` seconds."""

    def __init__(self, upstream_port: int, rate: float, burst: int = DEFAULT_BURST,
                 latency: float = 0.0, request_log: RequestLog | None = None) -> None:
        if latency < 0:
            raise ValueError(f"latency must not be negative, not {latency}")
        self.upstream = (LOOPBACK, upstream_port)
        self.bucket = TokenBucket(rate, burst)
        self.latency = latency
        self.request_log = request_log
        self.sent = SentBytes()  # bytes down, in time bins
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
        log.debug("throttle proxy %s -> %s:%d at %.0f bytes/s, %.3f s to first byte",
                  self.url, *self.upstream, self.bucket.rate, self.latency)

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
        link = _Link(client, upstream,
                     self.request_log.parser() if self.request_log is not None else None)
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
        """Copy ``src`` to ``dst`` until EOF; a response's first byte waits for the
        latency, and downloads wait for the token bucket."""
        try:
            while data := src.recv(RECV_SIZE):
                if not down:
                    if link.parser is not None:
                        link.parser.feed(data)  # recorded before it can be answered
                    link.awaiting_response.set()  # before the request can be answered
                elif self._wait_down(link, len(data)):
                    break
                # counted as they go: a client that has the bytes sees them counted
                if down:
                    self.sent.add(len(data), time.time())
                with self._lock:
                    if down:
                        self.bytes_down += len(data)
                    else:
                        self.bytes_up += len(data)
                dst.sendall(data)
            else:
                dst.shutdown(socket.SHUT_WR)  # pass the half-close on
        except OSError:
            link.cut()  # one side went away (or stop() cut it): end the other direction too
        finally:
            if link.direction_done():
                with self._lock:
                    self._links.discard(link)

    def _wait_down(self, link: _Link, n: int) -> bool:
        """Wait until ``n`` bytes from upstream may go: the latency if they begin a
        response, then their turn at the cap. True if the proxy stopped meanwhile."""
        if self.latency and link.awaiting_response.is_set():
            link.awaiting_response.clear()
            if self._stopping.wait(self.latency):
                return True
        delay = self.bucket.reserve(n)
        return bool(delay) and self._stopping.wait(delay)


@contextlib.contextmanager
def throttled(upstream_url: str, rate: float, burst: int = DEFAULT_BURST,
              latency: float = 0.0, request_log: RequestLog | None = None
              ) -> Iterator[ThrottleProxy]:
    """A started proxy in front of ``http://127.0.0.1:PORT``; always stopped on exit."""
    parts = urllib.parse.urlsplit(upstream_url)
    if parts.hostname != LOOPBACK or parts.port is None:
        raise ValueError(f"the throttle proxy only forwards to {LOOPBACK}:PORT, "
                         f"not {upstream_url!r}")
    with ThrottleProxy(parts.port, rate, burst, latency, request_log) as proxy:
        yield proxy

"""A daemon's Prometheus endpoint: prometheus_client's own HTTP server, on its own thread.

The server answers each scrape in a thread of its own, while a daemon's state (mountd's
read counters, mount table, jobs and chunk cycles; the coordinator's members and cycles)
is changed only by tasks on its trio loop. A collector therefore reads that state with
``TrioLoop.run_sync``: one plain function run on the loop, between two steps of those
tasks, copies one consistent moment into metric families, with no locks. Blocking reads
(mountd's store) stay in the scrape's thread. The wait for the loop is bounded, so a
stalled loop fails the part of a scrape that needs it, never the daemon.

The port is reachable by every local user, so the library's threading server runs here
with two bounds it lacks: a connection must send its request within REQUEST_TIMEOUT,
and at most MAX_CONNECTIONS are served at once (more are closed at once).
"""
from __future__ import annotations

import concurrent.futures
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from typing import Any, Protocol, TypeVar
from wsgiref.simple_server import WSGIRequestHandler, make_server

import trio
from prometheus_client import CollectorRegistry, ProcessCollector, make_wsgi_app
from prometheus_client.core import Metric
from prometheus_client.exposition import ThreadingWSGIServer

from quiverfs.option_types import listen_error

log = logging.getLogger(__name__)

LOOP_TIMEOUT = 5.0  # seconds a scrape waits for the trio loop (Prometheus allows 10)
REQUEST_TIMEOUT = 10.0  # seconds a connection may take to send its request
MAX_CONNECTIONS = 16  # connections served at once

T = TypeVar("T")


class LoopUnavailable(Exception):
    """The trio loop is not running, or did not answer in time."""


class TrioLoop:
    """Runs plain functions on a daemon's trio loop for threads outside it."""

    def __init__(self, timeout: float = LOOP_TIMEOUT) -> None:
        self.timeout = timeout
        self._token: trio.lowlevel.TrioToken | None = None

    def attach(self) -> None:
        """Take the running loop as the one to use; call it on that loop."""
        self._token = trio.lowlevel.current_trio_token()

    def detach(self) -> None:
        self._token = None

    def run_sync(self, fn: Callable[[], T]) -> T:
        """``fn()``, run on the loop; raises LoopUnavailable rather than wait longer than
        ``timeout`` (trio.from_thread.run_sync would wait without bound)."""
        token = self._token
        if token is None:
            raise LoopUnavailable("the trio loop is not running")
        answer: concurrent.futures.Future[T] = concurrent.futures.Future()

        def on_loop() -> None:
            if not answer.set_running_or_notify_cancel():
                return  # the scrape stopped waiting
            try:
                answer.set_result(fn())
            except Exception as exc:  # raised from a run_sync_soon callback, it kills the loop
                answer.set_exception(exc)

        try:
            token.run_sync_soon(on_loop)
        except trio.RunFinishedError:
            raise LoopUnavailable("the trio loop has finished") from None
        try:
            return answer.result(timeout=self.timeout)
        except TimeoutError:
            answer.cancel()
            raise LoopUnavailable(f"the trio loop did not answer within {self.timeout:g} s"
                                  ) from None


class _QuietHandler(WSGIRequestHandler):
    """One request per connection, read within REQUEST_TIMEOUT; no access log."""

    timeout = REQUEST_TIMEOUT

    def log_message(self, format: str, *args: object) -> None:
        pass


class _BoundedServer(ThreadingWSGIServer):
    """prometheus_client's thread-per-connection server, serving at most
    MAX_CONNECTIONS at once; a failed connection is logged at DEBUG, not printed."""

    def __init__(self, server_address: tuple[str, int], *args: Any, **kwargs: Any) -> None:
        self.address_family = socket.AF_INET6 if ":" in server_address[0] else socket.AF_INET
        super().__init__(server_address, *args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: socket.socket, client_address: object) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # a flood: closed at once
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: socket.socket, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: object, client_address: object) -> None:
        log.debug("metrics connection from %s failed", client_address, exc_info=True)


class LoopCollector(Protocol):
    """A prometheus collector that reads its daemon's state through ``loop``."""

    loop: TrioLoop

    def collect(self) -> Iterable[Metric]: ...


class MetricsServer:
    """``http://HOST:PORT/metrics`` for ``collector`` and the process's own numbers.

    It binds and starts serving when constructed, so that a taken port fails before the
    daemon mounts or listens; ``serve``, a task on the daemon's loop, lends the loop to
    the collector and shuts the server down when cancelled.
    """

    def __init__(self, address: tuple[str, int], collector: LoopCollector) -> None:
        self.loop = collector.loop
        # auto_describe=False: registering must not call collect(), which needs the loop.
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        host, port = address
        try:
            self._server = make_server(host, port, make_wsgi_app(self.registry),
                                       _BoundedServer, handler_class=_QuietHandler)
        except OSError as exc:  # the port is taken, or the host is not ours
            raise listen_error("--metrics", host, port, exc) from None
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        name="metrics", daemon=True)
        self._thread.start()
        self.address: tuple[str, int] = self._server.server_address[:2]

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        self.loop.attach()
        log.info("metrics on http://%s:%d/metrics", *self.address)
        task_status.started(self.address)
        try:
            await trio.sleep_forever()
        finally:
            self.loop.detach()
            with trio.CancelScope(shield=True):  # shutdown() waits up to a poll (0.5 s)
                await trio.to_thread.run_sync(self.close)

    def close(self) -> None:
        """Stop answering and release the port (blocking)."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

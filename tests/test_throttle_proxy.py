"""The benchmarks' bucket proxy: one bandwidth cap for every connection, a first-byte
latency that each request waits on its own (``quiver bench --latency-ms``), and a record
of when bytes went out."""
from __future__ import annotations

import concurrent.futures
import http.client
import http.server
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator

import pytest

from quiverfs.bench.request_log import RequestLog
from quiverfs.bench.throttle_proxy import UNCAPPED, SentBytes, ThrottleProxy, throttled
from quiverfs.errors import ExitCode

PAYLOAD = 256 << 10  # bytes the streaming server sends on every connection
RESPONSE = 4096  # bytes the request-answering server sends for every request line
LATENCY = 0.3  # seconds to first byte in the latency tests
FAST = 100e6  # bytes/s: a cap that the latency tests never reach


class _Sender(socketserver.BaseRequestHandler):
    """Sends PAYLOAD on connecting, then closes."""

    def handle(self) -> None:
        self.request.sendall(os.urandom(PAYLOAD))


class _Answerer(socketserver.StreamRequestHandler):
    """Answers each line it reads with RESPONSE bytes (requests one at a time, as HTTP/1.1
    keeps them on a connection)."""

    def handle(self) -> None:
        while self.rfile.readline():
            self.wfile.write(os.urandom(RESPONSE))
            self.wfile.flush()


@pytest.fixture
def server_url(request: pytest.FixtureRequest) -> Iterator[str]:
    """A threaded TCP server with the handler ``request.param``; its URL."""
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), request.param) as server:
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            yield f"http://127.0.0.1:{server.server_address[1]}"
        finally:
            server.shutdown()


def _download(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as s:
        received = 0
        while data := s.recv(65536):
            received += len(data)
    return received


def _requests(port: int, n: int) -> list[float]:
    """Send ``n`` requests one after another on one connection; each one's seconds from
    sending it to the first byte of its response."""
    ttfb = []
    with socket.create_connection(("127.0.0.1", port)) as s:
        for _ in range(n):
            sent = time.monotonic()
            s.sendall(b"GET\n")
            received = len(s.recv(RESPONSE))
            ttfb.append(time.monotonic() - sent)
            while received < RESPONSE:
                received += len(s.recv(RESPONSE - received))
    return ttfb


@pytest.mark.parametrize("server_url", [_Sender], indirect=True)
def test_caps_all_connections_together_and_counts_bytes(server_url):
    rate, burst, connections = 2e6, 64 << 10, 4
    with throttled(server_url, rate, burst) as proxy:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(connections) as pool:
            sizes = list(pool.map(_download, [proxy.port] * connections))
        elapsed = time.monotonic() - start
        assert sizes == [PAYLOAD] * connections
        assert proxy.bytes_down == connections * PAYLOAD
        assert proxy.connections == connections
    assert elapsed >= (connections * PAYLOAD - burst) / rate * 0.95
    assert not [t for t in threading.enumerate() if t.name.startswith("proxy-")]


def test_only_forwards_to_loopback():
    with pytest.raises(ValueError, match="only forwards to 127.0.0.1"):
        with throttled("http://10.0.0.1:80", 1e6):
            pass


def test_refuses_a_negative_latency():
    with pytest.raises(ValueError, match="latency must not be negative"):
        ThrottleProxy(1, 1e6, latency=-0.01)


@pytest.mark.parametrize("server_url", [_Answerer], indirect=True)
def test_every_response_waits_the_latency_for_its_first_byte(server_url):
    with throttled(server_url, FAST, latency=LATENCY) as proxy:
        ttfb = _requests(proxy.port, 3)  # one connection: each request, not only the first
        assert proxy.bytes_down == 3 * RESPONSE
    assert min(ttfb) >= LATENCY
    with throttled(server_url, FAST) as proxy:  # no latency: the same server answers at once
        assert max(_requests(proxy.port, 3)) < LATENCY


@pytest.mark.parametrize("server_url", [_Answerer], indirect=True)
def test_concurrent_requests_wait_their_latency_together(server_url):
    connections = 8
    with throttled(server_url, FAST, latency=LATENCY) as proxy:
        start = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(connections) as pool:
            ttfb = [t for ts in pool.map(_requests, [proxy.port] * connections, [1] * connections)
                    for t in ts]
        elapsed = time.monotonic() - start
    assert min(ttfb) >= LATENCY
    # one latency for all of them (serialised, they would take 8 latencies)
    assert elapsed < connections * LATENCY / 2


@pytest.mark.parametrize("server_url", [_Answerer], indirect=True)
def test_records_when_the_bytes_went_out(server_url):
    with throttled(server_url, FAST, latency=LATENCY) as proxy:
        start = time.time()
        _requests(proxy.port, 2)
        end = time.time()
        sent = proxy.sent
        # bins that an interval covers in part count in part: take the whole ones
        assert sent.within([(start - 1, end + 1)]) == pytest.approx(2 * RESPONSE)
        # nothing went out while the first response waited for its first byte
        assert sent.within([(start, start + 0.8 * LATENCY)]) == 0
        assert sent.within([(end + 1, end + 2)]) == 0


def test_sent_bytes_count_the_covered_part_of_a_bin():
    sent = SentBytes(bin_s=1.0)
    sent.add(1000, 10.2)  # bin [10, 11)
    sent.add(500, 12.9)  # bin [12, 13)
    assert sent.within([(10.0, 13.0)]) == 1500
    assert sent.within([(10.5, 10.75)]) == pytest.approx(250)
    assert sent.within([(10.0, 10.5), (12.0, 12.2)]) == pytest.approx(500 + 100)
    assert sent.within([(11.0, 12.0)]) == 0


@pytest.mark.parametrize("args, message", [
    (["digest", "--latency-ms", "30"], "--latency-ms: only these benchmarks have a bucket "
                                       "latency: compare, loader, read"),
    (["compare", "--latency-ms", "-5"], "--latency-ms must be at least 0, not -5"),
    (["compare", "--latency-ms", "nan"], "--latency-ms must be a finite number, not 'nan'"),
])
def test_bench_latency_option_refuses_what_it_cannot_do(quiver, tmp_path, args, message):
    r = quiver("bench", *args, "--json", str(tmp_path / "out.json"))
    assert r.returncode == ExitCode.USAGE
    assert r.stderr.strip() == f"quiver: error: {message}"
    assert not (tmp_path / "out.json").exists()


class _HTTPEcho(http.server.BaseHTTPRequestHandler):
    """Answers every request with its body (HTTP/1.1: one connection for all)."""

    protocol_version = "HTTP/1.1"

    def _answer(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer  # noqa: N815 (http.server's names)

    def log_message(self, *args: object) -> None:
        pass


@pytest.mark.parametrize("server_url", [_HTTPEcho], indirect=True)
def test_records_each_requests_headers_on_a_kept_alive_connection(server_url):
    log = RequestLog()
    body = b"x" * 100_000 + b"\r\n\r\nGET /not-a-request HTTP/1.1\r\n\r\n"  # in a body
    with throttled(server_url, UNCAPPED, request_log=log) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port)
        conn.request("POST", "/upload?x=1", body=body, headers={"Authorization": "Bearer a"})
        assert conn.getresponse().read() == body
        conn.request("GET", "/b/o?alt=media", headers={"Range": "bytes=0-9"})
        assert conn.getresponse().read() == b""
        conn.close()
    got = [(r.method, r.target, r.headers.get("authorization"), r.headers.get("range"))
           for r in log.requests()]
    assert got == [("POST", "/upload?x=1", "Bearer a", None),
                   ("GET", "/b/o?alt=media", None, "bytes=0-9")]

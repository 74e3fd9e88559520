"""``quiver bench substitution`` keeps working (a tiny run end to end, real mounts), and
the bandwidth-capped proxy it puts in front of the bucket caps and counts."""
from __future__ import annotations

import concurrent.futures
import os
import socket
import socketserver
import threading
import time

import pytest

from quiverfs.bench.substitution import SIZES, run
from quiverfs.bench.emulator import emulator_available
from quiverfs.bench.throttle_proxy import throttled

SUMMARY_KEYS = {
    "hit_ratio_sub", "hit_ratio_lru", "bucket_bytes_ratio_sub", "bucket_bytes_ratio_lru",
    "items_per_s_sub", "items_per_s_lru", "exactly_once", "order_spearman_sub",
    "order_spearman_global", "label_hist_dev_sub", "label_hist_dev_global", "accuracy_global",
    "accuracy_sub", "accuracy_gap", "max_resident_chunks"}


PAYLOAD = 256 << 10  # bytes the test server sends on every connection


class _Sender(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        self.request.sendall(os.urandom(PAYLOAD))


def _download(port: int) -> int:
    with socket.create_connection(("127.0.0.1", port)) as s:
        received = 0
        while data := s.recv(65536):
            received += len(data)
    return received


def test_throttle_proxy_caps_all_connections_together_and_counts_bytes():
    rate, burst, connections = 2e6, 64 << 10, 4
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Sender) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            with throttled(f"http://127.0.0.1:{server.server_address[1]}", rate,
                           burst) as proxy:
                start = time.monotonic()
                with concurrent.futures.ThreadPoolExecutor(connections) as pool:
                    sizes = list(pool.map(_download, [proxy.port] * connections))
                elapsed = time.monotonic() - start
                assert sizes == [PAYLOAD] * connections
                assert proxy.bytes_down == connections * PAYLOAD
                assert proxy.connections == connections
        finally:
            server.shutdown()
    assert elapsed >= (connections * PAYLOAD - burst) / rate * 0.95
    assert not [t for t in threading.enumerate() if t.name.startswith("proxy-")]


def test_throttle_proxy_only_forwards_to_loopback():
    with pytest.raises(ValueError, match="only forwards to 127.0.0.1"):
        with throttled("http://10.0.0.1:80", 1e6):
            pass


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
@pytest.mark.skipif(not emulator_available(), reason="gcp-storage-emulator is not installed")
@pytest.mark.timeout(120)
def test_tiny_run_reports_the_summary_and_every_item_exactly_once(tmp_path):
    report = run(quick=True, workdir=str(tmp_path), size="tiny")
    summary = report["summary"]
    assert set(summary) == SUMMARY_KEYS
    assert summary["exactly_once"] is True
    tiny = SIZES["tiny"]
    assert {(c["mode"], c["cache_fraction"], c["jobs"]) for c in report["configs"]} == {
        (mode, fraction, jobs) for mode in ("sub", "lru") for fraction, jobs in tiny.configs}
    for config in report["configs"]:
        assert len(config["epochs"]) == tiny.epochs
        assert all(e["items"] == config["jobs"] * tiny.items for e in config["epochs"])
    assert 0 <= summary["hit_ratio_sub"] <= 1 and 0 <= summary["hit_ratio_lru"] <= 1
    assert 1 <= summary["max_resident_chunks"] <= 2  # the chunk cycle ran, double-buffered
    assert 0 <= summary["accuracy_sub"] <= 100
    assert not any(os.path.ismount(os.path.join(tmp_path, d)) for d in os.listdir(tmp_path))

"""mountd's Prometheus endpoint, run with the config file docs/operations.md shows, and
its collector scraped from another thread while the trio loop runs."""
from __future__ import annotations

import json
import os
import re
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from mountd.control.metrics import NATIVE_COUNTERS, MountdCollector
from mountd.datasets.mount_table import MountTable
from mountd.jobs.registry import JobRegistry
from mountd.store.content_store import ContentStore
from quiverfs import digest as digest_format
from quiverfs import metrics_server
from quiverfs.bench.data import Tree
from quiverfs.bench.processes import free_port
from quiverfs.chunk_plan import make_plan
from quiverfs.counters import ReadCounter
from quiverfs.errors import ExitCode
from quiverfs.metrics_server import MetricsServer, TrioLoop
from mountd.fetch.loader_pool import MIN_SERVING_PROCESSES, THREADS_PER_PROCESS
from tests.mountd_helpers import lone_services, make_digest, mount, mountd_factory  # noqa: F401
from tests.notify_daemon import notify_daemon  # noqa: F401

needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

OPERATIONS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"
QUIVER = os.path.join(os.path.dirname(sys.executable), "quiver")
SCRAPE_DEADLINE = 20.0  # seconds to wait for state that settles in the background

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def documented_config(tmp_path: Path, port: int) -> str:
    """The docs' example config with its paths in ``tmp_path`` and the metrics ``port``."""
    text = OPERATIONS.read_text(encoding="utf-8")
    (example,) = re.findall(r"A full example.*?```toml\n(.*?)```", text, re.S)
    for original, moved in (("/mnt/quiver", f"{tmp_path}/mnt"),
                            ("/var/cache/quiver", f"{tmp_path}/cache"),
                            ("127.0.0.1:9100", f"127.0.0.1:{port}")):
        assert original in example, f"the example no longer shows {original}"
        example = example.replace(original, moved)
    # The default socket is derived from the root, under /run/quiver; keep it here.
    return f'control-socket = "{tmp_path}/ctl.sock"\n' + example


def scrape(port: int, path: str = "/metrics") -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as reply:
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def collected(collector: MountdCollector) -> Samples:
    """``collector.collect()`` right now, in the calling thread."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in collector.collect() for s in family.samples}


def scrape_while_serving(collector: MountdCollector) -> Samples:
    """What a scrape sees: collect() in a thread of its own while the trio loop runs."""
    async def scrape_once() -> Samples:
        collector.loop.attach()
        return await trio.to_thread.run_sync(collected, collector)

    return trio.run(scrape_once)


def read_tree(root: Path) -> int:
    """Read every file under ``root`` once; the number of files."""
    n = 0
    for path in sorted(root.rglob("*")):
        if path.is_file():
            path.read_bytes()
            n += 1
    return n


@pytest.fixture
def documented_mountd(notify_daemon, quiver, tmp_path) -> Callable[..., tuple[str, int]]:
    """mountd started as the unit starts it, with the docs' config; (config path, port)."""
    def start() -> tuple[str, int]:
        (tmp_path / "mnt").mkdir()
        port = free_port()
        cfg = tmp_path / "quiver.toml"
        cfg.write_text(documented_config(tmp_path, port), encoding="utf-8")
        notify_daemon([QUIVER, "--config", str(cfg), "mountd", "--foreground"],
                      str(tmp_path), str(tmp_path / "mnt"))
        return str(cfg), port

    return start


def register(quiver, cfg: str, src: str, digest: str, *names: str) -> None:
    r = quiver("--config", cfg, "digest", "create", src, "-o", digest)
    assert r.returncode == 0, r.stderr
    for name in names:
        r = quiver("--config", cfg, "mount", digest, "--name", name)
        assert r.returncode == 0, r.stderr


@needs_fuse
def test_read_and_cache_metrics_count_real_reads(documented_mountd, quiver, synthetic_tree:
                                                 Tree, tmp_path):
    cfg, port = documented_mountd()
    digest = str(tmp_path / "syn.qd")
    # The same content under two names: reading the second copy can only hit the cache
    # (different inodes, so the kernel's page cache does not answer for mountd).
    register(quiver, cfg, synthetic_tree.root, digest, "cold", "warm")
    mnt = tmp_path / "mnt"
    n = read_tree(mnt / "cold")
    assert read_tree(mnt / "warm") == n == 40
    total = digest_format.load(digest).total_bytes

    m = scrape(port)
    assert value(m, "quiver_hits_total", tier="bucket") == n
    assert value(m, "quiver_hits_total", tier="local") == n
    assert value(m, "quiver_hits_total", tier="peer") == 0
    assert value(m, "quiver_misses_total", tier="local") == n
    assert value(m, "quiver_bytes_total", tier="local") == total
    assert value(m, "quiver_bytes_total", tier="bucket") == total
    assert value(m, "quiver_read_errors_total", tier="bucket") == 0
    assert value(m, "quiver_read_seconds_count", tier="local") == n
    assert value(m, "quiver_read_seconds_count", tier="bucket") == n
    assert value(m, "quiver_read_seconds_bucket", tier="local", le="+Inf") == n
    assert value(m, "quiver_dataset_hits_total", dataset="warm", tier="local") == n
    assert value(m, "quiver_dataset_hits_total", dataset="warm", tier="bucket") == 0
    assert value(m, "quiver_dataset_misses_total", dataset="cold", tier="local") == n
    assert value(m, "quiver_dataset_size_bytes", dataset="cold") == total
    assert value(m, "quiver_datasets") == 2
    assert value(m, "quiver_cache_items") == n
    assert value(m, "quiver_cache_used_bytes") >= total
    assert value(m, "quiver_cache_limit_bytes") == 200 << 30  # the docs' cache-size

    status = json.loads(quiver("--config", cfg, "status", "--json").stdout)
    assert status["counters"]["local_hits"] == value(m, "quiver_hits_total", tier="local")


def start_job(root: Path, dataset: str) -> Path:
    """Job j1 of ``dataset`` under the mount ``root`` (a chunk cycle for it); its
    directory."""
    job = root / ".quiver" / "jobs" / "j1"
    job.mkdir()
    fd = os.open(job / "config", os.O_WRONLY)
    try:
        os.write(fd, json.dumps({"dataset": dataset, "batch_size": 8}).encode())
    finally:
        os.close(fd)
    return job


@needs_fuse
def test_job_and_chunk_metrics(documented_mountd, quiver, synthetic_tree: Tree, tmp_path):
    cfg, port = documented_mountd()
    digest = str(tmp_path / "syn.qd")
    register(quiver, cfg, synthetic_tree.root, digest, "syn")
    job = start_job(tmp_path / "mnt", "syn")
    manifest = json.loads((job / "e0-b0").read_bytes())
    fd = os.open(job / "report", os.O_WRONLY)
    try:
        os.write(fd, b"0 0 0.25\n0 1 0.75\n")
    finally:
        os.close(fd)

    n_chunks = make_plan(digest_format.load(digest), None).n_chunks
    deadline = time.monotonic() + SCRAPE_DEADLINE
    while True:  # the chunk cycle's state arrives from the coordinator logic
        m = scrape(port)
        states = {dict(labels)["state"]: v for (name, labels), v in m.items()
                  if name == "quiver_chunks" and dict(labels)["dataset"] == "syn"}
        if states or time.monotonic() > deadline:
            break
    assert set(states) == {"loading", "active", "marked", "evicted"}
    assert sum(states.values()) == n_chunks

    labels = {"job": "j1", "dataset": "syn"}
    assert value(m, "quiver_jobs") == 1
    # batch 0, and batch 1 once mountd has planned it ahead of the job's next read
    assert value(m, "quiver_job_hits_total", **labels) >= manifest["hits"]
    assert (value(m, "quiver_job_hits_total", **labels)
            + value(m, "quiver_job_fetched_total", **labels)) in (8, 16)
    assert value(m, "quiver_job_epoch", **labels) == 0
    assert value(m, "quiver_job_mean_batch_seconds", **labels) == pytest.approx(0.5)
    os.rmdir(job)
    assert value(scrape(port), "quiver_jobs") == 0


@needs_fuse
def test_loader_pool_metrics(mountd_factory, synthetic_tree: Tree, upload, gcs_emulator):
    """Each pool's processes, and its requests in flight once the reads are done."""
    port = free_port()
    m = mountd_factory(extra_args=("--loader-processes", "1", "--metrics",
                                   f"127.0.0.1:{port}"))
    data = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    mount(m, data, "syn", gcs_emulator.host)
    assert read_tree(Path(m.root) / "syn") == 40
    m.wait_for_loaders()
    deadline = time.monotonic() + SCRAPE_DEADLINE
    while True:  # a fetch's slot is given back once the store's outcome came
        samples = scrape(port)
        if value(samples, "quiver_loader_requests_in_flight", pool="serving") == 0:
            break
        assert time.monotonic() < deadline, "the serving pool's requests never ended"
    for pool, processes in (("serving", MIN_SERVING_PROCESSES), ("ahead", 1)):
        assert value(samples, "quiver_loader_processes", pool=pool) == processes
        assert value(samples, "quiver_loader_request_slots", pool=pool) == (
            processes * THREADS_PER_PROCESS)
        assert value(samples, "quiver_loader_requests_waiting", pool=pool) == 0
    # the reads' misses went to the serving pool, which started with the mount
    assert value(samples, "quiver_loader_processes_running", pool="serving") == 2
    assert value(samples, "quiver_loader_processes_ready", pool="serving") == 2
    assert m.status()["counters"]["loader_process_misses"] == 40


@needs_fuse
def test_native_data_plane_metrics(mountd_factory, synthetic_tree: Tree):
    """The native data plane's counters, as quiver status shows them: a second name's
    files, all cached, are served natively."""
    port = free_port()
    m = mountd_factory(extra_args=("--data-path", "native", "--metrics", f"127.0.0.1:{port}"))
    if m.status()["data_path"] != "native":
        pytest.skip("the native data plane is not built (make native)")
    data = make_digest(synthetic_tree.root, "syn")
    mount(m, data, "cold")
    mount(m, data, "warm")
    assert read_tree(Path(m.root) / "cold") == 40
    assert read_tree(Path(m.root) / "warm") == 40
    samples = scrape(port)
    native = m.status()["native"]
    for key, (name, _) in NATIVE_COUNTERS.items():
        assert value(samples, f"{name}_total") == native[key], key
    assert value(samples, "quiver_native_hits_total") == 40
    assert value(samples, "quiver_native_read_bytes_total") >= digest_format.decode(
        data).total_bytes
    assert value(samples, "quiver_native_fallback_reads_total") == 0


@needs_fuse
def test_http_surface(documented_mountd):
    _, port = documented_mountd()
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers={
        "Accept": "application/openmetrics-text;version=1.0.0,text/plain;q=0.5"})
    with urllib.request.urlopen(request, timeout=10) as reply:  # what Prometheus asks for
        assert reply.headers["Content-Type"].startswith("application/openmetrics-text")
        assert reply.read().endswith(b"# EOF\n")
    # prometheus_client's server answers every path, as Prometheus's own exporters do
    assert value(scrape(port, "/other"), "quiver_datasets") == 0
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", data=b"x")
    with pytest.raises(urllib.error.HTTPError) as info:
        urllib.request.urlopen(request, timeout=10)
    assert info.value.code == 405
    with socket.create_connection(("127.0.0.1", port)) as s:  # a client that hangs up
        s.sendall(b"GET /metr")
    assert value(scrape(port), "quiver_datasets") == 0  # and mountd still answers


@needs_fuse
def test_taken_metrics_port_fails_before_mounting(quiver, tmp_path):
    (tmp_path / "mnt").mkdir()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = quiver("mountd", "--foreground", "--root", str(tmp_path / "mnt"),
                   "--cache-dir", str(tmp_path / "cache"), "--cache-size", "64M",
                   "--control-socket", str(tmp_path / "ctl.sock"),
                   "--metrics", f"127.0.0.1:{port}")
    assert r.returncode == ExitCode.USAGE, r.stderr
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in r.stderr
    assert "another --metrics address" in r.stderr
    assert "Traceback" not in r.stderr
    assert not os.path.ismount(tmp_path / "mnt")


def test_job_benefit_once_probed(tmp_path):
    """The benefit families, from a real JobRegistry's job (probing needs a coordinator
    and a training loop; its outcome, the batch times, is what the collector reads)."""
    store = ContentStore(str(tmp_path / "store"), 1 << 20)
    services = lone_services(store, str(tmp_path / "coordinator"))
    jobs = JobRegistry(MountTable(), services.limiter)
    job = jobs.create("j1", 1000, 1000)
    collector = MountdCollector(services, MountTable(), jobs)

    def samples() -> Samples:
        return scrape_while_serving(collector)

    key = {"job": "j1", "dataset": ""}
    assert ("quiver_job_benefit", frozenset(key.items())) not in samples()
    # a probe of 6 batches: intervals judged 3 batches into an epoch, means of 3; t_hit
    # from the next epoch on. Epochs of 8 batches; the manifest comes before the report.
    job.probe.begin(1, 6)
    reported = []
    for epoch, times in enumerate([(0.01, 0.02, 1.0, 0.9, 1.1, 0.5, 0.5),
                                   (0.01, 0.02, 0.2, 0.3, 0.25, 9.0, 9.0)]):
        job.probe.plan(epoch, 0, 8, cached=True)
        for b, seconds in enumerate(times, start=1):
            job.probe.plan(epoch, b, 8, cached=True)
            job.record_time(epoch, b, seconds)
            reported.append(seconds)
    m = samples()
    assert value(m, "quiver_job_probed_batch_seconds", reads="hit", **key) == pytest.approx(0.25)
    assert value(m, "quiver_job_probed_batch_seconds", reads="miss", **key) == pytest.approx(1.0)
    assert value(m, "quiver_job_benefit", **key) == pytest.approx(4.0)
    assert value(m, "quiver_job_mean_batch_seconds", **key) == pytest.approx(
        sum(reported) / len(reported))
    store.close()


def test_scrapes_during_reads_see_one_moment(tmp_path):
    """Scrapes over HTTP while a loop task counts reads: each sees the hits and their
    bytes from the same moment, every scrape works, and the port closes with the task."""
    store = ContentStore(str(tmp_path / "store"), 1 << 20)
    services = lone_services(store, str(tmp_path / "coordinator"))
    collector = MountdCollector(services, MountTable(), JobRegistry(MountTable(), services.limiter))
    server = MetricsServer(("127.0.0.1", 0), collector)  # port 0: any free one
    port = server.address[1]

    async def count_reads() -> None:
        while True:  # one read of 100 bytes per step, as ItemReader counts them
            services.stats.counters[ReadCounter.LOCAL_HITS] += 1
            services.stats.counters[ReadCounter.LOCAL_BYTES] += 100
            await trio.lowlevel.checkpoint()

    async def main() -> list[Samples]:
        async with trio.open_nursery() as nursery:
            assert await nursery.start(server.serve) == ("127.0.0.1", port)
            nursery.start_soon(count_reads)
            scrapes = [await trio.to_thread.run_sync(scrape, port) for _ in range(20)]
            nursery.cancel_scope.cancel()
        return scrapes

    scrapes = trio.run(main)
    hits = [value(m, "quiver_hits_total", tier="local") for m in scrapes]
    for m, n in zip(scrapes, hits):
        assert value(m, "quiver_bytes_total", tier="local") == 100 * n
        assert value(m, "quiver_cache_limit_bytes") == 1 << 20
    assert hits == sorted(hits) and hits[-1] > 0
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=10).close()
    store.close()


def test_a_stalled_loop_costs_only_its_families(tmp_path, caplog):
    """A scrape that the loop does not answer in time exports the store's numbers, and
    the next scrape, with the loop free again, exports everything."""
    store = ContentStore(str(tmp_path / "store"), 1 << 20)
    services = lone_services(store, str(tmp_path / "coordinator"))
    collector = MountdCollector(services, MountTable(), JobRegistry(MountTable(), services.limiter),
                                TrioLoop(timeout=0.2))
    services.stats.counters[ReadCounter.LOCAL_HITS] = 3
    stalled: list[Samples] = []
    done = threading.Event()

    def scrape_stalled() -> None:
        stalled.append(collected(collector))
        done.set()

    async def main() -> Samples:
        collector.loop.attach()
        scraper = threading.Thread(target=scrape_stalled)
        scraper.start()
        assert done.wait(timeout=10)  # blocks the loop until the scrape gave up on it
        scraper.join()
        return await trio.to_thread.run_sync(collected, collector)

    again = trio.run(main)
    (m,) = stalled
    assert value(m, "quiver_cache_limit_bytes") == 1 << 20
    assert value(m, "quiver_store_writable") == 1
    assert ("quiver_hits_total", frozenset({("tier", "local")})) not in m
    assert "did not answer within 0.2 s" in caplog.text
    assert value(again, "quiver_hits_total", tier="local") == 3
    assert value(again, "quiver_cache_limit_bytes") == 1 << 20
    store.close()


class IdleCollector:
    """A collector with nothing of its own: only the process's numbers are served."""

    def __init__(self) -> None:
        self.loop = TrioLoop()

    def collect(self) -> list:
        return []


def test_idle_connections_cannot_take_the_endpoint(monkeypatch):
    """Connections that send nothing are closed after REQUEST_TIMEOUT, and past
    MAX_CONNECTIONS at once they are closed straight away: scrapes go on."""
    monkeypatch.setattr(metrics_server._QuietHandler, "timeout", 0.5)
    server = MetricsServer(("127.0.0.1", 0), IdleCollector())
    try:
        idle = [socket.create_connection(server.address) for _ in range(
            metrics_server.MAX_CONNECTIONS + 8)]
        deadline = time.monotonic() + 10
        while True:  # the idle ones time out; then a scrape is served again
            try:
                with urllib.request.urlopen(f"http://{server.address[0]}:{server.address[1]}"
                                            "/metrics", timeout=2) as reply:
                    assert b"process_cpu_seconds_total" in reply.read()
                break
            except OSError:
                assert time.monotonic() < deadline, "the endpoint stayed blocked"
        for s in idle:
            s.settimeout(5)
            assert s.recv(1) == b""  # closed by the server, not left open
            s.close()
    finally:
        server.close()

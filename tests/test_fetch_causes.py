"""Bucket fetches counted by cause, as a real mountd reports them: ``quiver status``
(JSON and text) and the Prometheus endpoint."""
from __future__ import annotations

import json
import os
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from quiverfs.bench.data import Tree
from quiverfs.bench.processes import MountdProcess, free_port, unmount
from quiverfs.counters import FetchCause
from tests.mountd_helpers import make_digest, mount

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

PREFETCH_DEADLINE = 60.0  # seconds for `quiver prefetch` of the small tree to finish


@pytest.fixture
def metered(tmp_path) -> Iterator[tuple[MountdProcess, int]]:
    """A real mountd serving Prometheus metrics; (it, the metrics port). It must exit 0."""
    root, cache = tmp_path / "mnt", tmp_path / "cache"
    root.mkdir()
    cache.mkdir()
    port = free_port()
    m = MountdProcess(str(root), str(cache), "1G", str(tmp_path / "mountd.log"),
                      extra_args=("--metrics", f"127.0.0.1:{port}"))
    m.start()
    try:
        yield m, port
    finally:
        rc = m.stop()
        unmount(m.root)
    assert rc == 0, m.log_tail()
    assert "Traceback" not in m.log_tail(1000)


def status(quiver: Callable, m: MountdProcess, *args: str) -> str:
    r = quiver("status", "--root", m.root, "--control-socket", m.socket, *args)
    assert r.returncode == 0, r.stderr
    return r.stdout


def scraped(port: int, family: str) -> dict[tuple[str, str], float]:
    """(dataset, cause) -> value of ``family``'s samples."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    return {(s.labels["dataset"], s.labels["cause"]): s.value
            for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == family}


def read_every_file(root: str) -> int:
    n = 0
    for dirpath, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(dirpath, name), "rb") as f:
                f.read()
            n += 1
    return n


def prefetched(quiver: Callable, m: MountdProcess) -> dict:
    """The one dataset's status entry once its prefetch has finished."""
    deadline = time.monotonic() + PREFETCH_DEADLINE
    while True:
        (ds,) = json.loads(status(quiver, m, "--json"))["datasets"]
        if ds["prefetch"]["finished"]:
            return ds
        assert time.monotonic() < deadline, "the prefetch did not finish"
        time.sleep(0.1)


def only(cause: FetchCause, fetches: int, nbytes: int) -> dict[str, dict[str, int]]:
    """A bucket_fetch_causes map with ``fetches`` for ``cause`` and nothing else."""
    return {c.value: ({"fetches": fetches, "bytes": nbytes} if c is cause
                      else {"fetches": 0, "bytes": 0}) for c in FetchCause}


def test_exact_reads_of_uncached_files_are_exact_fetches(metered, quiver,
                                                         synthetic_tree: Tree):
    m, port = metered
    mount(m, make_digest(synthetic_tree.root, "syn"), "cold")
    n = read_every_file(os.path.join(m.root, "cold"))
    assert n == synthetic_tree.files

    reply = json.loads(status(quiver, m, "--json"))
    (ds,) = reply["datasets"]
    expected = only(FetchCause.EXACT, n, synthetic_tree.bytes)
    assert ds["bucket_fetch_causes"] == expected
    assert reply["bucket_fetch_causes"] == expected
    assert (sum(c["fetches"] for c in ds["bucket_fetch_causes"].values())
            == ds["counters"]["bucket_fetches"])

    fetches = scraped(port, "quiver_bucket_fetches_total")
    fetch_bytes = scraped(port, "quiver_bucket_fetch_bytes_total")
    assert fetches == {("cold", c.value): expected[c.value]["fetches"] for c in FetchCause}
    assert fetch_bytes == {("cold", c.value): expected[c.value]["bytes"] for c in FetchCause}

    assert f"bucket fetches by cause: exact {n} (" in status(quiver, m)


def test_prefetch_fetches_are_prefetch_and_later_reads_fetch_nothing(metered, quiver,
                                                                     synthetic_tree: Tree):
    m, port = metered
    mount(m, make_digest(synthetic_tree.root, "syn"), "warm")
    r = quiver("prefetch", "warm", "--root", m.root, "--control-socket", m.socket)
    assert r.returncode == 0, r.stderr
    ds = prefetched(quiver, m)
    expected = only(FetchCause.PREFETCH, synthetic_tree.files, synthetic_tree.bytes)
    assert ds["prefetch"]["failed"] == 0
    assert ds["bucket_fetch_causes"] == expected

    assert read_every_file(os.path.join(m.root, "warm")) == synthetic_tree.files
    (ds,) = json.loads(status(quiver, m, "--json"))["datasets"]
    assert ds["bucket_fetch_causes"] == expected  # every read was a hit
    assert scraped(port, "quiver_bucket_fetches_total")[("warm", "prefetch")] == \
        synthetic_tree.files
    assert scraped(port, "quiver_bucket_fetch_bytes_total")[("warm", "exact")] == 0

"""Misses from a GCS bucket fetched, checked and stored by the loader processes that
serve readers (``ItemReader.fetch`` through ``LoaderPool.fetch``), through a real
mount and the emulator: the bytes reach the reader before the store has them, a killed
process costs one retry, corrupt objects are EIO and never stored, one fetch per item
however many readers miss it, and each dataset's ``fetch_depth``."""
from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import os
import signal
import sqlite3
import subprocess
import sys

import pytest

from mountd.fetch.item_reader import LOCAL_FETCH_DEPTH
from mountd.fetch.loader_pool import MIN_SERVING_PROCESSES, THREADS_PER_PROCESS
from quiverfs import digest as digest_format
from quiverfs.bench.processes import MountdProcess
from quiverfs.bench.throttle_proxy import throttled
from tests.mountd_helpers import dataset_counters, make_digest, mount, mountd_factory  # noqa: F401
from tests.test_loader_pool import bucket, fetching, loader_pids, read_file, stored, wait_for

needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
pytestmark = needs_fuse

SERVING = 0  # the niceness of the loader processes that serve misses


@pytest.fixture
def gcs_digest(synthetic_tree, upload, gcs_emulator) -> bytes:
    return make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)


def start(mountd_factory, processes: int = 1) -> MountdProcess:
    return mountd_factory(extra_args=("--loader-processes", str(processes),
                                      "--probe-batches", "0"))


def source_of(synthetic_tree, path: str) -> bytes:
    return read_file(os.path.join(synthetic_tree.root, path))


def test_a_miss_is_served_before_its_store_write_finishes(mountd_factory, gcs_digest,
                                                          gcs_emulator, synthetic_tree):
    digest = digest_format.decode(gcs_digest)
    m = start(mountd_factory)
    mount(m, gcs_digest, "syn", gcs_emulator.host)
    first, second = digest.path(0), digest.path(1)
    assert read_file(os.path.join(m.root, "syn", first)) == source_of(synthetic_tree, first)
    wait_for("the first store write", lambda: digest.hash(0) in stored(m), timeout=30)
    # Hold the store's index for writing: a loader process's store write waits for it.
    index = sqlite3.connect(os.path.join(m.cache_dir, "store", "cache.db"), timeout=30)
    try:
        index.execute("BEGIN EXCLUSIVE")
        served = read_file(os.path.join(m.root, "syn", second))
        assert served == source_of(synthetic_tree, second)
        held = {row[0] for row in index.execute("SELECT key FROM Cache")}
        assert digest.hash(0) in held and digest.hash(1) not in held  # not written yet
    finally:
        index.rollback()
        index.close()
    # released, the write goes through: the item is stored, from that one fetch
    wait_for("the store write", lambda: digest.hash(1) in stored(m), timeout=30)
    assert stored(m)[digest.hash(1)] == served
    c = dataset_counters(m, "syn")
    assert c["loader_process_misses"] == 2 and c["bucket_fetches_exact"] == 2
    assert loader_pids(m, SERVING)


def test_a_loader_process_killed_mid_fetch_costs_one_retry(mountd_factory, gcs_digest,
                                                           gcs_emulator, synthetic_tree):
    digest = digest_format.decode(gcs_digest)
    path = digest.path(3)
    with throttled(gcs_emulator.host, rate=10e6, latency=1.0) as proxy:
        m = start(mountd_factory)
        mount(m, gcs_digest, "syn", proxy.url)
        # the first miss starts the serving process, then waits a second for its bytes
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            reading = pool.submit(read_file, os.path.join(m.root, "syn", path))
            (victim,) = wait_for("the serving loader process's fetch", lambda: {
                pid for pid in loader_pids(m, SERVING) if fetching(pid)})
            os.kill(victim, signal.SIGKILL)
            assert reading.result(timeout=60) == source_of(synthetic_tree, path)
        assert f"loader process {victim} exited" in m.log_tail(200)
        assert f"fetching {path} in mountd" in m.log_tail(200)
        c = dataset_counters(m, "syn")
        # one fetch counted: the retry in mountd, which stored it
        assert c["bucket_fetches_exact"] == 1 and c.get("loader_process_misses", 0) == 0
        assert c.get("bucket_errors", 0) == 0 and c.get("integrity_failures", 0) == 0
        assert stored(m)[digest.hash(3)] == source_of(synthetic_tree, path)
        # another is started in its place, and the next miss goes to the pool again
        serving = wait_for("a new serving process", lambda: (
            len(pids := loader_pids(m, SERVING)) == MIN_SERVING_PROCESSES and pids))
        assert victim not in serving
        other = digest.path(4)
        assert read_file(os.path.join(m.root, "syn", other)) == source_of(synthetic_tree, other)
        assert dataset_counters(m, "syn")["loader_process_misses"] == 1
        assert m.stop() == 0


def test_a_corrupt_object_is_eio_and_never_stored(mountd_factory, gcs_digest, gcs_emulator,
                                                  gcs_bucket, synthetic_tree):
    digest = digest_format.decode(gcs_digest)
    blob = bucket(gcs_emulator, gcs_bucket).blob(f"syn/{digest.key(5)}")
    content = blob.download_as_bytes()
    blob.upload_from_string(content[:-16] + bytes(16 * [0xA5]))  # same size, other bytes
    m = start(mountd_factory)
    mount(m, gcs_digest, "syn", gcs_emulator.host)
    with pytest.raises(OSError) as info:
        read_file(os.path.join(m.root, "syn", digest.path(5)))
    assert info.value.errno == errno.EIO
    good = digest.path(6)
    assert read_file(os.path.join(m.root, "syn", good)) == source_of(synthetic_tree, good)
    assert digest.hash(5) not in stored(m)
    c = dataset_counters(m, "syn")
    assert c["integrity_failures"] == 1 and c["loader_process_misses"] == 1
    assert "does not match its digest hash" in m.log_tail(200)


def read_in_child(path: str) -> subprocess.Popen:
    """A process that reads ``path`` whole and prints its SHA-256."""
    code = ("import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], 'rb').read())"
            ".hexdigest())")
    return subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.PIPE,
                            text=True)


def test_jobs_missing_the_same_item_fetch_it_once(mountd_factory, gcs_digest, gcs_emulator):
    """Two jobs (processes) on two names of the same content: two kernel inodes, two
    READs in mountd at once, one fetch in a loader process."""
    digest = digest_format.decode(gcs_digest)
    with throttled(gcs_emulator.host, rate=10e6, latency=0.5) as proxy:
        m = start(mountd_factory)
        mount(m, gcs_digest, "a", proxy.url)
        mount(m, gcs_digest, "b", proxy.url)
        for i in range(4):
            readers = [read_in_child(os.path.join(m.root, name, digest.path(i)))
                       for name in ("a", "b")]
            hashes = {r.communicate(timeout=60)[0].strip() for r in readers}
            assert hashes == {digest.hash(i).hex()}
        a, b = dataset_counters(m, "a"), dataset_counters(m, "b")
        fetched = a.get("bucket_fetches_exact", 0) + b.get("bucket_fetches_exact", 0)
        assert fetched == 4
        assert a.get("coalesced", 0) + b.get("coalesced", 0) == 4
        assert m.stop() == 0


def test_each_dataset_shows_its_fetch_depth(mountd_factory, gcs_digest, gcs_emulator,
                                            synthetic_tree):
    local = make_digest(synthetic_tree.root, "local")
    m = start(mountd_factory, processes=3)
    mount(m, gcs_digest, "bucket", gcs_emulator.host)
    mount(m, local, "local")
    none = mountd_factory(name="inmountd", extra_args=("--loader-processes", "0",
                                                       "--threads", "6"))
    mount(none, gcs_digest, "bucket", gcs_emulator.host)
    mount(none, local, "local")
    depth = {(n, ds["name"]): ds["fetch_depth"]
             for n, d in (("pool", m), ("none", none)) for ds in d.status()["datasets"]}
    assert MIN_SERVING_PROCESSES < 3
    assert depth == {("pool", "bucket"): 3 * THREADS_PER_PROCESS,
                     ("pool", "local"): LOCAL_FETCH_DEPTH,
                     ("none", "bucket"): 6, ("none", "local"): 6}


def test_mounting_a_bucket_dataset_starts_the_serving_processes(mountd_factory, gcs_digest,
                                                               gcs_emulator, synthetic_tree):
    m = start(mountd_factory)
    mount(m, make_digest(synthetic_tree.root, "local"), "local")
    assert not loader_pids(m)  # a local directory's misses are fetched in mountd
    assert m.status()["loader_processes"]["serving"]["running"] == 0
    mount(m, gcs_digest, "bucket", gcs_emulator.host)
    m.wait_for_loaders(timeout=60)  # before any read
    pools = m.status()["loader_processes"]
    assert pools["serving"] == {"processes": MIN_SERVING_PROCESSES,
                                "running": MIN_SERVING_PROCESSES,
                                "ready": MIN_SERVING_PROCESSES,
                                "threads": THREADS_PER_PROCESS, "niceness": SERVING,
                                "slots": MIN_SERVING_PROCESSES * THREADS_PER_PROCESS,
                                "in_flight": 0, "waiting": 0}
    assert pools["ahead"]["running"] == 0  # chunk loads start theirs at the first load
    assert len(loader_pids(m, SERVING)) == MIN_SERVING_PROCESSES
    assert dataset_counters(m, "bucket").get("loader_process_misses", 0) == 0

"""mountd on a bad disk, end to end: a full store and a damaged index cost no read,
serve no wrong byte, and never stop the daemon (the fixture fails a test on a traceback
in mountd's log or an unclean exit)."""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import json
import os
import shutil
import sqlite3
import subprocess
import time
from collections.abc import Iterator

import pytest

from mountd.fetch.loader_pool import MIN_SERVING_PROCESSES, THREADS_PER_PROCESS
from mountd.store.index import DAMAGED_SUFFIX
from quiverfs.bench.processes import MountdProcess
from quiverfs.bench.read import drop_page_cache
from tests.mountd_helpers import (dataset_counters, make_digest, mount,  # noqa: F401
                                  mountd_factory, read_hashes, tree_hashes)
from tests.test_content_store import damage_pages, fill, mounted_tmpfs, value_files

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

RECOVERY_DEADLINE = 30.0  # seconds: the store tries writing again every 5 s
POLL = 0.1  # seconds between looks at a daemon's state


def reread(m: MountdProcess, name: str, path: str) -> str:
    """Read a file through the mount with the kernel's cached pages of it dropped, so the
    read reaches mountd."""
    with open(os.path.join(m.root, name, path), "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return hashlib.sha256(f.read()).hexdigest()


def store_dir(m: MountdProcess) -> str:
    return os.path.join(m.cache_dir, "store")


@pytest.fixture
def dataset(synthetic_tree, tmp_path) -> tuple[str, bytes, dict[str, str]]:
    """A copy of the synthetic tree (about 4.3 MB), its digest and its files' hashes."""
    src = str(tmp_path / "src")
    shutil.copytree(synthetic_tree.root, src)
    return src, make_digest(src, "syn"), tree_hashes(src)


@pytest.fixture
def small_cache_dir(tmp_path):
    """A cache directory on a 2 MiB tmpfs, smaller than the dataset (ask for it before
    mountd_factory, so that mountd has stopped when it is unmounted)."""
    with mounted_tmpfs(str(tmp_path / "small-cache"), "2m") as path:
        yield path


# -- a full disk ----------------------------------------------------------------------

def fill_the_store(small_cache_dir, mountd_factory, dataset) -> tuple[MountdProcess, dict]:
    """Read the whole dataset through a mountd whose store does not fit it."""
    _, digest, expected = dataset
    m = mountd_factory(cache_size="64M", cache_dir=small_cache_dir)
    mount(m, digest, "syn")
    assert read_hashes(os.path.join(m.root, "syn"), sorted(expected)) == expected
    return m, expected


def test_a_full_store_serves_reads_uncached(small_cache_dir, mountd_factory, dataset, quiver):
    m, expected = fill_the_store(small_cache_dir, mountd_factory, dataset)
    cache = m.status()["cache"]
    assert not cache["writable"] and cache["write_error"] == "No space left on device"
    assert 0 < cache["items"] < len(expected)
    assert cache["write_failures"] == len(expected) - cache["items"]
    assert dataset_counters(m, "syn")["bucket_fetches"] == len(expected)
    assert len(value_files(store_dir(m))) == cache["items"]  # nothing written in part
    shown = quiver("status", "--root", m.root, "--control-socket", m.socket)
    assert shown.returncode == 0, shown.stderr
    assert "cache NOT WRITABLE since" in shown.stdout
    assert "No space left on device" in shown.stdout


def test_a_full_store_recovers_when_space_returns(small_cache_dir, mountd_factory, dataset):
    m, expected = fill_the_store(small_cache_dir, mountd_factory, dataset)
    held = m.status()["cache"]["items"]
    subprocess.run(["mount", "-o", "remount,size=64m", small_cache_dir], check=True)
    # Reads of an item the store does not hold try a put each; one after the back-off
    # stores it.
    victim = sorted(expected)[-1]
    deadline = time.monotonic() + RECOVERY_DEADLINE
    while not m.status()["cache"]["writable"]:
        assert time.monotonic() < deadline, m.status()["cache"]
        assert reread(m, "syn", victim) == expected[victim]
        time.sleep(POLL)
    assert m.status()["cache"]["items"] == held + 1
    # every item not cached yet is stored on its next read
    for path in expected:
        assert reread(m, "syn", path) == expected[path]
    cache = m.status()["cache"]
    assert cache["items"] == len(expected) and cache["write_error"] is None


def test_mountd_starts_on_a_full_disk(small_cache_dir, mountd_factory, dataset):
    m, expected = fill_the_store(small_cache_dir, mountd_factory, dataset)
    held = m.status()["cache"]["items"]
    assert m.stop() == 0
    filler = fill(store_dir(m))
    m2 = mountd_factory(cache_size="64M", cache_dir=small_cache_dir)
    cache = m2.status()["cache"]
    assert not cache["writable"] and cache["write_error"].startswith("cannot open the store")
    assert read_hashes(os.path.join(m2.root, "syn"), sorted(expected)) == expected
    os.remove(filler)
    deadline = time.monotonic() + RECOVERY_DEADLINE
    while not m2.status()["cache"]["writable"]:
        assert time.monotonic() < deadline, m2.status()["cache"]
        time.sleep(POLL)
    assert m2.status()["cache"]["items"] == held


def test_a_full_disk_changes_no_registration(small_cache_dir, mountd_factory, dataset, quiver,
                                            tmp_path):
    _, digest, expected = dataset
    digest_file = tmp_path / "syn.qd"
    digest_file.write_bytes(digest)
    m = mountd_factory(cache_size="64M", cache_dir=small_cache_dir)
    mount(m, digest, "syn")
    state = os.path.join(small_cache_dir, "state")
    records = os.path.join(state, "registrations.json")
    with open(records, "rb") as f:
        saved = f.read()
    kept = os.listdir(os.path.join(state, "digests"))
    filler = fill(small_cache_dir)

    def ask(*args: str) -> subprocess.CompletedProcess:
        return quiver(*args, "--root", m.root, "--control-socket", m.socket)

    gone = ask("umount", "syn")
    assert gone.returncode == 8 and "cannot save its registrations" in gone.stderr
    copy = ask("mount", str(digest_file), "--name", "copy")
    assert copy.returncode == 8 and "cannot save its registrations" in copy.stderr
    # what the mount shows is what is saved: the dataset, its record and its digest
    assert [ds["name"] for ds in m.status()["datasets"]] == ["syn"]
    assert read_hashes(os.path.join(m.root, "syn"), sorted(expected)) == expected
    with open(records, "rb") as f:
        assert f.read() == saved
    assert os.listdir(os.path.join(state, "digests")) == kept

    os.remove(filler)
    assert m.stop() == 0
    m = mountd_factory(name="again", cache_size="64M", cache_dir=small_cache_dir)
    assert [ds["name"] for ds in m.status()["datasets"]] == ["syn"]
    assert read_hashes(os.path.join(m.root, "syn"), sorted(expected)) == expected
    assert ask("umount", "syn").returncode == 0  # room again: now it goes, on disk too
    with open(records, encoding="utf-8") as f:
        assert json.load(f) == []
    assert os.listdir(os.path.join(state, "digests")) == []


# -- a damaged index ------------------------------------------------------------------

def garbage_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(os.urandom(100))


def damaged_pages(path: str) -> None:
    damage_pages(path, 0.25, 0.75)


def truncated(path: str) -> None:
    os.truncate(path, 0)


@pytest.mark.parametrize("damage", [garbage_header, damaged_pages, truncated])
def test_a_damaged_index_means_a_clean_start(mountd_factory, dataset, damage):
    _, digest, expected = dataset
    m = mountd_factory()
    mount(m, digest, "syn")
    assert read_hashes(os.path.join(m.root, "syn"), sorted(expected)) == expected
    assert m.status()["cache"]["items"] == len(expected)
    assert m.stop() == 0
    db = os.path.join(store_dir(m), "cache.db")
    damage(db)

    m2 = mountd_factory(cache_dir=m.cache_dir)
    cache = m2.status()["cache"]
    assert cache["items"] == 0 and cache["writable"]
    assert value_files(store_dir(m)) == []  # the old values, named by no row, are gone
    aside = [n for n in os.listdir(store_dir(m)) if DAMAGED_SUFFIX in n
             and not n.endswith("-wal")]
    assert len(aside) == (0 if damage is truncated else 1)
    log = m2.log_tail(200)
    assert log.count("the index was damaged" if damage is not truncated
                     else "value files the index does not name") == 1
    assert read_hashes(os.path.join(m2.root, "syn"), sorted(expected)) == expected
    assert dataset_counters(m2, "syn")["bucket_fetches"] == len(expected)
    assert m2.status()["cache"]["items"] == len(expected)
    assert len(value_files(store_dir(m))) == len(expected)  # each item a file


def test_corrupted_chunk_cycle_state_is_moved_aside(mountd_factory, dataset):
    _, digest, expected = dataset
    m = mountd_factory()
    mount(m, digest, "syn")
    assert m.stop() == 0
    state = os.path.join(m.cache_dir, "state", "coordinator", "coordinator.json")
    with open(state, "wb") as f:
        f.write(b'{"nodes": 5')
    m2 = mountd_factory(cache_dir=m.cache_dir)
    assert read_hashes(os.path.join(m2.root, "syn"), sorted(expected)) == expected
    assert os.path.exists(state + ".corrupted")
    log = m2.log_tail(50)
    assert "is corrupted" in log and "started the chunk cycles afresh" in log


# -- a hung store writer --------------------------------------------------------------

HUNG_READ_BOUND = 1.0  # seconds: the slowest read while the store's writer hangs
HUNG_STOP_BOUND = 10.0  # seconds: mountd's exit at SIGTERM while the writer hangs
# Seconds: the slowest of 40 misses from the emulator at once while the writer hangs
# (without a hang, such a read takes up to 1.4 s here: the emulator's own delays)
HUNG_COLD_READ_BOUND = 5.0


@contextlib.contextmanager
def index_write_locked(m: MountdProcess) -> Iterator[None]:
    """Hold the SQLite write lock of mountd's index from this process (as a loader
    process hung in its transaction would) until the block ends."""
    con = sqlite3.connect(os.path.join(store_dir(m), "cache.db"), isolation_level=None)
    try:
        con.execute("BEGIN IMMEDIATE")
        yield
        con.execute("ROLLBACK")
    finally:
        con.close()


def stored_within(m: MountdProcess, items: int) -> None:
    """Wait until the store holds ``items`` items (puts are made after the reads)."""
    deadline = time.monotonic() + RECOVERY_DEADLINE
    while m.status()["cache"]["items"] < items:
        assert time.monotonic() < deadline, m.status()["cache"]
        time.sleep(POLL)
    assert m.status()["cache"]["items"] == items


def timed_reads(m: MountdProcess, paths: list[str], expected: dict[str, str],
                threads: int) -> list[float]:
    """Read ``paths`` of dataset "syn" through the mount, ``threads`` at once (pages
    dropped first, so each reaches mountd); each one's seconds. Every read is right."""
    def timed(path: str) -> float:
        started = time.monotonic()
        assert reread(m, "syn", path) == expected[path], path
        return time.monotonic() - started

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return list(pool.map(timed, paths))


def test_a_hung_store_writer_holds_no_read(mountd_factory, dataset):
    """Another process holds the index's write lock: every miss's store write waits on
    it. Hits (their pages not cached: each takes a worker) and misses are served at
    once all the same, with 2 workers and 8 readers; once the lock is let go the
    misses are stored. Before, each miss's store write held a worker for up to 60 s,
    and the hits waited for them."""
    _, digest, expected = dataset
    m = mountd_factory(extra_args=("--threads", "2"))
    mount(m, digest, "syn")
    paths = sorted(expected)
    cached, missed = paths[::2], paths[1::2]
    assert timed_reads(m, cached, expected, 4)
    stored_within(m, len(cached))
    drop_page_cache(value_files(store_dir(m)))  # each hit reads its file in a worker
    with index_write_locked(m):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            misses = pool.submit(timed_reads, m, missed, expected, 4)
            hits = pool.submit(timed_reads, m, cached, expected, 4)
            took = misses.result() + hits.result()
        assert max(took) <= HUNG_READ_BOUND, sorted(took)[-5:]
        assert m.status()["cache"]["items"] == len(cached)  # none stored meanwhile
    stored_within(m, len(paths))
    assert dataset_counters(m, "syn")["bucket_fetches"] == len(paths)


def test_a_hung_store_writer_holds_no_loader_slot(mountd_factory, synthetic_tree, upload,
                                                  gcs_emulator):
    """The same for misses from a GCS bucket, which loader processes fetch and store:
    more misses at once than the processes' slots are all served at once, and stored
    once the lock is let go. Before, each held its slot until its store write ended (up
    to 60 s), and the misses beyond the slots waited for them."""
    expected = tree_hashes(synthetic_tree.root)
    digest = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    m = mountd_factory(extra_args=("--loader-processes", "1"))  # 2 serving, 32 slots
    mount(m, digest, "syn", gcs_emulator.host)
    m.wait_for_loaders()
    paths = sorted(expected)
    assert len(paths) > MIN_SERVING_PROCESSES * THREADS_PER_PROCESS
    with index_write_locked(m):
        took = timed_reads(m, paths, expected, len(paths))
        assert max(took) <= HUNG_COLD_READ_BOUND, sorted(took)[-5:]
        assert m.status()["cache"]["items"] == 0
    stored_within(m, len(paths))
    assert dataset_counters(m, "syn")["bucket_fetches"] == len(paths)


def test_mountd_stops_promptly_while_a_store_writer_hangs(mountd_factory, dataset):
    """SIGTERM while the index's write lock is held and misses' puts wait for it:
    mountd exits cleanly within HUNG_STOP_BOUND, leaving the hung write to its exit
    (the puts are not stored; a read after a restart fetches them again). Before, its
    close waited for the store's write lock behind the hung put, past the 30 s after
    which the harness kills it."""
    _, digest, expected = dataset
    m = mountd_factory()
    mount(m, digest, "syn")
    with index_write_locked(m):
        assert timed_reads(m, sorted(expected), expected, 4)
        started = time.monotonic()
        assert m.stop() == 0
        assert time.monotonic() - started <= HUNG_STOP_BOUND
    assert "writes not done at close" in m.log_tail(50)
    m = mountd_factory(cache_dir=m.cache_dir)
    assert read_hashes(os.path.join(m.root, "syn"), sorted(expected)) == expected

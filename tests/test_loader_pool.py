"""Loader processes: chunk loads from a GCS bucket (the emulator) fetched, checked and
stored by mountd's loader processes, through a real mount; their handle on the store;
the option that sets how many."""
from __future__ import annotations

import errno
import hashlib
import os
import signal
import time
from collections.abc import Callable

import diskcache
import pytest
import trio
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from mountd.fetch.loader_pool import AHEAD_NICENESS, LoaderPool
from mountd.fetch.loader_process import LoadSource
from mountd.store import health as store_health
from mountd.store.content_store import ContentStore
from mountd.store.errors import IntegrityError
from mountd.store.writer import StoreWriter
from quiverfs import digest as digest_format
from quiverfs.bench.emulator import Emulator
from quiverfs.bench.processes import MountdProcess
from quiverfs.bench.throttle_proxy import throttled
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import dataset_counters, make_digest, mount, mountd_factory  # noqa: F401

needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

SETTLE_TIMEOUT = 90.0  # seconds for a job's chunk loads to finish
# Half the synthetic tree's ~4.4 MB: the dataset is cached in chunks (a whole one would
# be cached in full, without chunk loads).
CACHE = "2M"


@pytest.fixture
def loader_mountd(mountd_factory) -> Callable[[int], MountdProcess]:
    """``loader_mountd(N)`` starts a mountd with N loader processes (they log to its
    log, which must hold no traceback) whose jobs are never probed."""
    def start(processes: int) -> MountdProcess:
        return mountd_factory(cache_size=CACHE, extra_args=(
            "--loader-processes", str(processes), "--probe-batches", "0"))
    return start


@pytest.fixture
def gcs_dataset(synthetic_tree, upload, gcs_emulator) -> bytes:
    """The digest of the synthetic tree, uploaded to a bucket under syn/."""
    return make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)


def loader_pids(m: MountdProcess, niceness: int | None = None) -> set[int]:
    """The running loader processes of mountd ``m`` (or left behind by it); with
    ``niceness``, those of the pool at that niceness (AHEAD_NICENESS: chunk loads)."""
    store = os.path.join(m.cache_dir, "store").encode()
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            with open(f"/proc/{entry}/stat", encoding="utf-8") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone since the listing
        if (any(b"mountd.fetch.loader_process" in a for a in argv) and store in argv
                and state != "Z"
                and (niceness is None or argv[-2] == str(niceness).encode())):
            pids.add(int(entry))
    return pids


def fetching(pid: int) -> bool:
    """Whether process ``pid`` has a socket open: a loader process has one only for its
    fetches (it talks to mountd through pipes)."""
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
                   for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False  # gone, or a descriptor closed since the listing


def wait_for(what: str, check: Callable[[], object], timeout: float = SETTLE_TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def start_job(m: MountdProcess, name: str) -> QuiverBatchSampler:
    """A substitutable job on ``name`` whose first batch is planned: its chunks load."""
    sampler = QuiverBatchSampler(os.path.join(m.root, name), 8, seed=1)
    sampler.manifest(0)
    return sampler


def settled(m: MountdProcess, name: str) -> dict:
    """The dataset's counters once its job's chunks are loaded: as many resident as the
    cycle keeps, none loading."""
    def done() -> dict | None:
        jobs = [j for j in m.status()["jobs"] if j["dataset"] == name]
        chunks = jobs[0]["chunks"] if jobs else None
        if not chunks:
            return None
        states = [chunks["states"][c] for c in chunks["resident"]]
        full = len(states) == min(chunks["capacity"], len(chunks["states"]))
        if full and "loading" not in states:
            return dataset_counters(m, name)
        return None
    return wait_for("the chunk loads", done)


def stored(m: MountdProcess) -> dict[bytes, bytes]:
    """Every entry of mountd's store (digest -> content), read with diskcache itself."""
    with diskcache.Cache(os.path.join(m.cache_dir, "store")) as cache:
        return {key: cache[key] for key in list(cache.iterkeys())}


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def bucket(emulator: Emulator, name: str) -> storage.Bucket:
    client = storage.Client(project="test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": emulator.host})
    return client.bucket(name)


def test_a_loader_process_stores_only_what_hashes_to_its_digest(tmp_path):
    directory = str(tmp_path / "store")
    store = ContentStore(directory, 1 << 30)
    writer = StoreWriter(directory, 1 << 30)
    data = os.urandom(100_000)
    digest = hashlib.sha256(data).digest()
    with pytest.raises(IntegrityError):
        writer.put(digest, data[:-1] + bytes([data[-1] ^ 1]))
    file = writer.put(digest, data)
    writer.release()
    store.stored_elsewhere(digest, file)
    assert store.get(digest) == data
    assert len(store) == 1 and store.check() == []
    store.close()


def test_mountd_opens_the_index_only_while_no_loader_process_holds_it(tmp_path, monkeypatch):
    """Opening an index removes the value files it does not name, and a damaged one is
    moved aside: neither may happen under a loader process's write."""
    monkeypatch.setattr(store_health, "WRITE_RETRY_INTERVAL", 0.0)
    directory = str(tmp_path / "store")
    writer = StoreWriter(directory, 1 << 30)
    data = os.urandom(100_000)
    digest = hashlib.sha256(data).digest()
    writer.put(digest, data)  # and holds the index until released
    store = ContentStore(directory, 1 << 30)
    assert not store.health().writable and store.get(digest) is None
    writer.release()
    assert store.get(digest) == data and store.health().writable
    assert store.check() == []
    store.close()


def test_what_loader_processes_evict_mountd_knows_gone_without_a_look(tmp_path, gcs_emulator,
                                                                     gcs_bucket):
    """A loader process's put that evicts entries to make room says which: mountd's
    store then knows, without asking the index, which entries it holds (the view plans
    its hits so, and a hit planned of an evicted item is an open given back)."""
    directory = str(tmp_path / "store")
    datas = [os.urandom(50_000) for _ in range(12)]
    digests = [hashlib.sha256(d).digest() for d in datas]
    blobs = bucket(gcs_emulator, gcs_bucket)
    for n, data in enumerate(datas):
        blobs.blob(f"o/{n}").upload_from_string(data)
    store = ContentStore(directory, 5 * 50_000)  # room for five
    source = LoadSource(f"gs://{gcs_bucket}/o", None, gcs_emulator.host, True, 30.0)

    def agreed() -> bool:
        with diskcache.Cache(directory) as index:
            present = set(index.iterkeys())
        return (len(present) == 5
                and [store.files.holds(d) for d in digests] == [d in present for d in digests])

    async def load_all() -> None:
        pool = LoaderPool(1, store, trio.CapacityLimiter(4))
        async with trio.open_nursery() as nursery:
            await nursery.start(pool.run)
            for n, data in enumerate(datas):
                assert await pool.load(0, source, str(n), 0, len(data), digests[n]) == len(data)
            with trio.fail_after(SETTLE_TIMEOUT):  # the last put's news follows its reply
                while not agreed():
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    try:
        trio.run(load_all)
        assert [store.files.holds(d) for d in digests] == [False] * 7 + [True] * 5
        assert [store.get(d) for d in digests[7:]] == datas[7:]
    finally:
        store.close()


@needs_fuse
def test_chunk_loads_store_exactly_the_right_bytes(loader_mountd, gcs_dataset, gcs_emulator,
                                                   gcs_bucket, synthetic_tree):
    data = gcs_dataset
    digest = digest_format.decode(data)
    m = loader_mountd(2)
    mount(m, data, "syn", gcs_emulator.host)
    sampler = start_job(m, "syn")
    try:  # the job holds its chunks resident until it leaves
        c = settled(m, "syn")
        assert len(loader_pids(m, AHEAD_NICENESS)) == 2
        assert c["loader_process_fetches"] > 0
        assert c["bucket_fetches_chunk_load"] == c["loader_process_fetches"]
        assert c.get("integrity_failures", 0) == 0 and c.get("bucket_errors", 0) == 0

        entries = stored(m)  # the resident chunks' items, and the job's first misses
        assert entries
        paths = {digest.hash(i): digest.path(i) for i in range(len(digest))}
        for key, value in entries.items():
            assert hashlib.sha256(value).digest() == key and key in paths

        for blob in bucket(gcs_emulator, gcs_bucket).list_blobs():
            blob.delete()  # what the mount serves now cannot come from the bucket
        # The cycle may still move on past chunks the job's two planned batches took all
        # of its items from: a read may fail only for an entry evicted since the listing.
        served = 0
        for key in entries:
            try:
                content = read_file(os.path.join(m.root, "syn", paths[key]))
            except OSError as exc:
                assert exc.errno == errno.EIO and key not in stored(m), exc
                continue
            source = read_file(os.path.join(synthetic_tree.root, paths[key]))
            assert hashlib.sha256(content).digest() == hashlib.sha256(source).digest() == key
            served += 1
        assert served > 0
    finally:
        sampler.close()


@needs_fuse
def test_bucket_bytes_that_do_not_match_are_never_stored(loader_mountd, gcs_dataset,
                                                         gcs_emulator, gcs_bucket):
    data = gcs_dataset
    digest = digest_format.decode(data)
    b = bucket(gcs_emulator, gcs_bucket)
    bad = set()
    for i in range(0, len(digest), 2):  # every other object: same size, other bytes
        blob = b.blob(f"syn/{digest.key(i)}")
        content = blob.download_as_bytes()
        blob.upload_from_string(content[:-16] + bytes(16 * [0xA5]))
        bad.add(i)
    m = loader_mountd(1)
    mount(m, data, "syn", gcs_emulator.host)
    sampler = start_job(m, "syn")
    try:
        c = settled(m, "syn")
        assert c["integrity_failures"] > 0 and c["loader_process_fetches"] > 0
        entries = stored(m)
        assert entries and not {digest.hash(i) for i in bad} & set(entries)
        for key, value in entries.items():
            assert hashlib.sha256(value).digest() == key
        assert "digest hash" in m.log_tail(200)
        assert "the loader process did not store it" in m.log_tail(200)

        victim = min(bad)
        with pytest.raises(OSError) as info:
            read_file(os.path.join(m.root, "syn", digest.path(victim)))
        assert info.value.errno == errno.EIO
        assert digest.hash(victim) not in stored(m)
    finally:
        sampler.close()


@needs_fuse
def test_a_killed_loader_process_is_replaced_and_its_items_still_load(
        loader_mountd, gcs_dataset, gcs_emulator, synthetic_tree):
    data = gcs_dataset
    digest = digest_format.decode(data)
    # a second to each first byte: a loading chunk's items are in a loader's hands
    with throttled(gcs_emulator.host, rate=10e6, latency=1.0) as proxy:
        m = loader_mountd(1)
        mount(m, data, "syn", proxy.url)
        sampler = start_job(m, "syn")
        try:
            # killed while it holds fetches (killed as it starts, it would hold none)
            first = wait_for("a chunk loading in a loader process", lambda: (
                "loading" in (m.status()["jobs"][0]["chunks"] or {}).get("states", ())
                and {pid for pid in loader_pids(m, AHEAD_NICENESS) if fetching(pid)}))
            (victim,) = first
            os.kill(victim, signal.SIGKILL)
            c = settled(m, "syn")
            replacement = wait_for("a new loader process",
                                   lambda: loader_pids(m, AHEAD_NICENESS) - first)
            assert victim not in replacement
            assert "loader process %d exited" % victim in m.log_tail(500)
            # what it held was fetched in mountd instead, without an error
            assert c["bucket_fetches_chunk_load"] > c.get("loader_process_fetches", 0)
            assert c.get("bucket_errors", 0) == 0 and c.get("integrity_failures", 0) == 0
            for key, value in stored(m).items():
                assert hashlib.sha256(value).digest() == key
        finally:
            sampler.close()

        # and later loads go to the new process: the same items as another dataset
        m.call({"op": "umount", "name": "syn"})
        with diskcache.Cache(os.path.join(m.cache_dir, "store")) as cache:
            cache.clear()
        mount(m, make_digest(digest.source, "again", gcs_emulator.host), "again", proxy.url)
        sampler = start_job(m, "again")
        try:
            again = settled(m, "again")
            assert again["loader_process_fetches"] > 0
            assert loader_pids(m, AHEAD_NICENESS) == replacement
            paths = {digest.hash(i): digest.path(i) for i in range(len(digest))}
            for key in stored(m):
                served = read_file(os.path.join(m.root, "again", paths[key]))
                assert served == read_file(os.path.join(synthetic_tree.root, paths[key]))
        finally:
            sampler.close()
        assert m.stop() == 0  # while the bucket is still there: in-process fetches may wait
    assert loader_pids(m) == set()  # ended with mountd


@needs_fuse
def test_loader_processes_end_with_mountd(loader_mountd, gcs_dataset, gcs_emulator):
    m = loader_mountd(2)
    mount(m, gcs_dataset, "syn", gcs_emulator.host)
    sampler = start_job(m, "syn")
    try:
        settled(m, "syn")
        assert len(loader_pids(m, AHEAD_NICENESS)) == 2
    finally:
        sampler.close()
    assert m.stop() == 0
    assert loader_pids(m) == set()
    assert "loader process" not in m.log_tail(1000)  # none exited early, none was killed


@needs_fuse
def test_zero_loader_processes_load_in_mountd(loader_mountd, gcs_dataset, gcs_emulator):
    data = gcs_dataset
    m = loader_mountd(0)
    mount(m, data, "syn", gcs_emulator.host)
    sampler = start_job(m, "syn")
    try:
        c = settled(m, "syn")
    finally:
        sampler.close()
    assert c["bucket_fetches_chunk_load"] > 0
    assert c.get("loader_process_fetches", 0) == 0
    assert loader_pids(m) == set()


@pytest.mark.parametrize("value, message", [
    ("-1", "--loader-processes must be at least 0, not -1"),
    ("65", "--loader-processes must be at most 64, not 65"),
    ("two", "--loader-processes must be an integer, not 'two'"),
])
def test_bad_loader_processes_on_the_command_line(quiver, tmp_path, value, message):
    r = quiver("mountd", "--root", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
               "--cache-size", "1G", "--foreground", "--loader-processes", value)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"quiver: error: {message}"]
    assert not (tmp_path / "c").exists()  # refused before anything was made


@pytest.mark.parametrize("value, message", [
    ("-1", "--loader-processes must be at least 0, not -1"),
    ('"2"', "must be an integer, not a string"),
])
def test_bad_loader_processes_in_the_config_file(quiver, tmp_path, value, message):
    config = tmp_path / "quiver.toml"
    config.write_text(f"[mountd]\nloader-processes = {value}\n", encoding="utf-8")
    r = quiver("--config", str(config), "mountd", "--root", str(tmp_path), "--cache-dir",
               str(tmp_path / "c"), "--cache-size", "1G", "--foreground")
    assert r.returncode == 10
    assert r.stderr.strip().splitlines() == [
        f"quiver: error: {config}: [mountd] loader-processes: {message}"]

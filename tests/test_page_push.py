"""Planned items pushed into the kernel's page cache (mountd.fetch.page_push), through a real
mount: every byte read is the item's, while chunk eviction, store culling and probes'
page drops race with the pushes, the unread pushed bytes stay within their bound, and a
read counts as one local hit whether the pushed pages or mountd served it."""
from __future__ import annotations

import collections
import concurrent.futures
import hashlib
import os
import threading
import time
import types
from collections.abc import Callable

import pytest
import trio

from mountd.fetch import page_push
from mountd.fetch.page_push import PagePush
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from quiverfs import digest as digest_format
from quiverfs.bench.processes import MountdProcess
from quiverfs.counters import ReadCounter
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

PUSH_MEMORY = 16 << 10  # bytes: about 40 of the digits' items
SETTLE_TIMEOUT = 10.0  # seconds for counts that trail a request (RELEASE follows close)
# Without OPEN requests, served through Python: where the native data plane serves (the
# default), nothing is pushed (test_the_native_data_plane_pushes_nothing)
PYTHON_NO_OPEN = ("--data-path", "python")


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _run_job(root: str, seed: int, epochs: int, pool: concurrent.futures.Executor) -> int:
    """Read every batch's files as the manifests name them; check each one's hash.
    Returns the items read."""
    sampler = QuiverBatchSampler(root, 32, seed=seed)
    read = 0
    try:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            seen: list[str] = []
            for b in range(len(sampler)):
                m = sampler.manifest(b)
                paths = [os.path.join(root, p) for p in m.paths]
                assert list(pool.map(_sha, paths)) == m.hashes, (epoch, b)
                seen += m.paths
            assert len(seen) == len(set(seen)) == 1797  # exactly once per epoch
            read += len(seen)
    finally:
        sampler.close()
    return read


@pytest.mark.parametrize("mode", ["open", "no-open"])
def test_pushed_pages_hold_each_items_bytes_within_the_bound(mountd_factory, digits_tree,
                                                            mode):
    # a cache of 100K holds a few chunks of the 220K digits: chunks load and are
    # evicted, and the store culls, while two jobs' planned hits are pushed; a push
    # stops counting when its file is opened, or (no OPEN) when its job has moved past it
    opens = ("--fuse-opens",) if mode == "open" else PYTHON_NO_OPEN
    m = mountd_factory(cache_size="100K", extra_args=("--push-memory", str(PUSH_MEMORY),
                                                      "--chunk-size", "20K", *opens))
    assert m.status()["fuse_mode"] == mode
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    for _ in os.walk(root):  # as ImageFolder does: the kernel learns every inode
        pass
    held: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            push = m.status()["push"]
            assert push["budget"] == PUSH_MEMORY
            held.append(push["held"])
            done.wait(0.02)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        watcher = pool.submit(watch)
        jobs = [pool.submit(_run_job, root, seed, 3, pool) for seed in (1, 2)]
        try:
            assert [j.result(timeout=300) for j in jobs] == [3 * 1797] * 2
        finally:
            done.set()
        watcher.result()
    st = m.status()
    c = st["counters"]
    assert c["pushed"] > 0 and c["pushed_opens" if mode == "open" else "pushed_passed"] > 0, c
    assert max(held) <= PUSH_MEMORY and len(held) > 10
    assert st["cache"]["used_bytes"] <= 100 << 10


def test_the_native_data_plane_pushes_nothing(mountd_factory, digits_tree):
    """Where the native data plane serves the dataset's files, a sampler's planned hits
    are not pushed: the plane's READ of a stored item costs less than a push (a store
    read and a copy into the kernel by a Python worker). Every read is the plane's hit."""
    m = mountd_factory(extra_args=("--probe-batches", "0"))
    if m.status()["data_path"] != "native":
        assert not os.environ.get("QUIVER_EXPECT_NATIVE"), "make test builds the plane"
        pytest.skip("the native data plane is not built")
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    for d, _, files in os.walk(root):  # every item stored
        for name in files:
            _sha(os.path.join(d, name))

    def read(path: str) -> str:  # the page cache must not serve it
        with open(path, "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return hashlib.sha256(f.read()).hexdigest()

    before = m.status()["counters"]
    sampler = QuiverBatchSampler(root, 32, seed=1)
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for b in range(len(sampler)):
                manifest = sampler.manifest(b)
                assert [read(os.path.join(root, p)) for p in manifest.paths] == manifest.hashes
    finally:
        sampler.close()
    st = m.status()
    c = {k: st["counters"].get(k, 0) - before.get(k, 0)
         for k in ("local_hits", "misses", "pushed")}
    assert st["push"] == {"budget": 0, "held": 0}
    assert c == {"local_hits": 2 * 1797, "misses": 0, "pushed": 0}
    assert st["native"]["hits"] >= 2 * 1797


def _counters_once(m: MountdProcess, settled: Callable[[dict[str, int]], bool]
                   ) -> dict[str, int]:
    """mountd's counters once ``settled`` by them, or as they are after SETTLE_TIMEOUT."""
    deadline = time.monotonic() + SETTLE_TIMEOUT
    while not settled(c := m.status()["counters"]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return c


@pytest.mark.parametrize("mode", ["open", "no-open"])
def test_a_pushed_item_whose_pages_were_dropped_is_one_hit(mountd_factory, digits_tree,
                                                            mode):
    # another job's POSIX_FADV_DONTNEED (or reclaim) drops a pushed item's pages before
    # its job reads it (here the reading open drops them, so mountd sees one OPEN): the
    # read reaches mountd and is its one local hit, and the push counts as dropped
    opens = ("--fuse-opens",) if mode == "open" else PYTHON_NO_OPEN
    m = mountd_factory(extra_args=("--probe-batches", "0", *opens))  # no forced misses
    assert m.status()["fuse_mode"] == mode
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    for d, _, files in os.walk(root):  # every item stored, every inode known to the kernel
        for name in files:
            _sha(os.path.join(d, name))
    served = "pushed_opens" if mode == "open" else "pushed_passed"
    names = ("local_hits", "local_bytes", "misses", served, "pushed_dropped")
    sampler = QuiverBatchSampler(root, 32, seed=1)
    try:
        first = sampler.manifest(0)
        # a segment's batches are pushed as one, and taken as read together
        items = [os.path.join(root, p) for batch in (first.paths, *first.segment)
                 for p in batch]
        pushed = _counters_once(m, lambda c: c.get("pushed", 0) >= len(items))
        assert pushed.get("pushed", 0) >= len(items), "the first manifest's items unpushed"
        before = m.status()["counters"]

        def counted(c: dict[str, int]) -> dict[str, int]:
            return {name: c.get(name, 0) - before.get(name, 0) for name in names}

        with open(items[0], "rb", buffering=0) as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            assert hashlib.sha256(f.read()).hexdigest() == first.hashes[0]
        for path in items[1:]:
            _sha(path)
        # the manifest after the next one: the job has read the first ones (no OPEN)
        ahead = 1 + len(first.segment)
        sampler.manifest(ahead + 1 + len(sampler.manifest(ahead).segment))
        # counted while the job is registered: pushes still under way when it leaves
        # are no read of these items
        after = counted(_counters_once(
            m, lambda c: counted(c)[served] + counted(c)["pushed_dropped"] >= len(items)))
    finally:
        sampler.close()
    assert after == {"local_hits": len(items),
                     "local_bytes": sum(os.path.getsize(p) for p in items),
                     "misses": 0, served: len(items) - 1, "pushed_dropped": 1}


def test_bad_push_memory_is_one_line(quiver, tmp_path):
    r = quiver("mountd", "--root", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
               "--cache-size", "1G", "--foreground", "--push-memory", "-5")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "quiver: error: invalid --push-memory '-5': use a number with an optional K, M, "
        "G or T suffix, e.g. 20G"]
    config = tmp_path / "quiver.toml"
    config.write_text('[mountd]\npush-memory = "lots"\n', encoding="utf-8")
    r = quiver("--config", str(config), "mountd", "--root", str(tmp_path), "--cache-dir",
               str(tmp_path / "c"), "--cache-size", "1G", "--foreground")
    assert r.returncode == 10 and len(r.stderr.strip().splitlines()) == 1
    assert "[mountd] push-memory: " in r.stderr
    assert not (tmp_path / "c").exists()  # refused before anything was made


async def test_a_push_that_lands_after_its_job_left_is_no_hit(monkeypatch):
    """A job that unregisters while its items are being pushed read none of them: the
    pushes that land then neither count as hits nor hold the budget."""
    items = [digest_format.NewItem(f"c/{k}.jpg", hashlib.sha256(b"%d" % k).digest(), 10)
             for k in range(4)]
    d = digest_format.decode(digest_format.encode("t", "file:///x", items))
    ds = types.SimpleNamespace(digest=d, counters=collections.Counter(),
                               entry_inode=lambda index: 100 + index)
    store = types.SimpleNamespace(get_nowait=lambda digest, size: b"x" * size)
    stats = ReadStats()
    push = PagePush(store, trio.CapacityLimiter(1), stats, Staging(), 1 << 20,
                    lambda ds, digest: False)

    def notify_store(found: list) -> list[bool]:  # the kernel takes them as the job leaves
        trio.from_thread.run_sync(push.left, "job")
        return [True] * len(found)

    monkeypatch.setattr(page_push, "_notify_store", notify_store)
    push.enqueue(ds, [0, 1, 2, 3], "job", (0, 0))
    async with trio.open_nursery() as nursery:
        await nursery.start(push.run)
        with trio.fail_after(10):
            while stats.counters[ReadCounter.PUSHED] < 4:
                await trio.sleep(0.01)
        nursery.cancel_scope.cancel()
    assert stats.counters[ReadCounter.LOCAL_HITS] == 0 and push.held == 0
    assert stats.counters[ReadCounter.PUSHED_PASSED] == 0

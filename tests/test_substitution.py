"""Substitutable reads: chunk plans, shards, Algorithm 1 through a real mount and the helper."""
from __future__ import annotations

import collections
import hashlib
import json
import os
import threading
import time

import diskcache
import numpy as np
import pytest
import torch
import torchvision

from mountd.jobs.substitution import EpochSampler, epoch_shard
from quiverfs import digest as digest_format
from quiverfs.chunk_plan import ChunkPlan, make_plan
from quiverfs.job_protocol import decode_manifest
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


def class_sorted_digest(n: int, classes: int,
                        sizes: np.ndarray | None = None) -> digest_format.Digest:
    """A digest laid out like ImageFolder's: sorted by class, with ``sizes`` (default:
    rising within a class)."""
    items = [digest_format.NewItem(f"c{i * classes // n:03d}/{i:06d}.jpg",
                                   hashlib.sha256(str(i).encode()).digest(),
                                   1000 + i % 97 if sizes is None else int(sizes[i]))
             for i in range(n)]
    return digest_format.decode(digest_format.encode("t", "file:///x", items))


def assert_classes_spread_around_the_ring(plan: ChunkPlan, digest: digest_format.Digest,
                                          classes: int) -> np.ndarray:
    """Every chunk holds one or two items of each class, and after any c chunks each
    class has had its share of c chunks, to one item; the labels, per item."""
    labels = np.array([digest.label_index[i] for i in range(len(digest))])
    per_chunk = np.array([np.bincount(labels[m], minlength=classes) for m in plan.members])
    assert set(per_chunk.ravel().tolist()) == {1, 2}
    share = np.outer(np.arange(1, plan.n_chunks + 1), np.bincount(labels) / plan.n_chunks)
    assert np.abs(np.cumsum(per_chunk, axis=0) - share).max() <= 1
    return labels


def test_chunk_plan_is_deterministic_uniform_and_complete():
    d = class_sorted_digest(5000, 50)
    plan = make_plan(d)
    assert plan.n_chunks == 10
    assert sorted(np.concatenate(plan.members).tolist()) == list(range(5000))
    labels = np.array([d.label_index[i] for i in range(len(d))])
    for members in plan.members:  # every chunk holds its share of every class
        assert set(np.bincount(labels[members], minlength=50).tolist()) == {10}
    again = make_plan(class_sorted_digest(5000, 50))
    assert all(np.array_equal(a, b) for a, b in zip(plan.members, again.members))
    uneven = make_plan(class_sorted_digest(1003, 10))  # leftovers spread over chunks
    assert sorted({len(m) for m in uneven.members}) == [100, 101]


def test_small_chunks_spread_every_class_evenly_around_the_ring():
    """With fewer items of a class than chunks, the class's items are spread evenly over
    the ring in the cycle's order, not piled into the first chunks: after any c chunks, a
    substitutable view has had each class's share of c chunks, to one item."""
    d = class_sorted_digest(1250, 10)
    total = int(np.frombuffer(d.sizes, dtype="<u8").sum())
    plan = make_plan(d, total // 80 + 1)  # 80 chunks of 15 or 16 items
    assert plan.n_chunks == 80
    labels = assert_classes_spread_around_the_ring(plan, d, 10)
    for members in plan.members:  # loaded in the permutation's order, not by class
        assert not np.all(np.diff(labels[members]) >= 0)


def test_chunks_hold_equal_bytes_and_keep_every_class_share():
    """Item sizes vary (log-normal, like the benches' JPEGs): chunks of equal counts differ
    in bytes (at 16 items a chunk the largest is about 1.3x the mean), and the coordinator
    sizes K by the largest. The plan evens their bytes out by swapping items of one class,
    so every chunk keeps its share of every class."""
    rng = np.random.default_rng(4)
    sizes = np.clip(rng.lognormal(np.log(22_000), 0.45, 1250), 20_000, 300_000).astype(int)
    d = class_sorted_digest(1250, 10, sizes)
    plan = make_plan(d, int(sizes.sum()) // 80 + 1)
    assert plan.n_chunks == 80
    assert sorted(np.concatenate(plan.members).tolist()) == list(range(1250))
    chunk_bytes = np.array(plan.chunk_bytes)
    assert chunk_bytes.sum() == sizes.sum()
    assert chunk_bytes.max() <= 1.01 * chunk_bytes.mean()
    assert_classes_spread_around_the_ring(plan, d, 10)


def test_chunk_plan_sort_key_gives_stripe_units_of_similar_size():
    d = class_sorted_digest(5000, 50)
    sizes = np.frombuffer(d.sizes, dtype="<u8").astype(float)
    plan = make_plan(d, sort_key="size")
    unit = plan.members[0][:50]  # the first stripe unit of chunk 0
    assert sizes[unit].std() < sizes.std() / 5
    assert sizes[plan.members[0]].std() > sizes.std() / 2  # the chunk spans all sizes


def test_rank_shards_are_disjoint_and_cover_the_dataset():
    universe = np.arange(1001)
    for epoch in range(3):
        shards = [epoch_shard(universe, 5, epoch, r, 4) for r in range(4)]
        flat = np.concatenate(shards)
        assert len(flat) == 1001 and len(set(flat.tolist())) == 1001
    assert not np.array_equal(epoch_shard(universe, 5, 0, 0, 4), epoch_shard(universe, 5, 1, 0, 4))


@pytest.mark.parametrize("chunked", [False, True])
def test_sampler_exactly_once_while_the_cache_changes(chunked):
    order = epoch_shard(np.arange(5000), 3, 0, 0, 1)
    rng = np.random.default_rng(9)
    cached = set(rng.choice(5000, 500, replace=False).tolist())
    chunk_of = np.arange(5000) % 7
    sampler = EpochSampler(order, 64, seed=3, chunk_of=chunk_of if chunked else None)
    seen: list[int] = []
    for b in range(sampler.n_batches):
        first = b % 7 if chunked else None  # hits from one chunk first, a different one each time
        batch = sampler.plan(lambda items: np.array([i in cached for i in items]),
                             first_chunk=first)
        assert len(batch.items) == (64 if b < sampler.n_batches - 1 else 5000 - 64 * b)
        seen += batch.items
        cached.update(batch.fetch)
        if b % 7 == 3:
            cached.clear()  # emptied mid-epoch
        else:
            cached.update(rng.choice(5000, 100).tolist())
    assert sorted(seen) == list(range(5000))


def test_sampler_takes_hits_from_the_first_chunk_first():
    chunk_of = np.arange(1000) % 4
    sampler = EpochSampler(epoch_shard(np.arange(1000), 1, 0, 0, 1), 50, seed=1,
                           chunk_of=chunk_of)
    seen = []
    for _ in range(5):  # chunk 2's 250 items, all cached, come first, in visiting order
        seen += sampler.plan(lambda items: np.ones(len(items), dtype=bool), first_chunk=2).hits
    assert len(seen) == 250 and set(chunk_of[seen]) == {2}
    positions = {int(item): pos for pos, item in enumerate(sampler.order)}
    assert [positions[i] for i in seen] == sorted(positions[i] for i in seen)
    # chunk 2 used up: the next batch scans the rest as usual
    assert len(sampler.plan(lambda items: np.ones(len(items), dtype=bool),
                            first_chunk=2).hits) == 50


@pytest.fixture
def digits_mount(mountd_factory, digits_tree):
    """A mountd with the digits dataset mounted at ROOT/digits (cache size via request)."""
    def start(cache_size: str = "1G"):
        m = mountd_factory(cache_size=cache_size)
        mount(m, make_digest(digits_tree.root, "digits"), "digits")
        return m
    return start


def epoch_paths(sampler: QuiverBatchSampler, epoch: int, between=None) -> list[str]:
    sampler.set_epoch(epoch)
    paths = []
    for b in range(len(sampler)):
        paths += sampler.manifest(b).paths
        if between is not None:
            between(b)
    return paths


def test_unchanged_imagefolder_with_helper_and_four_workers(digits_mount):
    m = digits_mount()
    root = os.path.join(m.root, "digits")
    dataset = torchvision.datasets.ImageFolder(root, transform=torchvision.transforms.ToTensor())
    sampler = QuiverBatchSampler(root, 64, seed=1, dataset=dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=4)
    expected = collections.Counter(dataset.targets)
    try:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            labels: collections.Counter[int] = collections.Counter()
            batches = 0
            for images, targets in loader:
                assert images.shape[1:] == (3, 8, 8)
                labels.update(targets.tolist())
                batches += 1
            assert batches == len(sampler) == 29
            assert labels == expected  # every item once: the label histogram is exact
        job = settled_job(m)
        # the sampler may have read epoch 2's first manifest ahead: its batches planned
        ahead = 1797 - job["remaining"] if job["epoch"] == 2 else 0
        assert job["counters"]["hits"] + job["counters"]["fetched"] == 2 * 1797 + ahead
        assert job["counters"]["reported_batches"] > 0
        assert job["chunks"]["max_resident"] <= 2
    finally:
        sampler.close()
    assert m.status()["jobs"] == []


def settled_job(m, timeout: float = 30.0) -> dict:
    """The lone job's status once its counters hold still (planning ahead is over)."""
    deadline = time.monotonic() + timeout
    job = m.status()["jobs"][0]
    while True:
        time.sleep(0.3)
        again = m.status()["jobs"][0]
        if again == job or time.monotonic() > deadline:
            return again
        job = again


def test_helper_reports_the_time_between_batches(digits_mount):
    """What probing measures: the time from one batch the loader asked for to the next,
    its training step included (not only the manifest's read)."""
    m = digits_mount()
    sampler = QuiverBatchSampler(os.path.join(m.root, "digits"), 300, seed=1)
    try:
        for _ in sampler:
            time.sleep(0.1)  # the training step
        job = m.status()["jobs"][0]
        assert job["counters"]["reported_batches"] == len(sampler) - 1 == 5
        assert 0.1 <= job["mean_batch_s"] < 1.0
    finally:
        sampler.close()


def test_exactly_once_when_the_cache_is_cleared_mid_epoch(digits_mount, digits_tree):
    m = digits_mount()
    root = os.path.join(m.root, "digits")
    sampler = QuiverBatchSampler(root, 32, seed=2)
    everything = sorted(os.path.relpath(os.path.join(d, f), digits_tree.root)
                        for d, _, fs in os.walk(digits_tree.root) for f in fs)

    def clear(b: int) -> None:
        if b in (5, 30):
            with diskcache.Cache(os.path.join(m.cache_dir, "store")) as store:
                store.clear()

    try:
        for epoch in range(2):
            paths = epoch_paths(sampler, epoch, clear)
            assert sorted(paths) == everything
    finally:
        sampler.close()


def test_exactly_once_with_a_cache_smaller_than_one_chunk(digits_mount, digits_tree):
    m = digits_mount(cache_size="8K")  # the digits are 215 KiB: a chunk is ~22 KiB
    root = os.path.join(m.root, "digits")
    sampler = QuiverBatchSampler(root, 50, seed=3)
    try:
        paths = epoch_paths(sampler, 0)
    finally:
        sampler.close()
    assert len(paths) == 1797 and len(set(paths)) == 1797


def test_two_ranks_get_disjoint_shards_through_the_mount(digits_mount):
    m = digits_mount()
    root = os.path.join(m.root, "digits")
    ranks = [QuiverBatchSampler(root, 64, seed=4, rank=r, world_size=2) for r in range(2)]
    try:
        results: dict[int, list[str]] = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(
            r, epoch_paths(ranks[r], 0))) for r in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        a, b = set(results[0]), set(results[1])
        assert not a & b
        assert len(a) + len(b) == 1797 == len(results[0]) + len(results[1])
        assert abs(len(a) - len(b)) <= 1
    finally:
        for s in ranks:
            s.close()


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_size": 0}, "batch_size must be at least 1"),
    ({"rank": 2, "world_size": 2}, "rank 2 is not in 0..1"),
])
def test_bad_job_parameters_get_clear_errors(digits_mount, kwargs, message):
    m = digits_mount()
    args = {"batch_size": 8, **kwargs}
    with pytest.raises(ValueError, match=message):
        QuiverBatchSampler(os.path.join(m.root, "digits"), args.pop("batch_size"), **args)
    assert m.status()["jobs"] == []


def refused_job_config(root: str, config: bytes) -> tuple[int | None, str]:
    """Write ``config`` to a new job under ``root``; the errno the write met and the
    job's error file (the job is removed again)."""
    job = os.path.join(root, ".quiver", "jobs", "refused")
    os.mkdir(job)
    fd = os.open(os.path.join(job, "config"), os.O_WRONLY)
    try:
        with pytest.raises(OSError) as info:
            os.write(fd, config)
    finally:
        os.close(fd)
    with open(os.path.join(job, "error"), encoding="utf-8") as f:
        error = f.read()
    os.rmdir(job)
    return info.value.errno, error


def test_unknown_dataset_is_a_clear_error(digits_mount):
    m = digits_mount()
    errno_, error = refused_job_config(m.root, b'{"dataset": "nope", "batch_size": 4}')
    assert errno_ == 22 and "unknown dataset 'nope'" in error
    with pytest.raises(ValueError, match="not inside a Quiver mount"):
        QuiverBatchSampler("/tmp", 4)


@pytest.mark.parametrize("config, message", [
    (b'{"dataset": ["x"], "batch_size": 4}', "dataset must be a string"),
    (b'{"dataset": "digits", "batch_size": 4, "extensions": 5}', "extensions must be a list"),
    (b'{"dataset": "digits", "batch_size": 4, "prefix": {}}', "prefix must be a string"),
    (b'{"dataset": "digits", "batch_size": 4, "seed": -1}', "seed must be an integer in"),
    (b'{"dataset": "digits", "batch_size": 1e999}', "batch_size must be an integer"),
    (b'{"dataset": "digits", "batch_size": 4, "epochs": 0}', "epochs (how many the job"),
    (b'{"dataset": "digits", "batch_size": 4, "epochs": "3"}', "epochs must be an integer"),
    (b'[1, 2]', "must be a JSON object"),
    (b'\xff\xfe', "not JSON"),
])
def test_hostile_job_configs_are_refused_and_mountd_serves_on(digits_mount, config, message):
    m = digits_mount()
    errno_, error = refused_job_config(m.root, config)
    assert errno_ == 22 and message in error  # EINVAL: refused, not a failure (EIO)
    assert len(os.listdir(os.path.join(m.root, "digits"))) == 10


def test_next_returns_the_asked_batchs_manifest_and_refuses_what_it_cannot_read(
        digits_mount):
    """JOB/next: report lines and the batch asked for in one write, its manifest in the
    reads (the one JOB/eE-bI holds); a read before any question, or a last line that
    asks for nothing, is EINVAL with the reason in JOB/error."""
    m = digits_mount()
    sampler = QuiverBatchSampler(os.path.join(m.root, "digits"), 100, seed=7)
    fd = os.open(os.path.join(sampler.job_dir, "next"), os.O_RDWR)
    try:
        with pytest.raises(OSError) as info:
            os.pread(fd, 1 << 20, 0)
        assert info.value.errno == 22 and "write 'EPOCH BATCH'" in sampler._error()
        os.pwrite(fd, b"0 0\n", 0)
        raw = os.pread(fd, 1 << 20, 0)
        first = json.loads(raw)
        assert (first["epoch"], first["batch"]) == (0, 0) and len(first["paths"]) == 100
        assert os.pread(fd, 1 << 20, 0) == raw  # kept until asked
        os.pwrite(fd, b"0 0 0.25\n0 1\n", 0)  # batch 0 took 0.25 s; batch 1, please
        second = decode_manifest(os.pread(fd, 1 << 20, 0))
        assert (second.epoch, second.batch) == (0, 1)
        assert sampler.manifest(1) == second  # the batch file holds the same manifest
        assert settled_job(m)["counters"]["reported_batches"] == 1
        os.pwrite(fd, b"0 2 ahead\n", 0)  # asked ahead: the same manifest
        assert decode_manifest(os.pread(fd, 1 << 20, 0)) == sampler.manifest(2)
        for bad in (b"0 0 0.1\n", b"1 x\n", b"\n", b"0 3 behind\n", b"0 3 ahead \n"):
            with pytest.raises(OSError) as info:
                os.pwrite(fd, bad, 0)
            assert info.value.errno == 22 and "the last line written" in sampler._error()
        os.pwrite(fd, b"0 9999\n", 0)
        with pytest.raises(OSError) as info:
            os.pread(fd, 1 << 20, 0)
        assert info.value.errno == 22 and "has 18 batches" in sampler._error()
    finally:
        os.close(fd)
        sampler.close()
    assert len(os.listdir(os.path.join(m.root, "digits"))) == 10


def test_datasets_stay_read_only(digits_mount):
    m = digits_mount()
    target = os.path.join(m.root, "digits", "0")
    for attempt in (lambda: open(os.path.join(target, "new.png"), "wb"),
                    lambda: os.mkdir(os.path.join(target, "d")),
                    lambda: os.unlink(os.path.join(target, sorted(os.listdir(target))[0]))):
        with pytest.raises(OSError) as info:
            attempt()
        assert info.value.errno in (30, 13)  # EROFS, or EACCES from the mode bits

"""Segments: a dataset allotted ``full`` whose items are all cached is handed out several
exact batches per manifest, through a real mount and ``QuiverBatchSampler``."""
from __future__ import annotations

import concurrent.futures
import json
import os
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from mountd.jobs.planner import FIRST_SEGMENT_BATCHES
from mountd.jobs.substitution import EpochSampler, epoch_shard
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess, unmount
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory, read_hashes  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

MODE_TIMEOUT = 30.0  # seconds the coordinator may take to allot a dataset a mode
# The coordinator's probes end at once in epochs of at most half this many batches.
NO_PROBES = ("--probe-batches", "1000")


def test_sampler_places_exact_segments_among_substituted_batches():
    order = epoch_shard(np.arange(1000), 3, 0, 0, 1)
    sampler = EpochSampler(order, 64, seed=3)
    cached = set(range(0, 1000, 3))
    seen = sampler.plan(lambda items: np.array([i in cached for i in items])).items
    assert not sampler.all_hits  # it passed over misses: the next items may miss too
    pending = sampler.pending_in_order(5 * 64)
    batches = sampler.place_in_order(5)
    assert [b.index for b in batches] == [1, 2, 3, 4, 5] and sampler.all_hits
    placed = [i for b in batches for i in b.items]
    assert placed == pending.tolist() and not set(placed) & set(seen)
    positions = {int(item): pos for pos, item in enumerate(order)}
    assert [positions[i] for i in placed] == sorted(positions[i] for i in placed)
    while sampler.planned < sampler.n_batches:  # substitution again, then the rest
        seen += sampler.plan(lambda items: np.ones(len(items), dtype=bool)).items
    assert sorted(seen + placed) == list(range(1000))
    with pytest.raises(IndexError):
        sampler.place_in_order(1)
    whole = EpochSampler(order, 64, seed=3)  # an epoch in one segment: its last batch short
    batches = whole.place_in_order(whole.n_batches)
    assert [len(b.items) for b in batches] == [64] * 15 + [40]
    assert [i for b in batches for i in b.items] == order.tolist()
    assert (whole.remaining, whole.hits, whole.planned) == (0, 1000, 16)


def digits_paths(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


def warm(root: str, paths: list[str]) -> None:
    """Read every item once (exact reads store them)."""
    read_hashes(root, paths)


def job_counters(sampler: QuiverBatchSampler) -> dict[str, int]:
    """The job's counters, once the sampler's thread has written the last epoch's
    reports (it writes them after the epoch's last batch, not before the next epoch)."""
    if sampler._reports_sent is not None:
        sampler._reports_sent.result()
    with open(os.path.join(sampler.job_dir, "stats"), encoding="utf-8") as f:
        return json.load(f)["counters"]


def epoch_indices(batches: Iterator[list[int]], between: Callable[[int], None] | None = None
                  ) -> list[int]:
    """Every index the sampler's batches of one epoch hold; ``between(b)`` runs after the
    loader took batch b."""
    out: list[int] = []
    for b, indices in enumerate(batches):
        out += indices
        if between is not None:
            between(b)
    return out


@pytest.fixture
def warm_digits(mountd_factory, digits_tree):
    """A lone mountd (its own coordinator, no probes) with the digits mounted and every
    item in its store: the dataset is allotted full."""
    m = mountd_factory(extra_args=("--probe-batches", "0"))
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    warm(root, digits_paths(digits_tree.root))
    return m, root


def test_a_cached_full_dataset_gets_segments_and_each_item_once(warm_digits):
    m, root = warm_digits
    sampler = QuiverBatchSampler(root, 32, seed=1)
    try:
        n = len(sampler)
        assert n == 57
        epoch_indices(iter(sampler))  # the job's first epoch tells the coordinator of it
        m.wait_for_mode("full", MODE_TIMEOUT)
        before = job_counters(sampler)
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            assert sorted(epoch_indices(iter(sampler))) == list(range(1797))
        after = job_counters(sampler)
        manifests = after["manifests"] - before["manifests"]
        segments = after.get("segments", 0) - before.get("segments", 0)
        assert segments >= 2 and manifests < 2 * n / 10, after
        assert after["reported_batches"] - before["reported_batches"] == 2 * (n - 1)
    finally:
        sampler.close()


class RecordedAsks(concurrent.futures.ThreadPoolExecutor):
    """A sampler's thread for reading ahead, recording each (batch, epoch) asked of it
    as it is handed out."""

    def __init__(self) -> None:
        super().__init__(1, "quiver-manifest")
        self.asked: list[tuple[int, int]] = []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def, override]
        self.asked.append(tuple(args[1:]))
        return super().submit(fn, *args, **kwargs)


def test_an_epoch_opens_with_a_short_segment_and_the_next_is_read_ahead(warm_digits):
    m, root = warm_digits
    sampler = QuiverBatchSampler(root, 8, seed=5)
    replies: dict[int, dict] = {}
    ask = sampler._ask  # every manifest the sampler reads (through JOB/next)
    sampler._ask = (  # type: ignore[method-assign]
        lambda r, b, e, **kw: replies.setdefault(b, ask(r, b, e, **kw)) if e == 1
        else ask(r, b, e, **kw))
    try:
        n = len(sampler)
        epoch_indices(iter(sampler))
        m.wait_for_mode("full", MODE_TIMEOUT)
        sampler.set_epoch(1)
        replies.clear()
        sampler._ahead.shutdown()  # the sampler's reads ahead, recorded as handed out
        sampler._ahead = asks = RecordedAsks()
        batches = iter(sampler)
        seen = next(batches)
        # the first segment is short, and halfway through it the next one's manifest is
        # asked for (not before)
        assert len(replies[0].segment) == FIRST_SEGMENT_BATCHES - 1
        for _ in range(FIRST_SEGMENT_BATCHES // 2 - 1):
            seen += next(batches)
        assert asks.asked == []
        seen += next(batches)
        assert asks.asked == [(FIRST_SEGMENT_BATCHES, 1)]
        deadline = time.monotonic() + MODE_TIMEOUT
        while FIRST_SEGMENT_BATCHES not in replies:
            assert time.monotonic() < deadline, "the next segment was not read ahead"
            time.sleep(0.01)
        seen += epoch_indices(batches)
        assert sorted(seen) == list(range(1797))
        starts = sorted(replies)
        lengths = [1 + len(replies[b].segment) for b in starts]
        assert starts == [sum(lengths[:k]) for k in range(len(starts))]  # each read once
        assert sum(lengths) == n == 225
        # epoch 1 was not read ahead (epoch 0 was no successor): each segment as long
        # as the epoch's batches before it, from 8, up to 4096 items (512 batches)
        assert lengths == [8, 8, 16, 32, 64, 97], lengths
    finally:
        sampler.close()


def test_the_next_epochs_first_manifest_is_read_ahead(warm_digits):
    m, root = warm_digits
    sampler = QuiverBatchSampler(root, 32, seed=2)
    # (epoch, batch, read ahead by a thread, batches the reply handed out)
    reads: list[tuple[int, int, bool, int]] = []
    ask = sampler._ask  # every manifest the sampler reads (through JOB/next)

    def recorded(reports: bytes, b: int, e: int, **kw: bool) -> dict:
        ahead = threading.current_thread() is not threading.main_thread()
        manifest = ask(reports, b, e, **kw)
        reads.append((e, b, ahead, 1 + len(manifest.segment)))
        return manifest

    sampler._ask = recorded  # type: ignore[method-assign]
    try:
        epoch_indices(iter(sampler))
        m.wait_for_mode("full", MODE_TIMEOUT)
        for epoch in (1, 2, 3):
            sampler.set_epoch(epoch)
            assert sorted(epoch_indices(iter(sampler))) == list(range(1797))
    finally:
        sampler.close()  # after the last read ahead
    # epoch 1 followed epoch 0: from then on each next epoch's first manifest was read
    # ahead (as the segment that ends the epoch before began), and only so
    assert [(e, ahead) for e, b, ahead, _ in reads if b == 0] == [
        (0, False), (1, False), (2, True), (3, True), (4, True)], reads
    # epoch 1's first segment was short, as the loader waited for it; the epochs read
    # ahead were each handed out whole in their first manifest (57 batches of 32)
    assert [n for e, _, _, n in reads if e == 1] == [8, 8, 16, 25], reads
    assert [(e, b, n) for e, b, _, n in reads if e in (2, 3)] == [(2, 0, 57), (3, 0, 57)]


def test_nothing_is_planned_after_the_last_epoch_a_job_says_it_runs(warm_digits):
    """A job that says it runs 3 epochs: the last one's end reads no manifest of a
    fourth ahead, so mountd plans and pushes no segment for it; every segment planned
    was handed out and read, and a manifest asked past the last epoch is refused.
    (Without ``epochs``, the fourth epoch's first segment was read ahead, and the one
    after it planned ahead, for no one: test_the_next_epochs_first_manifest_is_read_ahead.)"""
    m, root = warm_digits
    sampler = QuiverBatchSampler(root, 32, seed=2, epochs=3)
    replies: list[tuple[int, int, int]] = []  # (epoch, batch, batches it hands out)
    ask = sampler._ask  # every manifest the sampler reads (through JOB/next)

    def recorded(reports: bytes, b: int, e: int, **kw: bool) -> dict:
        manifest = ask(reports, b, e, **kw)
        replies.append((e, b, 1 + len(manifest.segment)))
        return manifest

    sampler._ask = recorded  # type: ignore[method-assign]
    try:
        epoch_indices(iter(sampler))
        m.wait_for_mode("full", MODE_TIMEOUT)
        for epoch in (1, 2):
            sampler.set_epoch(epoch)
            assert sorted(epoch_indices(iter(sampler))) == list(range(1797))
        sampler._ahead.shutdown()  # its reads ahead are done
        sampler._ahead = None
        # each plan ahead was handed out by the last reply: none is under way
        job = m.status()["jobs"][0]
        assert (job["epoch"], job["batches_planned"]) == (2, len(sampler))
        segments = [r for r in replies if r[2] > 1]
        assert segments and job["counters"]["segments"] == len(segments), (replies, job)
        assert max(e for e, _, _ in replies) == 2
        # what epoch 2's replies handed out is its batches, each once: nothing of a
        # fourth epoch, nor a segment beyond the last batch
        assert sum(n for e, _, n in replies if e == 2) == len(sampler)
        with pytest.raises(RuntimeError, match="the job runs 3 epochs"):
            sampler.manifest(0, 3)
    finally:
        sampler.close()


def test_an_epoch_run_again_after_a_read_ahead_starts_afresh(warm_digits):
    m, root = warm_digits
    sampler = QuiverBatchSampler(root, 32, seed=3)
    try:
        epoch_indices(iter(sampler))
        m.wait_for_mode("full", MODE_TIMEOUT)
        sampler.set_epoch(1)
        first = epoch_indices(iter(sampler))  # epoch 2's first manifest read ahead
        deadline = time.monotonic() + MODE_TIMEOUT
        while m.status()["jobs"][0]["epoch"] != 2:
            assert time.monotonic() < deadline, "epoch 2 was not started ahead"
            time.sleep(0.01)
        again = epoch_indices(iter(sampler))  # epoch 1 once more, in the same order
        assert again == first and sorted(again) == list(range(1797))
        assert m.status()["jobs"][0]["epoch"] == 1
        with pytest.raises(RuntimeError, match="epoch 0 is over"):
            sampler.manifest(3, 0)  # a later batch of an earlier epoch
        sampler.set_epoch(2)
        assert sorted(epoch_indices(iter(sampler))) == list(range(1797))
    finally:
        sampler.close()


def push_held(m: MountdProcess, settled: Callable[[int], bool]) -> int:
    """mountd's unread pushed bytes, once ``settled`` by them (pushes run behind plans)."""
    deadline = time.monotonic() + MODE_TIMEOUT
    while not settled(held := m.status()["push"]["held"]):
        assert time.monotonic() < deadline, f"{held} bytes pushed and unread"
        time.sleep(0.01)
    return held


def test_a_jobs_pushes_stop_counting_when_it_leaves(mountd_factory, digits_tree):
    """The pages pushed for a job that unregisters no longer hold the push budget (nor
    keep another job's plans from pushing the same items) until they expire. (Served
    through Python: where the native data plane serves, nothing is pushed.)"""
    m = mountd_factory(extra_args=("--probe-batches", "0", "--data-path", "python"))
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    warm(root, digits_paths(digits_tree.root))
    sampler = QuiverBatchSampler(root, 32, seed=4)
    try:
        epoch_indices(iter(sampler))
        m.wait_for_mode("full", MODE_TIMEOUT)
        sampler.set_epoch(1)
        epoch_indices(iter(sampler))
        # its last segment, and the next epoch's first one (read ahead), are not passed
        push_held(m, lambda held: held > 0)
    finally:
        sampler.close()
    assert push_held(m, lambda held: held == 0) == 0


def test_a_probe_of_a_held_dataset_forces_no_misses_and_leaves_segments_on(mountd_factory,
                                                                            digits_tree):
    """The cache holds the dataset (allotted full): its job's probe plans no batch
    without hits (those would read from the bucket what the cache holds), so the job's
    manifests come in segments from the start, probe or not."""
    m = mountd_factory()  # probes of 100 batches
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    warm(root, digits_paths(digits_tree.root))
    fetched = m.status()["counters"]["bucket_fetches"]
    sampler = QuiverBatchSampler(root, 1, seed=2)
    try:
        replies = [sampler.manifest(b) for b in range(len(sampler))]  # no times reported
        assert sorted(p for r in replies for p in r.paths) == digits_paths(digits_tree.root)
        assert all(r.hits == 1 for r in replies)
        segments = [b for b, r in enumerate(replies) if r.segment]
        assert segments and min(segments) < 100, segments
        for b in segments:  # a segment's batches are the ones after it, in their order
            following = replies[b + 1:b + 1 + len(replies[b].segment)]
            assert replies[b].segment == [r.paths for r in following]
            assert all(r.hits == len(r.paths) == len(r.hashes) for r in following)
        assert m.status()["counters"]["bucket_fetches"] == fetched
    finally:
        sampler.close()


class CoordinatedNode:
    """A mountd joined to a coordinator process whose budget a restart changes, with
    the digits mounted and every item in the mountd's store."""

    def __init__(self, tmp_path, digits_tree, budget: str) -> None:
        secret = tmp_path / "secret"
        secret.write_bytes(b"segments-test-secret-0123456789")
        self.coordinator = CoordinatorProcess(
            str(tmp_path / "co"), str(secret), str(tmp_path / "co.log"),
            extra_args=("--cache-budget", budget, *NO_PROBES))
        self.coordinator.start()
        root = tmp_path / "n-mnt"
        root.mkdir()
        self.m = MountdProcess(str(root), str(tmp_path / "n-cache"), "1G",
                               str(tmp_path / "n.log"),
                               extra_args=("--coordinator", self.coordinator.address,
                                           "--listen", "127.0.0.1:0", "--node-id", "n",
                                           "--cluster-secret-file", str(secret),
                                           "--chunk-size", "20K"))
        self.m.start()
        mount(self.m, make_digest(digits_tree.root, "digits"), "digits")
        self.root = str(root / "digits")
        warm(self.root, digits_paths(digits_tree.root))

    def allot(self, budget: str, want: str) -> None:
        """Restart the coordinator with ``budget``; wait until the dataset is ``want``."""
        self.coordinator.stop()
        self.coordinator.extra_args = ("--cache-budget", budget, *NO_PROBES)
        self.coordinator.start()
        self.m.wait_for_mode(want, MODE_TIMEOUT)

    def close(self) -> None:
        try:
            assert self.m.stop() == 0, self.m.log_tail()
            assert "Traceback" not in self.m.log_tail(1000), self.m.log_tail(40)
        finally:
            unmount(self.m.root)
            self.coordinator.stop()


@pytest.fixture
def coordinated(tmp_path, digits_tree):
    """``coordinated(budget)``: a CoordinatedNode (the digits' 220 KB are full at 1G,
    coop at 100K: two chunks of 20K fit, the whole does not)."""
    nodes: list[CoordinatedNode] = []

    def start(budget: str) -> CoordinatedNode:
        nodes.append(CoordinatedNode(tmp_path, digits_tree, budget))
        return nodes[-1]

    yield start
    for node in nodes:
        node.close()


def test_full_to_coop_mid_epoch_keeps_exactly_once_and_plans_per_batch(coordinated):
    node = coordinated("1G")
    sampler = QuiverBatchSampler(node.root, 16, seed=3)
    try:
        n = len(sampler)
        assert n == 113
        batches = iter(sampler)
        seen = next(batches)  # the job's epoch began: the coordinator allots it
        node.m.wait_for_mode("full", MODE_TIMEOUT)
        at_switch: dict[str, int] = {}

        def switch(b: int) -> None:
            if b == 20:  # inside the first segment
                at_switch.update(job_counters(sampler))
                assert at_switch.get("segments", 0) >= 1, at_switch
                node.allot("100K", "coop")

        seen += epoch_indices(batches, switch)
        assert sorted(seen) == list(range(1797))
        # What was planned before the switch is handed out a batch per manifest; the
        # sampler's thread reads the next segment's manifest as one starts, so that one
        # may have been handed out just before the switch or just after.
        counters = job_counters(sampler)
        assert counters["segments"] - at_switch["segments"] in (0, 1), (at_switch, counters)
        sampler.set_epoch(1)
        assert sorted(epoch_indices(iter(sampler))) == list(range(1797))
        after = job_counters(sampler)
        assert after["segments"] == counters["segments"]
        assert after["manifests"] - counters["manifests"] == n  # one per batch again
    finally:
        sampler.close()


def test_a_coop_dataset_gets_no_segments_even_when_cached(coordinated):
    node = coordinated("100K")
    sampler = QuiverBatchSampler(node.root, 16, seed=4)
    try:
        batches = iter(sampler)
        seen = next(batches)
        node.m.wait_for_mode("coop", MODE_TIMEOUT)
        seen += epoch_indices(batches)
        assert sorted(seen) == list(range(1797))
        counters = job_counters(sampler)
        assert counters.get("segments", 0) == 0
        assert counters["manifests"] == len(sampler)
    finally:
        sampler.close()

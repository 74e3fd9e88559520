"""Benefit probing and benefit-aware allocation (paper §5.3)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torchvision
import trio

from coordinator.allocation import NO_BENEFIT, DatasetDemand, JobBenefit, allocate
from coordinator.embedded import EmbeddedCoordinator
from coordinator.server import CoordinatorServer
from coordinator.state import CoordinatorState
from quiverfs.chunk_cycle import FORCE_EVICT_AFTER
from quiverfs.heartbeat import (DatasetReport, Heartbeat, HeartbeatReply, JobReport, from_wire,
                                to_wire)
from quiverfs.bench.data import write_synthetic_tree
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess, unmount
from quiverfs.bench.throttle_proxy import throttled
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401

GiB = 1 << 30


def demand(name: str, size: int, chunk: int, *benefits: tuple[float | None, int]
           ) -> DatasetDemand:
    jobs = tuple(JobBenefit(gpus, None if b is None else b, None if b is None else 1.0)
                 for b, gpus in benefits)
    return DatasetDemand(name, size, chunk, jobs)


def test_allocation_prefers_benefit_per_byte_under_a_budget():
    io_bound = demand("io", 100 * GiB, 10 * GiB, (3.0, 4))  # G = 12, two chunks: 20 GiB
    mild = demand("mild", 100 * GiB, 10 * GiB, (1.5, 2))  # G = 3
    compute = demand("compute", 10 * GiB, GiB, (1.0, 8))  # hides its I/O: no benefit
    for budget, io, mild_mode, compute_mode in (
            (21, "coop", "none", "none"), (41, "coop", "coop", "none"),
            # leftover budget upgrades the best dataset to a full cache
            (121, "full", "coop", "none"),
            # and what is still left caches the dataset that gains nothing, if all fits
            (45, "coop", "coop", "none"), (50, "coop", "coop", "full"),
            (130, "full", "coop", "full")):
        assert allocate([io_bound, mild, compute], budget * GiB) == {
            "io": io, "mild": mild_mode, "compute": compute_mode}, budget
    assert allocate([io_bound], 0) == {"io": "none"}


def test_spare_budget_caches_a_dataset_that_several_jobs_share_in_chunks():
    """Each job's probe measured it missing while the other jobs hit, so none shows a
    benefit; but missing together they share the bucket, and cooperative misses read an
    item once for all of them. A lone job, of any size, still gets none."""
    shared = demand("shared", 100 * GiB, 10 * GiB, *[(1.0, 1)] * 6)
    lone = demand("lone", 100 * GiB, 10 * GiB, (1.0, 6))
    io_bound = demand("io", 100 * GiB, 10 * GiB, (3.0, 4))
    assert allocate([shared, lone], 25 * GiB) == {"shared": "coop", "lone": "none"}
    assert allocate([shared, lone], 19 * GiB) == {"shared": "none", "lone": "none"}
    # datasets worth caching come first: the shared one gets what they leave
    assert allocate([shared, io_bound], 25 * GiB) == {"shared": "none", "io": "coop"}
    assert allocate([shared, io_bound], 41 * GiB) == {"shared": "coop", "io": "coop"}
    # and a full cache where the dataset fits, as for any dataset that gains nothing
    small = demand("small", 15 * GiB, 10 * GiB, *[(1.0, 1)] * 6)
    assert allocate([small], 25 * GiB) == {"small": "full"}


def test_unprobed_jobs_are_given_the_benefit_of_the_doubt():
    new = demand("new", 100 * GiB, 10 * GiB, (None, 1))
    assert allocate([new], 20 * GiB) == {"new": "coop"}
    small = demand("small", 5 * GiB, 10 * GiB, (None, 1))  # smaller than two chunks
    assert allocate([small], 20 * GiB) == {"small": "full"}


ITEMS = 80  # per dataset: 20 batches of 4 an epoch
EPOCHS = 4
# 2 workers ask for up to 4 batches ahead: a probe of 16 lets 8 settle, then means of 8
PROBE_BATCHES = 16


@pytest.fixture
def slow_bucket(gcs_emulator, upload, tmp_path):
    """Two datasets in the emulator behind a 2 MB/s cap: (proxy url, [(name, gs:// uri)])."""
    datasets = []
    for seed in (1, 2):
        tree = write_synthetic_tree(str(tmp_path / f"d{seed}"), ITEMS, 10, seed=seed,
                                    mean_size=60_000)
        datasets.append((f"d{seed}", upload(tree.root, f"d{seed}")))
    with throttled(gcs_emulator.host, rate=2e6, burst=64 << 10) as proxy:
        yield proxy.url, datasets


def run_job(root: str, compute_s: float, epochs: int, out: dict) -> None:
    """An ImageFolder training loop with DataLoader workers and a fixed compute time."""
    dataset = torchvision.datasets.ImageFolder(root)
    sampler = QuiverBatchSampler(root, 4, seed=1, dataset=dataset)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=2,
                                         collate_fn=lambda batch: len(batch))
    try:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            out.setdefault("items", 0)
            for n in loader:
                out["items"] += n
                time.sleep(compute_s)
        out["job"] = sampler.job_id
    finally:
        sampler.close()


def probe_once(datasets: list[tuple[str, str]], url: str, emulator_host: str, base: str
               ) -> dict[str, float]:
    """Run an I/O-bound and a compute-bound job on one mountd; the benefit each probe
    measured, by dataset."""
    os.makedirs(base + "-mnt")
    m = MountdProcess(base + "-mnt", base + "-cache", "1G", base + ".log",
                      extra_args=("--probe-batches", str(PROBE_BATCHES)))
    m.start()
    try:
        for name, uri in datasets:  # digests made at full speed, reads through the cap
            mount(m, make_digest(uri, name, emulator_host), name, url)
        results = [{}, {}]
        jobs = [threading.Thread(target=run_job, args=(os.path.join(m.root, "d1"), 0.05,
                                                       EPOCHS, results[0])),
                threading.Thread(target=run_job, args=(os.path.join(m.root, "d2"), 0.5,
                                                       EPOCHS, results[1]))]
        for t in jobs:
            t.start()
        benefits: dict[str, float] = {}
        deadline = time.monotonic() + 150
        while len(benefits) < 2 and time.monotonic() < deadline:
            for job in m.status()["jobs"]:
                if job["benefit"] is not None and not job["probing"]:
                    benefits[job["dataset"]] = job["benefit"]
            time.sleep(0.2)
        for t in jobs:
            t.join(180)
        assert results[0]["items"] == results[1]["items"] == EPOCHS * ITEMS
        return benefits
    finally:
        assert m.stop() == 0
        unmount(m.root)


def test_probing_tells_io_bound_from_compute_bound(slow_bucket, gcs_emulator, tmp_path):
    url, datasets = slow_bucket
    benefits = probe_once(datasets, url, gcs_emulator.host, str(tmp_path / "node"))
    # the same line the allocation draws between jobs worth caching and not: the I/O-bound
    # job saves time with the cache, the compute-bound one hides the slow bucket
    assert benefits["d1"] > 1.3 * NO_BENEFIT, benefits
    assert benefits["d2"] < NO_BENEFIT, benefits


def test_reallocation_keeps_exactly_once(tmp_path, digits_tree):
    """Mid-epoch, the coordinator comes back with budgets that take the dataset's cache
    away and give it back: the epoch still visits every item exactly once."""
    secret = tmp_path / "secret"
    secret.write_bytes(b"allocation-test-secret-0123")
    coordinator = CoordinatorProcess(str(tmp_path / "co"), str(secret), str(tmp_path / "co.log"),
                                     extra_args=("--cache-budget", "1G"))
    coordinator.start()
    root = tmp_path / "n-mnt"
    root.mkdir()
    m = MountdProcess(str(root), str(tmp_path / "n-cache"), "1G", str(tmp_path / "n.log"),
                      extra_args=("--coordinator", coordinator.address, "--listen",
                                  "127.0.0.1:0", "--node-id", "n", "--cluster-secret-file",
                                  str(secret), "--chunk-size", "20K"))
    m.start()
    sampler = None
    try:
        mount(m, make_digest(digits_tree.root, "digits"), "digits")
        sampler = QuiverBatchSampler(str(root / "digits"), 30, seed=6)
        modes = []

        def mode() -> str | None:
            cycles = m.call({"op": "cluster"})["cycles"]
            return next(iter(cycles.values()))["mode"] if cycles else None

        def restart(budget: str, want: set[str]) -> None:
            coordinator.stop()
            coordinator.extra_args = ("--cache-budget", budget)
            coordinator.start()
            deadline = time.monotonic() + 30
            while mode() not in want:
                assert time.monotonic() < deadline, f"mode stayed {mode()}"
                time.sleep(0.1)
            modes.append(mode())

        paths: list[str] = []
        sampler.set_epoch(0)
        for b in range(len(sampler)):
            paths += sampler.manifest(b)["paths"]
            if b == 10:
                restart("0", {"none"})
            elif b == 30:
                restart("1G", {"coop", "full"})
        assert modes[0] == "none" and modes[1] in ("coop", "full")
        assert sorted(paths) == sorted(
            os.path.relpath(os.path.join(d, f), digits_tree.root)
            for d, _, fs in os.walk(digits_tree.root) for f in fs)
    finally:
        if sampler is not None:
            sampler.close()
        assert m.stop() == 0
        unmount(m.root)
        coordinator.stop()


def two_datasets(t_miss_b: float) -> Heartbeat:
    """One node's heartbeat: datasets a (its job gains 3x) and b (t_miss_b / 1 s), each
    of 100 bytes in chunks of 10, with a cache of 30 bytes: two chunks of one of them."""
    def report(name: str, t_miss: float) -> DatasetReport:
        job = JobReport(id=f"{name}-job", gen=0, gpus=1, remaining=(10,) * 10, probe_seq=1,
                        t_miss=t_miss, t_hit=1.0)
        return DatasetReport(name=name, chunks=10, size=100, chunk_bytes=10, jobs=(job,))
    return Heartbeat("n", "127.0.0.1:7000", 30, {"a": report("a", 3.0),
                                                 "b": report("b", t_miss_b)})


def modes(reply: HeartbeatReply) -> dict[str, str]:
    return {name: view.mode.value for name, view in sorted(reply.cycles.items())}


async def test_a_dataset_allotted_none_wins_cache_back_the_same_on_both_coordinators(tmp_path):
    """b's job gains less than a's, so b gets no cache; then its misses slow down (mountd
    measures t_miss again from its batches without the cache) and b wins the cache. The
    coordinator process and the one embedded in mountd allot the same at each step."""
    server = CoordinatorServer(CoordinatorState(str(tmp_path / "c")), b"s" * 16,
                               ("127.0.0.1", 0))
    embedded = EmbeddedCoordinator(str(tmp_path / "e"), FORCE_EVICT_AFTER, 8,
                                   trio.CapacityLimiter(1))
    for t_miss_b, expected in ((1.5, {"a": "coop", "b": "none"}),
                               (5.0, {"a": "none", "b": "coop"})):
        beat = two_datasets(t_miss_b)
        by_server = from_wire(await server.heartbeat(to_wire(beat)), HeartbeatReply)
        assert modes(by_server) == modes(await embedded.heartbeat(beat)) == expected

"""Benefit probing and benefit-aware allocation (paper §5.3)."""
from __future__ import annotations

import os
import random
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
from quiverfs.bench.data import write_synthetic_tree
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess, unmount
from quiverfs.bench.throttle_proxy import throttled
from quiverfs.chunk_cycle import FORCE_EVICT_AFTER
from quiverfs.heartbeat import (CacheMode, DatasetReport, Heartbeat, HeartbeatReply,
                                JobReport, from_wire, to_wire)
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


MB = 1_000_000
BUCKET = 4e6  # bytes per second


def jobs(n: int, t_hit: float | None, t_miss: float | None = None,
         batch_bytes: int = MB) -> tuple[JobBenefit, ...]:
    return tuple(JobBenefit(1, t_miss, t_hit, batch_bytes) for _ in range(n))


def three(io_size: int, *, io: tuple[JobBenefit, ...] = jobs(4, 0.02, 1.0),
          medium: tuple[JobBenefit, ...] = jobs(2, 0.67, 1.9),
          heavy: tuple[JobBenefit, ...] = jobs(1, 3.0, 3.0)) -> list[DatasetDemand]:
    """The allocation benchmark's datasets: four jobs reading `io` that compute 20 ms a
    batch, two on `medium` (0.67 s), one on `heavy` (3 s, hiding its reads)."""
    return [DatasetDemand("io", io_size, 2 * MB, io, io_size // (2 * MB)),
            DatasetDemand("medium", 18 * MB, 2 * MB, medium, 9),
            DatasetDemand("heavy", 40 * MB, 2 * MB, heavy, 20)]


def cost(demands: list[DatasetDemand], modes: dict[str, CacheMode]) -> int:
    return sum(d.size if modes[d.identity] is CacheMode.FULL else
               d.coop_cost if modes[d.identity] is CacheMode.COOP else 0 for d in demands)


@pytest.mark.parametrize("io_size, budget, expected", [
    (15 * MB, 11 * MB, ("coop", "coop", "none")),
    (15 * MB, 22 * MB, ("full", "coop", "none")),  # io fits whole beside medium's chunks
    (15 * MB, 44 * MB, ("full", "full", "none")),  # heavy's lone chunks: no gain
    (48 * MB, 32 * MB, ("coop", "full", "none")),  # io does not fit: medium does
    (48 * MB, 64 * MB, ("full", "coop", "none")),
    (48 * MB, 96 * MB, ("full", "full", "none")),
])
def test_the_search_caches_an_io_bound_dataset_whole_where_it_fits(io_size, budget, expected):
    demands = three(io_size)
    modes = allocate(demands, budget, BUCKET)
    assert tuple(modes[n].value for n in ("io", "medium", "heavy")) == expected
    assert cost(demands, modes) <= budget


def test_an_unmeasured_job_does_not_keep_an_io_bound_dataset_from_fitting_whole():
    """heavy's job not measured yet: the probe-only rule gives every dataset two chunks
    first, and io has no room left to go full (run E at 30%); the model sees that io's
    jobs gain far more from it."""
    demands = three(15 * MB, heavy=jobs(1, None))
    assert allocate(demands, 22 * MB) == {"io": "coop", "medium": "coop", "heavy": "coop"}
    assert allocate(demands, 22 * MB, BUCKET) == {"io": "full", "medium": "coop",
                                                  "heavy": "none"}


@pytest.mark.parametrize("bandwidth", [None, BUCKET])  # by the probes alone; by the model
@pytest.mark.parametrize("io_size, budget, expected", [
    (15 * MB, 11 * MB, ("coop", "coop", "none")),  # io does not fit: as without the prior
    (15 * MB, 22 * MB, ("full", "coop", "none")),  # io fits whole, not beside two chunks each
    (48 * MB, 22 * MB, ("coop", "full", "none")),  # medium fits beside io's two chunks
    (48 * MB, 64 * MB, ("full", "coop", "coop")),
])
def test_before_its_jobs_are_measured_a_dataset_that_fits_its_share_is_cached_whole(
        io_size, budget, bandwidth, expected):
    """The prior: datasets by G (io's four jobs first), each cached whole where it fits
    the budget that the ones before it leave; the settled allocation of the benchmark's
    budgets from the start (heavy's lone job still has the benefit of the doubt)."""
    demands = three(io_size, io=jobs(4, None), medium=jobs(2, None), heavy=jobs(1, None))
    modes = allocate(demands, budget, bandwidth)
    assert tuple(modes[n].value for n in ("io", "medium", "heavy")) == expected
    assert cost(demands, modes) <= budget


@pytest.mark.parametrize("bandwidth", [None, BUCKET])
def test_a_job_measured_to_hide_its_misses_takes_its_dataset_out_of_the_prior(bandwidth):
    """One of io's jobs measured to hide its misses, the others not yet: io is no longer
    cached whole on the prior, and medium, which fits, is."""
    demands = three(15 * MB, io=jobs(1, 1.0, 1.0) + jobs(3, None), medium=jobs(2, None),
                    heavy=jobs(1, None))
    modes = allocate(demands, 22 * MB, bandwidth)
    assert modes["io"] is not CacheMode.FULL and modes["medium"] is CacheMode.FULL


def test_the_search_never_allots_more_than_the_budget():
    rng = random.Random(35)
    for _ in range(300):
        demands = []
        for k in range(rng.randint(1, 5)):
            size = rng.randint(1, 100) * MB
            measured = rng.random() < 0.7
            demands.append(DatasetDemand(
                f"d{k}", size, rng.randint(1, 20) * MB,
                jobs(rng.randint(0, 4), rng.uniform(0.01, 3) if measured else None,
                     rng.uniform(0.01, 5) if rng.random() < 0.7 else None,
                     rng.randint(1, 4) * MB)))
        budget = rng.randint(0, 200) * MB
        modes = allocate(demands, budget, rng.uniform(1e6, 1e8))
        assert cost(demands, modes) <= budget
        assert all(modes[d.identity] is CacheMode.NONE for d in demands if not d.jobs)


def test_an_unmeasured_dataset_is_ranked_by_the_model():
    """With room for two chunks of one dataset: jobs no probe measured gain the benefit
    of the doubt over jobs measured to hide their misses; of two unmeasured datasets,
    the one whose chunk loads serve four jobs gains more than the one of a lone job; of
    two unmeasured lone jobs, the one whose measured misses are slower than loads."""
    hides = DatasetDemand("hides", 100 * MB, 10 * MB, jobs(2, 1.0, 1.0), 10)
    new = DatasetDemand("new", 100 * MB, 10 * MB, jobs(2, None), 10)
    assert allocate([hides, new], 25 * MB, BUCKET) == {"hides": "none", "new": "coop"}
    shared = DatasetDemand("shared", 100 * MB, 10 * MB, jobs(4, None), 10)
    lone = DatasetDemand("lone", 100 * MB, 10 * MB, jobs(1, None), 10)
    assert allocate([lone, shared], 25 * MB, BUCKET) == {"lone": "none", "shared": "coop"}
    # five jobs of 1 MB batches share 4 MB/s: 1.25 s of reads a batch
    fast = DatasetDemand("fast", 100 * MB, 10 * MB, jobs(1, None, 1.25), 10)
    slow = DatasetDemand("slow", 100 * MB, 10 * MB, jobs(1, None, 4.0), 10)
    assert allocate([fast, slow, shared], 45 * MB, BUCKET) == {
        "fast": "none", "slow": "coop", "shared": "coop"}


@pytest.mark.parametrize("io_size, budget", [(15 * MB, 44 * MB), (15 * MB, 66 * MB),
                                             (48 * MB, 32 * MB), (48 * MB, 96 * MB)])
def test_a_job_measured_to_gain_under_the_threshold_gets_no_chunks(io_size, budget):
    """heavy's t_miss 0.1% over its t_hit is noise: its lone chunks, loading from the
    bucket beside io's, would gain nothing (bench allocation, run L)."""
    modes = allocate(three(io_size, heavy=jobs(1, 3.0, 3.003)), budget, BUCKET)
    assert modes["heavy"] is CacheMode.NONE


def test_a_lone_job_gets_chunks_only_where_its_misses_are_slower_than_loads():
    """Chunk loads read a lone job's items as its misses would, but many at a time: they
    gain only where its misses take longer than the bandwidth explains."""
    bandwidth_bound = DatasetDemand("d", 100 * MB, 10 * MB, jobs(1, 0.1, 0.25), 10)
    latency_bound = DatasetDemand("d", 100 * MB, 10 * MB, jobs(1, 0.1, 2.0), 10)
    assert allocate([bandwidth_bound], 25 * MB, BUCKET) == {"d": "none"}
    assert allocate([latency_bound], 25 * MB, BUCKET) == {"d": "coop"}


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
            paths += sampler.manifest(b).paths
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


def two_datasets(t_miss_b: float, bandwidth: float | None) -> Heartbeat:
    """One node's heartbeat: datasets a (its job gains 3x) and b (t_miss_b / 1 s), each
    of 100 bytes in chunks of 10, with a cache of 30 bytes: two chunks of one of them;
    batches of 10 bytes, from a bucket of ``bandwidth``."""
    def report(name: str, t_miss: float) -> DatasetReport:
        job = JobReport(id=f"{name}-job", gen=0, gpus=1, remaining=(10,) * 10, probe_seq=1,
                        t_miss=t_miss, t_hit=1.0, batch_bytes=10)
        return DatasetReport(name=name, chunks=10, size=100, chunk_bytes=10, jobs=(job,))
    return Heartbeat("n", "127.0.0.1:7000", 30, {"a": report("a", 3.0),
                                                 "b": report("b", t_miss_b)}, bandwidth)


def modes(reply: HeartbeatReply) -> dict[str, str]:
    return {name: view.mode.value for name, view in sorted(reply.cycles.items())}


@pytest.mark.parametrize("bandwidth", [None, 1000.0])  # by the probes alone; by the model
async def test_a_dataset_allotted_none_wins_cache_back_the_same_on_both_coordinators(
        tmp_path, bandwidth):
    """b's job gains less than a's, so b gets no cache; then its misses slow down (mountd
    measures t_miss again from its batches without the cache) and b wins the cache. The
    coordinator process and the one embedded in mountd allot the same at each step."""
    server = CoordinatorServer(CoordinatorState(str(tmp_path / "c")), b"s" * 16,
                               ("127.0.0.1", 0))
    embedded = EmbeddedCoordinator(str(tmp_path / "e"), FORCE_EVICT_AFTER, 8,
                                   trio.CapacityLimiter(1))
    for t_miss_b, expected in ((1.5, {"a": "coop", "b": "none"}),
                               (5.0, {"a": "none", "b": "coop"})):
        beat = two_datasets(t_miss_b, bandwidth)
        by_server = from_wire(await server.heartbeat(to_wire(beat)), HeartbeatReply)
        assert modes(by_server) == modes(await embedded.heartbeat(beat)) == expected

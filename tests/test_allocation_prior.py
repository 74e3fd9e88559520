"""The allocation's prior (#56): a dataset that fits its share is cached whole from its
jobs' first batch, and a probe corrects a prior that turns out wrong. Real mountd (its
coordinator embedded), real jobs reading through its mount from the GCS emulator
behind a bandwidth cap."""
from __future__ import annotations

import hashlib
import os
import threading
import time
from collections.abc import Callable

import pytest
import torch

from coordinator.allocation import NO_BENEFIT
from quiverfs import digest as digest_format
from quiverfs.bench.data import write_synthetic_tree
from quiverfs.bench.processes import MountdProcess
from quiverfs.bench.throttle_proxy import throttled
from quiverfs.chunk_plan import make_plan
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

BATCH = 4
ITEM_BYTES = 60_000  # mean
JOB_TIMEOUT = 120.0  # seconds a job's epochs may take
# 2 workers ask for up to 4 batches ahead: a probe of 16 lets 8 settle, then means of 8
PROBE_BATCHES = 16


def tree_paths(root: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root)
                  for d, _, fs in os.walk(root) for f in fs)


def sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class Dataset:
    """What a job's DataLoader workers read: (index, SHA-256 of the file's bytes)."""

    def __init__(self, root: str, paths: list[str]) -> None:
        self.root, self.paths = root, paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[int, str]:
        return i, sha(os.path.join(self.root, self.paths[i]))


class Source:
    """A dataset in the emulator: its local tree, digest, and bytes as mountd plans them."""

    def __init__(self, base: str, name: str, items: int, seed: int, chunk: int, upload,
                 host: str) -> None:
        tree = write_synthetic_tree(os.path.join(base, name), items, 4, seed=seed,
                                    mean_size=ITEM_BYTES)
        self.name, self.local = name, tree.root
        self.paths = tree_paths(tree.root)
        self.digest = make_digest(upload(tree.root, name), name, host)
        plan = make_plan(digest_format.decode(self.digest), chunk)
        self.size = int(sum(plan.chunk_bytes))
        self.coop_cost = min(self.size, 2 * int(max(plan.chunk_bytes)))
        self.expected = {i: sha(os.path.join(tree.root, p)) for i, p in enumerate(self.paths)}


@pytest.fixture
def bucket(gcs_emulator, upload, tmp_path):
    """``make(name, items, seed, chunk)`` -> a Source (``chunk``: mountd's --chunk-size),
    read through a 2 MB/s cap (the proxy url)."""
    def make(name: str, items: int, seed: int, chunk: int) -> Source:
        return Source(str(tmp_path / "trees"), name, items, seed, chunk, upload,
                      gcs_emulator.host)
    with throttled(gcs_emulator.host, rate=2e6, burst=64 << 10) as proxy:
        yield make, proxy.url


class Modes:
    """Every mode the node's answers gave each dataset, in order, from the first answer
    that knew of a job on it (a job is reported once its epoch began; until then the
    coordinator has no allocation for the dataset): polled, as the cycles are another
    process's state."""

    def __init__(self, m: MountdProcess) -> None:
        self.m = m
        self.seen: dict[str, list[str]] = {}
        self.cycles: dict[str, dict] = {}  # by name, as last polled
        self.names: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Modes:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            cycles = self.m.call({"op": "cluster"})["cycles"]
            if set(cycles) - set(self.names):
                self.names = {d["identity"]: d["name"] for d in self.m.status()["datasets"]}
            for identity, cycle in cycles.items():
                if not cycle["users"]:
                    continue
                self.cycles[self.names[identity]] = cycle
                seen = self.seen.setdefault(self.names[identity], [])
                if not seen or seen[-1] != cycle["mode"]:
                    seen.append(cycle["mode"])
            self._stop.wait(0.02)

    def wait(self, check: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not check():
            assert time.monotonic() < deadline, f"{what} within {timeout:g} s: {self.seen}"
            time.sleep(0.05)


def read_epochs(sampler: QuiverBatchSampler, source: Source, root: str, epochs: int,
                out: list[list[int]]) -> None:
    """Read ``epochs`` epochs through the mount with manifests, one per batch (so that no
    probe is measured: the job reports no intervals), checking every item's bytes; each
    epoch's (indices, hits) into ``out``."""
    for epoch in range(epochs):
        indices, hits = [], 0
        for b in range(len(sampler)):
            manifest = sampler.manifest(b, epoch)
            hits += manifest.hits
            for path in manifest.paths:
                assert sha(os.path.join(root, path)) == source.expected[
                    source.paths.index(path)], path
                indices.append(source.paths.index(path))
        out.append([sorted(indices), hits])


def test_a_dataset_that_fits_its_share_is_cached_whole_from_its_jobs_first_batch(
        mountd_factory, bucket):
    """io (two jobs) fits the cache whole, but not beside two chunks of other (one job).
    Before any job is measured it is allotted full from the first answer on, so its jobs'
    second epoch is all hits, each item fetched from the bucket once; before the prior
    the rule gave each dataset two chunks and io's jobs waited on them and their probes."""
    make, url = bucket
    chunk = 400_000
    io, other = make("io", 40, 1, chunk), make("other", 40, 2, chunk)
    budget = io.size + other.coop_cost // 2
    assert io.coop_cost + other.coop_cost <= budget < io.size + other.coop_cost
    m = mountd_factory(cache_size=str(budget), extra_args=(
        "--chunk-size", str(chunk), "--probe-batches", str(PROBE_BATCHES)))
    for source in (io, other):
        mount(m, source.digest, source.name, url)
    with Modes(m) as modes:
        samplers = [QuiverBatchSampler(os.path.join(m.root, s.name), BATCH, seed=k,
                                       paths=s.paths)
                    for k, s in enumerate((io, io, other))]
        try:
            results: list[list[list[int]]] = [[], [], []]
            jobs = [threading.Thread(target=read_epochs, args=(
                sampler, source, os.path.join(m.root, source.name), 2, out))
                for sampler, source, out in zip(samplers, (io, io, other), results)]
            for job in jobs:
                job.start()
            for job in jobs:
                job.join(JOB_TIMEOUT)
        finally:
            for sampler in samplers:
                sampler.close()
    assert modes.seen["io"] == ["full"], modes.seen  # from the first answer, throughout
    for out, source in zip(results, (io, io, other)):
        assert [indices for indices, _ in out] == [list(range(len(source.paths)))] * 2
    assert [out[1][1] for out in results[:2]] == [len(io.paths)] * 2  # epoch 1: all hits
    counters = {d["name"]: d["counters"] for d in m.status()["datasets"]}
    assert counters["io"]["bucket_fetches"] == len(io.paths), counters["io"]


def run_job(root: str, source: Source, compute_s: float, epochs: int, out: dict,
            stop: threading.Event | None = None) -> None:
    """A training loop (DataLoader with 2 workers, ``compute_s`` a batch) that reports
    its batch intervals, so that its probes measure it; each epoch's indices and every
    item's bytes checked into ``out``."""
    sampler = QuiverBatchSampler(root, BATCH, seed=3, paths=source.paths)
    loader = torch.utils.data.DataLoader(Dataset(root, source.paths), batch_sampler=sampler,
                                         num_workers=2, collate_fn=list)
    out["job"], out["epochs"], out["wrong"] = sampler.job_id, [], []
    try:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            indices = []
            for batch in loader:
                for i, digest in batch:
                    indices.append(i)
                    if digest != source.expected[i]:
                        out["wrong"].append(i)
                time.sleep(compute_s)
            out["epochs"].append(sorted(indices))
            if stop is not None and stop.is_set():
                break
    finally:
        sampler.close()


def job_status(m: MountdProcess, job: str) -> dict:
    return next(j for j in m.status()["jobs"] if j["job"] == job)


def test_a_prior_that_turns_out_wrong_is_corrected_by_one_probe(mountd_factory, bucket):
    """hides (one job that computes 0.5 s a batch: it hides its reads) and gains (one
    I/O-bound job) each fit the cache whole, not together; hides, the smaller, whose job
    starts first, is allotted full first, and keeps it when gains' job comes. Its job's
    first probe measures that it hides its misses, and the cache goes to gains, whole;
    every epoch reads each item once, bytes intact. (Both jobs started at once, gains'
    was sometimes reported first, alone, and allotted full: 1 of 1,114 in a suite.)"""
    make, url = bucket
    chunk = 1_000_000
    hides, gains = make("hides", 80, 3, chunk), make("gains", 96, 4, chunk)
    budget = (gains.size + hides.size + gains.coop_cost) // 2
    assert hides.size < gains.size <= budget < hides.size + gains.coop_cost
    m = mountd_factory(cache_size=str(budget), extra_args=(
        "--chunk-size", str(chunk), "--probe-batches", str(PROBE_BATCHES)))
    for source in (hides, gains):
        mount(m, source.digest, source.name, url)
    results: list[dict] = [{}, {}]
    stop = threading.Event()
    jobs = [threading.Thread(target=run_job, args=(
        os.path.join(m.root, "hides"), hides, 0.5, 3, results[0])),
        threading.Thread(target=run_job, args=(
            os.path.join(m.root, "gains"), gains, 0.02, 100, results[1], stop))]
    with Modes(m) as modes:
        try:
            jobs[0].start()
            modes.wait(lambda: "hides" in modes.seen, 30, "hides allotted")
            jobs[1].start()
            modes.wait(lambda: {"hides", "gains"} <= set(modes.seen), 30, "both allotted")
            assert modes.seen["hides"][0] == "full" and modes.seen["gains"][0] != "full", (
                modes.seen)
            modes.wait(lambda: modes.seen["gains"][-1] == "full", 90, "gains allotted full")
            job = results[0]["job"]
            # one probe, the first the coordinator asked for, told that the job hides its
            # misses
            assert modes.cycles["hides"]["probes"] == {job: 1}, modes.cycles["hides"]
            assert job_status(m, job)["benefit"] < NO_BENEFIT, job_status(m, job)
            assert modes.seen["hides"][-1] != "full", modes.seen
        finally:
            stop.set()
            for job in jobs:
                if job.ident is not None:  # started
                    job.join(JOB_TIMEOUT)
    assert modes.seen["hides"][0] == "full" and modes.seen["gains"][-1] == "full"
    for out, source in zip(results, (hides, gains)):
        assert out["epochs"] and out["wrong"] == [], out
        assert all(e == list(range(len(source.paths))) for e in out["epochs"]), out["job"]

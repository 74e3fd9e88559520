"""``quiver bench allocation``: benefit-aware cache allocation against plain LRU (§5.3).

Three synthetic ImageFolder datasets sit in the GCS emulator behind one bandwidth-capped
proxy (``throttle_proxy``), as a cluster's jobs share a bucket's bandwidth. Three job
types, each on its own dataset, differ in their (simulated) compute per mini-batch:
``io`` 20 ms per 16 items, as a light model (I/O-bound), ``medium`` more, ``heavy``
enough to hide its I/O. Every job is a separate process that reads for a fixed time, as
many epochs as it gets through, three ways:

- ``nocache``: each job's own seeded permutation, read from the bucket with the
  google-cloud-storage client through the same proxy (no mount, no cache);
- ``lru``: the same permutations, exact reads through one mountd whose cache holds a
  fraction of all three datasets (its store evicts least-recently-used);
- ``quiver``: ``QuiverBatchSampler`` manifests through one mountd with the same cache:
  its embedded coordinator probes every job (``--probe-batches`` without hits), and
  gives each dataset a full cache, two chunks (cooperative) or nothing by G per byte.

A job reads each batch's files with a few threads (like DataLoader workers, a batch or
two ahead of its compute) and sleeps its compute time per batch. Cluster throughput is
the items all jobs finished per second after a warm-up (which holds the probes and the
first, cold epoch of a cached dataset), normalized by the ``nocache`` throughput.

That is the headline workload (``io20``). A second one (``wide``) makes the ``io``
dataset about 45% of all the bytes, so that at the 30% budget LRU cannot hold it; its
summary keys end in ``_wide``. ``probe_fetches_cached`` counts the bucket fetches that
probes made, after the warm-up, of datasets allotted ``full`` all that time: a wholly
cached dataset has nothing to learn from forcing misses.

Run as ``python -m quiverfs.bench.allocation SPEC`` this module is one job (the worker).
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import os
import queue
import re
import shutil
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from coordinator.allocation import DatasetDemand, JobBenefit
from quiverfs import digest as digest_format
from quiverfs.bench import figures
from quiverfs.bench.bucket_dataset import Dataset, upload_synthetic
from quiverfs.bench.emulator import running_emulator
from quiverfs.bench.job_child import JobProcess, running_jobs
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench.reading_job import PREFETCH_BATCHES, READERS, JobInput, bucket_address
from quiverfs.bench.throttle_proxy import ThrottleProxy, throttled
from quiverfs.chunk_plan import make_plan
from quiverfs.counters import ReadCounter, SamplerJobCounter

log = logging.getLogger(__name__)

BUCKET = "bench"
CACHED = ("lru", "quiver")  # the ways to read through a cache, run at every budget
POLL_INTERVAL = 1.0  # seconds between samples of mountd's status and the proxy's bytes
JOB_START_TIMEOUT = 180.0  # seconds a job may take to start (importing torch, registering)
JOB_REPORT_SLACK = 120.0  # seconds past its run time a job may take to finish its batch
JOB_STOP_TIMEOUT = 30.0  # seconds a job may take to unregister and exit
GOAL_VS_LRU = 1.3  # Quiver / LRU throughput wanted at a workload's constrained budgets
GOAL_NEVER_LOSES = 1.0  # Quiver / LRU throughput wanted at every other budget
FIRST_S = 60.0  # seconds from the jobs' start that gain_vs_lru_first60_N measures
GOAL_FIRST = 0.9  # Quiver / LRU throughput wanted over the first FIRST_S, at every budget
GOAL_SETTLE_S = 30.0  # allocation_settle_s wanted: a job's start to its last mode change
IO_COMPUTE_PER_16 = 0.020  # seconds per 16 items: the io job's compute, a light model's


def io_compute(batch_size: int) -> float:
    """The headline io job's compute per batch: IO_COMPUTE_PER_16 scaled to the batch."""
    return IO_COMPUTE_PER_16 * batch_size / 16


@dataclasses.dataclass(frozen=True)
class JobType:
    """A kind of training job and the dataset it reads (named after it)."""

    name: str
    items: int  # in its dataset
    compute_s: float  # simulated compute per batch (seconds)
    jobs: int  # concurrent jobs of this type, each with its own seed


@dataclasses.dataclass(frozen=True)
class Size:
    """How big a run is."""

    types: tuple[JobType, ...]
    classes: int
    mean_item_bytes: int
    batch_size: int
    bucket_rate: float  # bytes/s through the proxy, all connections together
    chunk_fraction: float  # chunk bytes / all datasets' bytes (--chunk-size)
    probe_batches: int  # --probe-batches: a probe ends early in the run
    seconds: float  # each configuration runs its jobs this long
    warmup_s: float  # left out of the throughput (probes, cold first epochs)
    budgets: tuple[float, ...]  # cache bytes / all datasets' bytes
    wide_io_items: int  # the io dataset's items in the second workload


@dataclasses.dataclass(frozen=True)
class Workload:
    """The job types one series of configurations runs (no cache, then every budget)."""

    name: str  # "io<ms of io compute per 16 items>" for the headline, else "wide"
    suffix: str  # of its summary keys: "" for the headline, else "_" + name
    size: Size  # with this workload's job types
    constrained: tuple[float, ...]  # the budgets where Quiver should beat LRU by GOAL_VS_LRU

    def goal(self, budget: float) -> float:
        """The Quiver / LRU throughput wanted at ``budget``."""
        return GOAL_VS_LRU if budget in self.constrained else GOAL_NEVER_LOSES


def workloads(size: Size) -> list[Workload]:
    """The headline workload (``size`` as it is), then ``wide``: the same jobs, with an
    io dataset of ``size.wide_io_items`` items."""
    io = next(t for t in size.types if t.name == "io")
    wide = dataclasses.replace(size, types=tuple(
        dataclasses.replace(t, items=size.wide_io_items) if t is io else t
        for t in size.types))
    return [Workload(f"io{io.compute_s * 16 / size.batch_size * 1000:.3g}", "", size, (0.15,)),
            Workload("wide", "_wide", wide, (0.15, 0.3))]


# Chunks of 3% of all the bytes: two of a dataset (its cooperative share) fit the 15%
# budget twice, and the io dataset in full plus two medium chunks fit 30%. The heavy
# job's compute hides its share of the bucket. Probes of 8 batches (4 settle: a job reads
# at most 2 batches ahead) measure every job within the 75 s warm-up (the heavy job's
# 3-s batches in windows of 1-2 intervals, ``mountd.jobs.probing.WINDOW_SECONDS``: its
# t_hit 11 batches in, about 30 s). The io job computes 20 ms per 16 items
# (tiny: 5 ms per batch of 4). In the wide workload the io dataset is 45% of the bytes
# (800 of 60 KB against medium's 18 MB and heavy's 40 MB).
SIZES = {
    "full": Size((JobType("io", 250, io_compute(16), 4), JobType("medium", 300, 0.64, 2),
                  JobType("heavy", 650, 3.0, 1)),
                 10, 60_000, 16, 4e6, 0.03, 8, 140.0, 75.0, (0.15, 0.3, 0.6, 0.9), 800),
    "quick": Size((JobType("io", 105, io_compute(16), 2), JobType("medium", 125, 0.64, 1),
                   JobType("heavy", 270, 3.0, 1)),
                  5, 60_000, 16, 4e6, 0.03, 8, 12.0, 5.0, (0.15, 0.3, 0.6, 0.9), 330),
    "tiny": Size((JobType("io", 40, io_compute(4), 1), JobType("medium", 40, 0.02, 1),
                  JobType("heavy", 60, 0.2, 1)),
                 4, 30_000, 4, 4e6, 0.05, 8, 6.0, 2.0, (0.3,), 80),
}


# -- the job (a separate process) ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What one job process does; sent to it as JSON on its command line."""

    kind: str  # "nocache", or one of CACHED
    source: str  # the dataset's directory in the mount; for nocache a bucket_address
    seed: int
    batch_size: int
    compute_s: float
    seconds: float  # stop after the batch that ends past this many seconds


_Planned = tuple[list[str], list[concurrent.futures.Future]]  # a batch and its reads


def paths_digest(paths: list[str]) -> str:
    """SHA-256 of the sorted paths: equal to the dataset's iff each was read exactly once."""
    return hashlib.sha256("\n".join(sorted(paths)).encode()).hexdigest()


class _Prefetcher:
    """Plans batches in a thread and hands each one's files to the reader pool as soon as
    it is planned, up to PREFETCH_BATCHES batches ahead of the consumer (as a DataLoader
    dispatches index batches to its workers); leaving the ``with`` block stops planning
    and waits for the reads already handed out."""

    def __init__(self, read: Callable[[str], int], pool: concurrent.futures.Executor,
                 plans: Iterator[list[str]]) -> None:
        self._read = read
        self._pool = pool
        self._plans = plans
        self._ready: queue.Queue[_Planned | BaseException | None] = queue.Queue(
            PREFETCH_BATCHES)
        self._stop = threading.Event()
        self._ended = False
        self._thread = threading.Thread(target=self._produce, name="planner", daemon=True)

    def __enter__(self) -> _Prefetcher:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        while not self._ended:  # the planner ends after the batch it is planning
            item = self._take()
            if isinstance(item, tuple):
                concurrent.futures.wait(item[1])
        self._thread.join()

    def _take(self) -> _Planned | BaseException | None:
        item = self._ready.get()
        self._ended = item is None
        return item

    def _produce(self) -> None:
        try:
            while not self._stop.is_set():
                paths = next(self._plans, None)  # a manifest: mountd may fetch misses first
                if paths is None:
                    break
                self._ready.put((paths, [self._pool.submit(self._read, p) for p in paths]))
        except BaseException as exc:  # handed to the consumer, which raises it
            self._ready.put(exc)
        finally:
            self._ready.put(None)

    def __iter__(self) -> Iterator[list[str]]:
        while (item := self._take()) is not None:
            if isinstance(item, BaseException):
                raise item
            paths, reads = item
            for read in reads:
                read.result()
            yield paths


def _train(spec: JobSpec, job: JobInput) -> dict[str, Any]:
    """Run epochs for ``spec.seconds``: when each batch's compute ended (monotonic clock,
    which every process shares) and its size; each epoch's items, and for a complete
    epoch the digest of its paths."""
    start = time.monotonic()
    stop_at = start + spec.seconds
    batches: list[tuple[float, int]] = []
    epochs: list[dict[str, Any]] = []
    epoch = 0
    while time.monotonic() < stop_at:
        paths: list[str] = []
        with _Prefetcher(job.source.read, job.pool, job.plans.epoch(epoch)) as loaded:
            for batch in loaded:
                time.sleep(spec.compute_s)  # the simulated training step
                paths += batch
                batches.append((round(time.monotonic(), 4), len(batch)))
                if time.monotonic() >= stop_at:
                    break
        complete = len(paths) == len(job.plans.paths)
        epochs.append({"epoch": epoch, "items": len(paths), "complete": complete,
                       "paths_sha256": paths_digest(paths) if complete else None})
        epoch += 1
    return {"start": start, "batches": batches, "epochs": epochs}


def job_main(argv: list[str]) -> int:
    """One job: announce readiness (and its mountd job id), train for its time after a
    ``go`` line on stdin, answer with one JSON line, and exit after the next line."""
    spec = JobSpec(**json.loads(argv[0]))
    with JobInput(spec.source, spec.kind == "nocache", spec.kind == "quiver", spec.batch_size,
                  spec.seed) as job:
        print(json.dumps({"ready": True, "job": job.plans.job_id}), flush=True)
        if sys.stdin.readline().strip() != "go":
            return 1
        print(json.dumps(_train(spec, job)), flush=True)
        sys.stdin.readline()  # the parent reads mountd's status before we unregister
    return 0


# -- the parent: one configuration -----------------------------------------------------
# in each configuration's window_counters: pushes, and those whose pages were gone by
# their read (another job's page drop), say how much of the reads pushes served
COUNTER_KEYS = (ReadCounter.LOCAL_HITS, ReadCounter.MISSES, ReadCounter.PROBE_MISSES,
                ReadCounter.BUCKET_FETCHES, ReadCounter.BUCKET_BYTES, ReadCounter.PUSHED,
                ReadCounter.PUSHED_DROPPED)
JOB_KEYS = ("dataset", "epoch", "t_miss", "t_hit", "benefit", "probing", "gpus")


def _sample(m: MountdProcess | None, proxy: ThrottleProxy, t: float) -> dict[str, Any]:
    """The proxy's bytes and, with a mountd, its per-dataset counters, modes and jobs."""
    sample: dict[str, Any] = {"t": round(t, 2), "proxy_bytes": proxy.bytes_down}
    if m is None:
        return sample
    status = m.status()
    names = {d["identity"]: d["name"] for d in status["datasets"]}
    cycles = m.call({"op": "cluster"})["cycles"]
    sample.update(
        cache_used=status["cache"]["used_bytes"],
        modes={names[i]: c["mode"] for i, c in cycles.items() if i in names},
        counters={d["name"]: {k: int(d["counters"].get(k, 0)) for k in COUNTER_KEYS}
                  for d in status["datasets"]},
        fetch_causes={d["name"]: d["bucket_fetch_causes"] for d in status["datasets"]},
        jobs={j["job"]: {**{k: j.get(k) for k in JOB_KEYS}, **j["counters"]}
              for j in status["jobs"]})
    return sample


def _watch(jobs: list[JobProcess], m: MountdProcess | None, proxy: ThrottleProxy,
           seconds: float) -> tuple[float, float, list[dict[str, Any]]]:
    """Start the jobs; sample every POLL_INTERVAL while they run. (go time, the same on
    the wall clock that mountd's log shows, samples)."""
    go, go_wall = time.monotonic(), time.time()
    for job in jobs:
        job.send("go")
    samples = []
    while (now := time.monotonic()) < go + seconds:
        samples.append(_sample(m, proxy, now - go))
        time.sleep(min(POLL_INTERVAL, max(0.0, go + seconds - time.monotonic())))
    samples.append(_sample(m, proxy, time.monotonic() - go))
    return go, go_wall, samples


def _mode_changes(samples: list[dict[str, Any]]) -> list[list[Any]]:
    """[seconds, dataset, mode] whenever a dataset's allocation changed."""
    changes, last = [], {}
    for s in samples:
        for name, mode in sorted(s.get("modes", {}).items()):
            if last.get(name) != mode:
                changes.append([s["t"], name, mode])
                last[name] = mode
    return changes


def _allocation_log(log_path: str) -> list[str]:
    """The coordinator's allocation decisions, with the numbers behind them, from mountd's
    log (the embedded coordinator logs every change of a dataset's mode)."""
    with open(log_path, encoding="utf-8", errors="replace") as f:
        return [line.strip() for line in f if "coordinator.state: dataset " in line]


# a change of a dataset's mode as the coordinator logs it (coordinator.state._allocate)
_MODE_CHANGE = re.compile(r"^(\S+ \S+) \w+ coordinator\.state: dataset (\S+): \w+ -> \w+ ")


def _settle_s(log_lines: list[str], go_wall: float, end_wall: float) -> dict[str, float]:
    """{dataset: seconds from the jobs' start (``go_wall``, on the wall clock) to the last
    change of its mode in ``log_lines`` until ``end_wall`` (then the jobs stop, and each
    one's leaving moves the allocation); 0 where none changed after the start}."""
    settle: dict[str, float] = {}
    for line in log_lines:
        match = _MODE_CHANGE.match(line)
        if match is None:
            continue
        at = datetime.datetime.strptime(match[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        if at <= end_wall:
            settle[match[2]] = max(settle.get(match[2], 0.0), round(at - go_wall, 2))
    return settle


def _probe_fetches_cached(samples: list[dict[str, Any]], start: float) -> dict[str, int]:
    """{dataset: bucket fetches its probes made from ``start`` seconds on}, for each
    dataset allotted ``full`` in every sample since then (wholly cached by then: a full
    dataset loads during the warm-up)."""
    window = [s for s in samples if s["t"] >= start] or samples[-1:]
    first, last = window[0], window[-1]

    def probes(s: dict[str, Any], name: str) -> int:
        return s["fetch_causes"][name]["probe"]["fetches"]

    return {name: probes(last, name) - probes(first, name) for name in last["modes"]
            if all(s["modes"].get(name) == "full" for s in window)}


def _window(samples: list[dict[str, Any]], start: float) -> tuple[dict[str, Any],
                                                                 dict[str, Any]]:
    """The first sample at or after ``start`` seconds, and the last one."""
    first = next((s for s in samples if s["t"] >= start), samples[-1])
    return first, samples[-1]


def _job_report(job: JobProcess, reply: dict[str, Any], expected: str,
                window: tuple[float, float], first: tuple[float, float],
                info: dict[str, Any]) -> dict[str, Any]:
    """One job's throughput in the window and in the ``first`` seconds, its epochs, and
    what mountd knew of it."""
    w0, w1 = window
    items = sum(n for t, n in reply["batches"] if w0 < t <= w1)
    f0, f1 = first
    first_items = sum(n for t, n in reply["batches"] if f0 < t <= f1)
    complete = [e for e in reply["epochs"] if e["complete"]]
    out = {"name": job.name, "seed": job.spec.seed, "compute_s": job.spec.compute_s,
           "items_per_s": items / (w1 - w0),
           "items_per_s_first60": first_items / (f1 - f0),
           "items": sum(e["items"] for e in reply["epochs"]),
           "epochs_complete": len(complete),
           "exactly_once": all(e["paths_sha256"] == expected for e in complete)}
    if job.job_id is not None:
        out.update(job=job.job_id, hits=info.get(SamplerJobCounter.HITS),
                   fetched=info.get(SamplerJobCounter.FETCHED),
                   chunk_wait_s=round(info.get(SamplerJobCounter.CHUNK_WAIT_S, 0.0), 2),
                   **{k: info.get(k) for k in ("t_miss", "t_hit", "benefit", "probing")})
    return out


def run_config(kind: str, budget: float, data: dict[str, Dataset], proxy: ThrottleProxy,
               workload: Workload, workdir: str) -> dict[str, Any]:
    """Every job of ``workload`` reading ``kind``'s way, with a cache of ``budget`` of all
    datasets' bytes (none for nocache); the configuration's report."""
    size = workload.size
    total = sum(d.bytes for d in data.values())
    name = kind if kind == "nocache" else f"{kind}-{round(budget * 100)}pct"
    name += f"-{workload.name}"
    base = os.path.join(workdir, name)
    os.makedirs(base)
    cache_bytes = int(budget * total) if kind != "nocache" else 0
    chunk_bytes = int(size.chunk_fraction * total)
    types = {t.name: t for t in size.types}
    log.info("%s: cache %d bytes, chunks of %d bytes, %d s", name, cache_bytes, chunk_bytes,
             size.seconds)
    with contextlib.ExitStack() as stack:
        m: MountdProcess | None = None
        if kind == "nocache":
            sources = {t.name: bucket_address(proxy.url, BUCKET, _prefix(t)) for t in size.types}
        else:
            m = stack.enter_context(running_mountd(
                base, cache_size=str(cache_bytes), extra_args=(
                    "--chunk-size", str(chunk_bytes),
                    "--probe-batches", str(size.probe_batches))))
            for t in types:
                m.call({"op": "mount", "name": t, "digest": data[t].digest,
                        "emulator_host": proxy.url})
            sources = {t: os.path.join(m.root, t) for t in types}
        specs = {f"{t.name}{i}": JobSpec(kind, sources[t.name], i, size.batch_size,
                                         t.compute_s, size.seconds)
                 for t in size.types for i in range(t.jobs)}
        jobs = stack.enter_context(running_jobs(__name__, specs, base, JOB_START_TIMEOUT))
        go, go_wall, samples = _watch(jobs, m, proxy, size.seconds)
        replies = {job.name: job.receive(JOB_REPORT_SLACK) for job in jobs}
        end_wall = time.time()  # every job has ended its run; none has left yet
        final = _sample(m, proxy, time.monotonic() - go)  # while the jobs are registered
        for job in jobs:
            job.finish(JOB_STOP_TIMEOUT)
    shutil.rmtree(os.path.join(base, "node-cache"), ignore_errors=True)

    window = (go + size.warmup_s, go + size.seconds)
    first_window = (go, go + min(FIRST_S, size.seconds))
    first, last = _window(samples, size.warmup_s)
    per_job: dict[str, list[dict[str, Any]]] = {t: [] for t in types}
    for job in jobs:
        t = job.name.rstrip("0123456789")
        per_job[t].append(_job_report(job, replies[job.name], paths_digest(data[t].paths),
                                      window, first_window,
                                      final.get("jobs", {}).get(job.job_id, {})))
    report: dict[str, Any] = {
        "kind": kind, "budget": budget, "workload": workload.name, "cache_bytes": cache_bytes,
        "items_per_s": sum(j["items_per_s"] for js in per_job.values() for j in js),
        "items_per_s_first60": sum(j["items_per_s_first60"] for js in per_job.values()
                                   for j in js),
        "bucket_bytes_per_s": (last["proxy_bytes"] - first["proxy_bytes"])
        / max(1e-9, last["t"] - first["t"]),
        "types": {t: {"items_per_s": sum(j["items_per_s"] for j in js), "jobs": js}
                  for t, js in per_job.items()},
        "exactly_once": all(j["exactly_once"] for js in per_job.values() for j in js)}
    if m is not None:
        report["window_counters"] = {
            t: {k: last["counters"][t][k] - first["counters"][t][k] for k in COUNTER_KEYS}
            for t in types}
        report["cache_used_bytes"] = last["cache_used"]
        report["bucket_fetch_causes"] = final["fetch_causes"]
    if kind == "quiver":
        decisions = _allocation_log(os.path.join(base, "node.log"))
        settle = _settle_s(decisions, go_wall, end_wall)
        report.update(chunk_bytes=chunk_bytes, modes=final["modes"],
                      mode_changes=_mode_changes(samples),
                      probe_fetches_cached=_probe_fetches_cached(samples, size.warmup_s),
                      allocation_log=decisions, started_at=go_wall, settle_s=settle,
                      allocation_settle_s=max(settle.values(), default=0.0),
                      gain={t: round(DatasetDemand(t, data[t].bytes, chunk_bytes, tuple(
                          JobBenefit(int(j.get("gpus") or 1), j.get("t_miss"), j.get("t_hit"))
                          for j in final["jobs"].values() if j["dataset"] == t)).gain, 3)
                          for t in types},
                      benefit_timeline=[{"t": s["t"], **{
                          job.name: s["jobs"].get(job.job_id, {}).get("benefit")
                          for job in jobs}} for s in samples])
    log.info("%s: %.1f items/s (%s)", name, report["items_per_s"], ", ".join(
        f"{t} {v['items_per_s']:.1f}" for t, v in report["types"].items()))
    return report


# -- the benchmark ---------------------------------------------------------------------
def _prefix(t: JobType) -> str:
    """Where in the bucket the dataset of job type ``t`` is: one per name and size."""
    return f"{t.name}{t.items}"


def _upload(emulator_host: str, loads: list[Workload], workdir: str
            ) -> dict[str, dict[str, Dataset]]:
    """{workload: {job type: its dataset}}: each distinct dataset (``_prefix``) written,
    uploaded and digested once (distinct seeds: distinct items)."""
    made: dict[str, Dataset] = {}
    out: dict[str, dict[str, Dataset]] = {}
    for load in loads:
        mine = out[load.name] = {}
        for t in load.size.types:
            prefix = _prefix(t)
            if prefix not in made:
                made[prefix] = upload_synthetic(
                    emulator_host, BUCKET, prefix, workdir, t.items, load.size.classes,
                    seed=11 + len(made), mean_size=load.size.mean_item_bytes)
            mine[t.name] = made[prefix]
    return out


def _chunking(data: Dataset, chunk_bytes: int, total: int) -> dict[str, Any]:
    """The dataset's chunks as mountd plans them, and what two of them cost."""
    plan = make_plan(digest_format.decode(data.digest), chunk_bytes)
    return {"chunks": plan.n_chunks, "largest_chunk_bytes": max(plan.chunk_bytes),
            "coop_fraction": round(2 * max(plan.chunk_bytes) / total, 3)}


def _ratios(configs: list[dict[str, Any]], workload: Workload
            ) -> tuple[dict[str, Any], dict[str, bool]]:
    """``workload``'s throughput ratios per budget, its keys ending in its suffix, and
    whether each budget's Quiver / LRU meets its goal (unrounded: 0.998 misses 1.0)."""
    by = {(c["kind"], c["budget"]): c for c in configs if c["workload"] == workload.name}
    base = by["nocache", 0.0]["items_per_s"]
    out: dict[str, Any] = {}
    met: dict[str, bool] = {}
    for b in workload.size.budgets:
        pct = round(b * 100)
        quiver, lru = by["quiver", b]["items_per_s"], by["lru", b]["items_per_s"]
        key = f"gain_vs_lru_{pct}{workload.suffix}"
        out[key] = round(quiver / lru, 3)
        met[key] = quiver / lru >= workload.goal(b)
        first = by["quiver", b]["items_per_s_first60"] / by["lru", b]["items_per_s_first60"]
        key = f"gain_vs_lru_first60_{pct}{workload.suffix}"
        out[key] = round(first, 3)
        met[key] = first >= GOAL_FIRST
        out[f"allocation_settle_s_{pct}{workload.suffix}"] = by["quiver", b][
            "allocation_settle_s"]
        out[f"gain_vs_nocache_{pct}{workload.suffix}"] = round(quiver / base, 2)
        out[f"lru_vs_nocache_{pct}{workload.suffix}"] = round(lru / base, 2)
    out[f"items_per_s_nocache{workload.suffix}"] = round(base, 1)
    return out, met


def _summary(configs: list[dict[str, Any]], loads: list[Workload]) -> dict[str, Any]:
    """Every workload's ratios, the probes' fetches of cached datasets, and the goals."""
    summary: dict[str, Any] = {}
    goals: dict[str, bool] = {}
    for workload in loads:
        ratios, met = _ratios(configs, workload)
        summary.update(ratios)
        goals.update(met)
    summary["probe_fetches_cached"] = sum(n for c in configs if c["kind"] == "quiver"
                                          for n in c["probe_fetches_cached"].values())
    summary["allocation_settle_s"] = max(c["allocation_settle_s"] for c in configs
                                         if c["kind"] == "quiver")
    goals["allocation_settle_s"] = summary["allocation_settle_s"] <= GOAL_SETTLE_S
    summary["exactly_once"] = all(c["exactly_once"] for c in configs)
    goals["probe_fetches_cached"] = summary["probe_fetches_cached"] == 0
    summary["goals_met"] = goals
    return summary


def _normalized(configs: list[dict[str, Any]], workload: str) -> dict[str, Any]:
    """{kind: {budget %: items_per_s / nocache's}} of one workload."""
    mine = [c for c in configs if c["workload"] == workload]
    base = next(c["items_per_s"] for c in mine if c["kind"] == "nocache")
    return {kind: {str(round(c["budget"] * 100)): round(c["items_per_s"] / base, 3)
                   for c in mine if c["kind"] == kind}
            for kind in CACHED}


def measure(size: Size, workdir: str) -> dict[str, Any]:
    """Upload the datasets; for each workload run no cache, then LRU and Quiver at each of
    its budgets."""
    loads = workloads(size)
    with running_emulator(concurrent=True) as emulator:
        emulator.create_bucket(BUCKET)
        started = time.monotonic()
        data = _upload(emulator.host, loads, workdir)
        upload_s = time.monotonic() - started
        with throttled(emulator.host, size.bucket_rate) as proxy:
            configs = []
            for load in loads:
                mine = data[load.name]
                configs.append(run_config("nocache", 0.0, mine, proxy, load, workdir))
                for budget in load.size.budgets:
                    for kind in CACHED:
                        configs.append(run_config(kind, budget, mine, proxy, load, workdir))

    def datasets(mine: dict[str, Dataset]) -> dict[str, Any]:
        total = sum(d.bytes for d in mine.values())
        return {t: {"items": len(d.paths), "bytes": d.bytes,
                    "fraction": round(d.bytes / total, 3),
                    **_chunking(d, int(size.chunk_fraction * total), total)}
                for t, d in mine.items()}

    return {
        "datasets": {load.name: datasets(data[load.name]) for load in loads},
        "upload_seconds": round(upload_s, 1),
        "settings": {**dataclasses.asdict(size), "readers_per_job": READERS,
                     "prefetch_batches": PREFETCH_BATCHES},
        "workloads": {load.name: {
            "suffix": load.suffix, "items": {t.name: t.items for t in load.size.types},
            "total_bytes": sum(d.bytes for d in data[load.name].values()),
            "goals": {str(round(b * 100)): load.goal(b) for b in load.size.budgets}}
            for load in loads},
        "headline": loads[0].name,
        "definitions": {
            "workload": "the headline (io20: the io jobs compute 20 ms per 16 items, as a "
                        "light model does) has the summary keys without suffix; wide (the "
                        "same jobs, the io dataset about 45% of all the bytes, so that LRU "
                        "cannot hold it at 30%) has them with the suffix _wide",
            "items_per_s": "items all jobs finished (after their compute) per second, from "
                           "warmup_s to seconds after the jobs started",
            "items_per_s_first60": "the same from the jobs' start to 60 s after it (to "
                                   "seconds, where a run is shorter: --quick's whole run)",
            "normalized": "{workload: {kind: {budget %: items_per_s / items_per_s of "
                          "nocache}}} (nocache: no mount, the GCS client through the same "
                          "proxy, run again for each workload)",
            "gain_vs_lru": "items_per_s of quiver / of lru at the same budget (budget: "
                           "mountd's --cache-size as a percentage of the workload's "
                           "datasets' bytes)",
            "gain_vs_lru_first60": "items_per_s_first60 of quiver / of lru at the same "
                                   "budget",
            "allocation_settle_s": "seconds from the jobs' start to the last change of "
                                   "their dataset's mode before they ended (the "
                                   "coordinator's log; 0 where none changed after the "
                                   "start; started_at: the start, on the wall clock): "
                                   "per dataset in settle_s, "
                                   "the most of them per configuration, per budget in the "
                                   "summary (allocation_settle_s_N), and the most of all",
            "modes": "the allocation per dataset when the run ended (full, coop: "
                     "chunks, none)",
            "gain": "G per dataset from the jobs' final t_miss / t_hit (allocation.py)",
            "chunk_wait_s": "seconds a job's batches waited in mountd for the chunk cycle to "
                            "bring it cached items (coop), over its whole run",
            "bucket_fetch_causes": "mountd's bucket fetches by cause per dataset over the "
                                   "configuration's whole run: {dataset: {cause: {fetches, "
                                   "bytes}}}",
            "probe_fetches_cached": "bucket fetches by probes after the warm-up, of "
                                    "datasets allotted full all that time; the summary "
                                    "adds up every quiver configuration's",
            "goal": "gain_vs_lru of each workload and budget >= workloads.goals; "
                    "gain_vs_lru_first60 >= 0.9 at each; allocation_settle_s <= 30 (in "
                    "the full run); probe_fetches_cached 0"},
        "normalized": {load.name: _normalized(configs, load.name) for load in loads},
        "configs": configs,
        "summary": _summary(configs, loads),
    }


def plot_throughput(report: dict[str, Any], out: str) -> None:
    """Normalized cluster throughput of the headline workload per budget, Quiver next to
    LRU (no cache = 1)."""
    plt = figures.pyplot()
    headline = report["headline"]
    normalized = report["normalized"][headline]
    budgets = list(normalized["quiver"])
    modes = {str(round(c["budget"] * 100)): c["modes"] for c in report["configs"]
             if c["kind"] == "quiver" and c["workload"] == headline}
    x = np.arange(len(budgets))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for offset, kind, color in ((-0.2, "lru", "tab:gray"), (0.2, "quiver", "tab:blue")):
        values = [normalized[kind][b] for b in budgets]
        bars = ax.bar(x + offset, values, 0.4, label="Quiver" if kind == "quiver" else "LRU",
                      color=color)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="no cache")
    ax.set_yscale("log")
    names = [t["name"] for t in report["settings"]["types"]]
    ax.set_xticks(x, [f"{b}% cache\n" + ", ".join(f"{t} {modes[b][t]}" for t in names
                                                  if t in modes[b]) for b in budgets],
                  fontsize=8)
    ax.set_ylabel("cluster throughput / no cache (log scale)")
    size = report["settings"]
    ax.set_title("Benefit-aware allocation vs LRU: " + ", ".join(
        f"{t['jobs']}x {t['name']} ({t['compute_s']:g} s/batch)" for t in size["types"]),
        fontsize=9)
    ax.legend(fontsize=8)
    figures.save(fig, out)


def run(quick: bool, workdir: str, plot: str | None = None, size: str | None = None) -> dict:
    """The benchmark; ``size`` ("full", "quick", "tiny") overrides ``quick``; ``plot``
    names a PNG for the normalized throughput per budget."""
    name = size or ("quick" if quick else "full")
    report = measure(SIZES[name], workdir)
    report["size"] = name
    if plot:
        plot_throughput(report, plot)
    return report


if __name__ == "__main__":
    sys.exit(job_main(sys.argv[1:]))

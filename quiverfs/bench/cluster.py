"""``quiver bench cluster``: coordinated chunks on three nodes, against direct and LRU reads.

Three mountd nodes (separate processes, each with its own cache directory and mount)
and a coordinator run on loopback. A synthetic ImageFolder dataset sits in the GCS
emulator behind one bandwidth-capped proxy (``throttle_proxy``) that every node and
job goes through, as VMs share a bucket's bandwidth; the proxy counts the bytes. The
nodes' caches together hold 20% of the dataset, cut into chunks of at most an eighth
of it (as a lone node cuts them), and the chunk size is checked to leave every node
room for its share of the K neighbouring chunks the coordinator keeps resident. The same jobs (separate
processes, spread over the nodes) read the dataset three ways:

- ``sub``: batches from ``QuiverBatchSampler`` manifests, read through the job's node's
  mount (coordinated chunks, substitutable hits, cooperative misses);
- ``lru``: the job's own seeded permutation of the files, exact reads through the mount
  (the nodes' stores evict least-recently-used);
- ``direct``: the same permutation read from the bucket with the google-cloud-storage
  client, through the same proxy.

A job (``reading_job``) reads each batch's files with a few threads (like DataLoader
workers, one batch ahead) and sleeps a simulated compute time per batch. The parent
holds the jobs at every epoch boundary so the proxy's bytes can be counted per epoch;
with a cache, epoch 0 (cold) is left out of the steady-state numbers. A thread polls
the coordinator for the chunk timeline, which ``--plot`` draws like the paper's Figure 7.

With ``--kill-coordinator`` (``measure_failover``) only the ``sub`` jobs run, on two
coordinators sharing an etcd, and the leader is SIGKILLed in the middle of an epoch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from coordinator.allocation import DatasetDemand, JobBenefit, resident_chunks
from quiverfs import digest as digest_format
from quiverfs import ownership
from quiverfs.bench import fetch_causes, figures, reading_job
from quiverfs.bench.bucket_dataset import Dataset, upload_synthetic
from quiverfs.bench.cpu_time import BackgroundCpu
from quiverfs.bench.emulator import running_emulator
from quiverfs.bench.etcd_process import etcd_available
from quiverfs.bench.ha_coordinators import ETCD_MISSING, HaCoordinators
from quiverfs.bench.job_child import JobProcess, run_epoch, running_jobs
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess
from quiverfs.bench.reading_job import PREFETCH_BATCHES, READERS, JobSpec, bucket_address
from quiverfs.bench.throttle_proxy import ThrottleProxy, throttled
from quiverfs.chunk_plan import CACHE_CHUNKS, make_plan
from quiverfs.counters import ReadCounter
from quiverfs.errors import ExitCode, QuietError
from quiverfs.heartbeat import CacheMode
from quiverfs.rpc import call_once

log = logging.getLogger(__name__)

BUCKET = "bench"
DATASET = "syn"
NODES = ("node0", "node1", "node2")
MODES = ("direct", "lru", "sub")
CACHE_FRACTION = 0.2  # of the dataset's bytes, all nodes' caches together
CHUNK_OF_CACHE = 1 / CACHE_CHUNKS  # chunk bytes / all caches, at most: as a lone node
CHUNK_HEADROOM = 0.95  # a node's share of K neighbouring chunks must fit in this much
MAX_CHUNKS_FACTOR = 3  # chunks may be this many times smaller than the largest size
HEARTBEAT_TIMEOUT = 10.0  # seconds; generous, since two cores run a dozen processes
FORCE_EVICT_AFTER = 30.0  # seconds a marked chunk may outlive its first release
PROBE_BATCHES = 4  # batches a new job runs without hits to measure its benefit (epoch 0)
EPOCH_TIMEOUT = 900.0  # seconds a job may take for one epoch (or to start)
JOB_STOP_TIMEOUT = 30.0  # seconds a job may take to unregister and exit
MEMBERSHIP_TIMEOUT = 60.0  # seconds for every node to see every member
POLL_INTERVAL = 0.5  # seconds between polls of the coordinator's chunk timeline
GOALS = {"bucket_bytes_ratio": ("<=", 1.1), "speedup_vs_direct": (">=", 3.0)}


@dataclasses.dataclass(frozen=True)
class Size:
    """How big a run is."""

    items: int  # synthetic dataset items
    classes: int
    mean_item_bytes: int
    jobs: int  # spread round-robin over the nodes
    batch_size: int
    compute_s: float  # simulated compute per batch (seconds)
    bucket_rate: float  # bytes/s through the proxy, all connections together
    epochs_direct: int  # every epoch counts (no cache to warm)
    epochs_cached: int  # lru and sub; epoch 0 is the warm-up


# One job alone reads slower than the bucket's cap (in full ~36 items/s against ~60): each
# job is compute-bound on cache hits, the jobs together are I/O-bound on the bucket, which
# is where a shared cache pays. tiny only checks that everything works end to end.
SIZES = {
    "full": Size(1200, 10, 100_000, 6, 32, 0.9, 6e6, 1, 3),
    "quick": Size(300, 10, 40_000, 4, 16, 0.28, 3.6e6, 1, 2),
    "tiny": Size(420, 5, 30_000, 2, 8, 0.01, 16e6, 1, 2),
}


# -- the parent: the cluster -----------------------------------------------------------
@dataclasses.dataclass
class Cluster:
    """A running coordinator and its nodes, each with the dataset mounted."""

    coordinator: CoordinatorProcess  # the one whose status is read: the leader
    secret: bytes
    nodes: dict[str, MountdProcess]
    ha: HaCoordinators | None = None  # two coordinators on etcd (--kill-coordinator)

    def members_seen(self) -> bool:
        """Whether every node sees every node live."""
        everyone = sorted(self.nodes)
        return all(sorted(n["id"] for n in m.call({"op": "cluster"})["nodes"] if n["live"])
                   == everyone for m in self.nodes.values())

    def counters(self) -> dict[str, Any]:
        """The dataset's read counters and its bucket fetches by cause, summed over the
        nodes."""
        keys = (ReadCounter.LOCAL_HITS, ReadCounter.PEER_HITS, ReadCounter.MISSES,
                ReadCounter.BUCKET_FETCHES, ReadCounter.BUCKET_BYTES, ReadCounter.COALESCED)
        total: dict[str, Any] = dict.fromkeys(keys, 0)
        causes = []
        for m in self.nodes.values():
            status = m.status()
            for ds in status["datasets"]:
                if ds["name"] == DATASET:
                    for k in keys:
                        total[k] += int(ds["counters"].get(k, 0))
            causes.append(fetch_causes.of_dataset(status, DATASET))
        total["bucket_fetch_causes"] = fetch_causes.total(causes)
        return total

    def coordinator_status(self) -> dict[str, Any]:
        return call_once(self.coordinator.address, self.secret, "status")


def _stop_node(m: MountdProcess) -> None:
    rc = m.stop()  # unmounts
    if rc != 0:
        log.warning("mountd %s exited %s: %s", m.root, rc, m.log_tail())


@contextlib.contextmanager
def running_cluster(base: str, data: Dataset, node_cache: int, chunk_bytes: int,
                    bucket_endpoint: str, ha: bool = False) -> Iterator[Cluster]:
    """A coordinator (``ha``: two, on an etcd of their own, the nodes listing both) and
    NODES under ``base``, each with the dataset mounted from ``bucket_endpoint``; every
    process stopped and every mount gone on exit."""
    os.makedirs(base, exist_ok=True)
    secret = secrets.token_hex(32).encode()
    secret_file = os.path.join(base, "secret")
    with open(os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(secret)
    coordinator_args = ("--probe-batches", str(PROBE_BATCHES))
    with contextlib.ExitStack() as stack:
        if ha:
            pair = HaCoordinators(base, secret_file, secret, HEARTBEAT_TIMEOUT,
                                  FORCE_EVICT_AFTER, coordinator_args)
            stack.callback(pair.stop)
            pair.start()
            cluster = Cluster(pair.coordinators[0], secret, {}, pair)
            addresses = pair.addresses
        else:
            coordinator = CoordinatorProcess(os.path.join(base, "coordinator"), secret_file,
                                             os.path.join(base, "coordinator.log"),
                                             heartbeat_timeout=HEARTBEAT_TIMEOUT,
                                             force_evict_after=FORCE_EVICT_AFTER,
                                             extra_args=coordinator_args)
            stack.callback(coordinator.stop)
            coordinator.start()
            cluster = Cluster(coordinator, secret, {})
            addresses = coordinator.address
        for name in NODES:
            root, cache = os.path.join(base, f"{name}-mnt"), os.path.join(base, f"{name}-cache")
            os.makedirs(root, exist_ok=True)
            os.makedirs(cache, exist_ok=True)
            m = MountdProcess(root, cache, str(node_cache), os.path.join(base, f"{name}.log"),
                              extra_args=("--coordinator", addresses,
                                          "--listen", "127.0.0.1:0", "--node-id", name,
                                          "--cluster-secret-file", secret_file,
                                          "--chunk-size", str(chunk_bytes),
                                          "--force-evict-after", str(FORCE_EVICT_AFTER)))
            stack.callback(_stop_node, m)
            m.start()
            m.call({"op": "mount", "name": DATASET, "digest": data.digest,
                    "emulator_host": bucket_endpoint})
            cluster.nodes[name] = m
        deadline = time.monotonic() + MEMBERSHIP_TIMEOUT
        while not cluster.members_seen():
            if time.monotonic() > deadline:
                raise RuntimeError("the nodes did not all see each other within "
                                   f"{MEMBERSHIP_TIMEOUT:.0f} s")
            time.sleep(0.1)
        yield cluster


class TimelineRecorder:
    """Polls the coordinator's status in a thread, keeping every chunk-state event of
    the dataset (status returns only the latest ones), its cycle's ``max_resident``, and
    when its cache allocation (coop, full or none) changed."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.events: dict[tuple[float, int, str], None] = {}  # ordered, without repeats
        self.max_resident = 0
        self.modes: list[tuple[float, str]] = []  # (time, allocation) at each change
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="timeline", daemon=True)

    def __enter__(self) -> TimelineRecorder:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.poll()  # the last transitions

    def _run(self) -> None:
        while not self._stop.wait(POLL_INTERVAL):
            self.poll()

    def poll(self) -> None:
        try:
            status = self.cluster.coordinator_status()
        except QuietError as exc:
            log.debug("coordinator status: %s", exc.message)
            return
        for ds in status.get("datasets", ()):  # a standby's status has none
            if ds["name"] == DATASET:
                self.max_resident = max(self.max_resident, int(ds["max_resident"]))
                if not self.modes or self.modes[-1][1] != ds["mode"]:
                    self.modes.append((time.time(), str(ds["mode"])))
                for t, chunk, state in ds["timeline"]:
                    self.events[float(t), int(chunk), str(state)] = None

    def timeline(self) -> list[tuple[float, int, str]]:
        """The events in the coordinator's order (each poll's are, and overlap)."""
        return list(self.events)


def max_resident_from(timeline: list[tuple[float, int, str]]) -> int:
    """The most chunks resident (not evicted) at once, replaying the events in order."""
    states: dict[int, str] = {}
    most = 0
    for _, chunk, state in timeline:
        states[chunk] = state
        most = max(most, sum(s != "evicted" for s in states.values()))
    return most


def choose_chunk_bytes(data: Dataset, node_cache: int) -> tuple[int, dict[str, Any]]:
    """The largest chunk size up to CHUNK_OF_CACHE of all caches for which, in the plan
    the nodes will make, every node's share (by ownership) of any K neighbouring chunks
    fits in CHUNK_HEADROOM of its cache, leaving room for the misses jobs fetch; K is
    what the coordinator allots the dataset (``resident_chunks``). (Chunks are uneven
    when a partition has few items per stripe unit: the first chunks get the
    remainders.)"""
    digest = digest_format.decode(data.digest)
    owner_of = np.array([NODES.index(ownership.owner(digest.hash(i), list(NODES)))
                         for i in range(len(digest))])
    sizes = np.asarray(digest.sizes, dtype=float)
    fewest = math.ceil(data.bytes / (CHUNK_OF_CACHE * node_cache * len(NODES)))
    for k in range(fewest, MAX_CHUNKS_FACTOR * fewest + 1):
        chunk_bytes = data.bytes // k + 1  # make_plan cuts ceil(bytes / chunk_bytes) = k
        plan = make_plan(digest, chunk_bytes)
        per_node = np.zeros((plan.n_chunks, len(NODES)))
        np.add.at(per_node, (plan.chunk_of, owner_of), sizes)
        demand = DatasetDemand(DATASET, data.bytes, max(plan.chunk_bytes),
                               (JobBenefit(1, None, None),), plan.n_chunks)
        depth = resident_chunks([demand], {DATASET: CacheMode.COOP},
                                node_cache * len(NODES))[DATASET]
        window = sum(np.roll(per_node, -j, axis=0) for j in range(depth))  # c to c + K - 1
        worst = float(window.max())
        if worst <= CHUNK_HEADROOM * node_cache:
            return chunk_bytes, {
                "chunk_bytes": chunk_bytes, "chunks": plan.n_chunks, "resident_chunks": depth,
                "largest_chunk_bytes": max(plan.chunk_bytes),
                "largest_window_share_of_node_cache": round(worst / node_cache, 3)}
    raise RuntimeError(f"no plan of {fewest} to {MAX_CHUNKS_FACTOR * fewest} chunks leaves "
                       f"room for their cycle in {node_cache}-byte caches: use more items")


# -- the parent: one mode --------------------------------------------------------------
@dataclasses.dataclass
class ModeRun:
    """What one mode measured: its report and each job's epoch orders (the manifests'
    paths for ``sub``)."""

    report: dict[str, Any]
    orders: list[list[list[str]]]  # job -> epoch -> paths in the order read


def _epochs(jobs: list[JobProcess], n_epochs: int, proxy: ThrottleProxy,
            counters: Callable[[], dict[str, Any]],
            first: int = 0) -> tuple[list[dict[str, Any]], list[list[list[str]]]]:
    """Run the jobs epoch by epoch (numbered from ``first``); a record per epoch, and
    each job's orders. ``counters``: the nodes' (Cluster.counters), or none (``dict``)."""
    records: list[dict[str, Any]] = []
    orders: list[list[list[str]]] = [[] for _ in jobs]
    for epoch in range(first, first + n_epochs):
        before, proxy_before = counters(), proxy.bytes_down
        start_wall = time.time()
        replies, seconds = run_epoch(jobs, EPOCH_TIMEOUT)
        after = counters()
        record = {
            "epoch": epoch, "start": start_wall, "seconds": round(seconds, 2),
            "items": sum(len(r["paths"]) for r in replies),
            "job_seconds": [round(r["seconds"], 2) for r in replies],
            "job_hits": [r["hits"] for r in replies],
            "bytes_read": sum(r["bytes"] for r in replies),
            "proxy_bytes": proxy.bytes_down - proxy_before,
            **{k: after[k] - before[k] for k in after if k != "bucket_fetch_causes"}}
        if "bucket_fetch_causes" in after:
            record["bucket_fetch_causes"] = fetch_causes.since(before["bucket_fetch_causes"],
                                                               after["bucket_fetch_causes"])
        records.append(record)
        for j, reply in enumerate(replies):
            orders[j].append(reply["paths"])
        log.info("%s epoch %d: %.1f s, %d items, %d bytes from the bucket", jobs[0].spec.mode,
                 epoch, seconds, records[-1]["items"], records[-1]["proxy_bytes"])
    return records, orders


def _steady(records: list[dict[str, Any]], warmup: int, dataset_bytes: int) -> dict[str, Any]:
    """Rates over the epochs after the warm-up."""
    steady = records[warmup:]
    n = len(steady)
    items = sum(e["items"] for e in steady)
    out: dict[str, Any] = {
        "epochs": n, "items_per_s": items / sum(e["seconds"] for e in steady),
        "bucket_bytes_ratio": sum(e["proxy_bytes"] for e in steady) / n / dataset_bytes}
    if "bucket_bytes" in steady[0]:
        out["mountd_bucket_bytes_ratio"] = (sum(e["bucket_bytes"] for e in steady) / n
                                            / dataset_bytes)
        reads = sum(e["local_hits"] + e["peer_hits"] + e["misses"] for e in steady)
        out["read_hit_ratio"] = (sum(e["local_hits"] + e["peer_hits"] for e in steady) / reads
                                 if reads else None)
        out["bucket_fetch_causes"] = fetch_causes.total(e["bucket_fetch_causes"]
                                                        for e in steady)
    if steady[0]["job_hits"][0] is not None:
        out["manifest_hit_ratio"] = sum(sum(e["job_hits"]) for e in steady) / items
    return out


def run_mode(mode: str, data: Dataset, proxy: ThrottleProxy, size: Size, workdir: str,
             node_cache: int, chunk_bytes: int) -> ModeRun:
    """The jobs of ``mode``, spread round-robin over the nodes (no nodes for direct)."""
    base = os.path.join(workdir, mode)
    os.makedirs(base, exist_ok=True)
    n_epochs = size.epochs_direct if mode == "direct" else size.epochs_cached
    # other work on the machine skews the rates: note how busy it was
    report: dict[str, Any] = {"mode": mode, "jobs": size.jobs,
                              "load_average_before": os.getloadavg()[0]}

    def running(sources: list[str]) -> contextlib.AbstractContextManager[list[JobProcess]]:
        specs = {f"{i}-{mode}": JobSpec(mode, sources[i % len(sources)], seed=i,
                                        batch_size=size.batch_size, compute_s=size.compute_s,
                                        epochs=n_epochs) for i in range(size.jobs)}
        return running_jobs(reading_job.__name__, specs, base, EPOCH_TIMEOUT)

    log.info("%s: %d jobs, %d epochs", mode, size.jobs, n_epochs)
    if mode == "direct":
        with running([bucket_address(proxy.url, BUCKET, DATASET)]) as jobs:
            records, orders = _epochs(jobs, n_epochs, proxy, dict)  # no nodes to count
            for job in jobs:
                job.finish(JOB_STOP_TIMEOUT)
        report.update(epochs=records, steady=_steady(records, 0, data.bytes),
                      load_average_after=os.getloadavg()[0])
        return ModeRun(report, orders)

    with running_cluster(base, data, node_cache, chunk_bytes, proxy.url) as cluster:
        roots = [os.path.join(cluster.nodes[n].root, DATASET) for n in NODES]
        with running(roots) as jobs, TimelineRecorder(cluster) as recorder:
            report["jobs_on"] = [NODES[i % len(NODES)] for i in range(size.jobs)]
            records, orders = _epochs(jobs, n_epochs, proxy, cluster.counters)
            statuses = {n: m.status() for n, m in cluster.nodes.items()}
            report["nodes"] = {n: st["cache"] for n, st in statuses.items()}
            report["bucket_fetch_causes"] = {n: fetch_causes.of_dataset(st, DATASET)
                                             for n, st in statuses.items()}
            report["node_jobs"] = {n: [{k: v for k, v in j.items() if k != "chunks"}
                                       for j in st["jobs"]] for n, st in statuses.items()}
            for job in jobs:
                job.finish(JOB_STOP_TIMEOUT)
    for name in NODES:
        shutil.rmtree(os.path.join(base, f"{name}-cache"), ignore_errors=True)
    report.update(epochs=records, steady=_steady(records, 1, data.bytes),
                  load_average_after=os.getloadavg()[0])
    if mode == "sub":
        timeline = recorder.timeline()
        report.update(max_resident_coordinator=recorder.max_resident,
                      max_resident_timeline=max_resident_from(timeline),
                      allocation=[list(m) for m in recorder.modes],
                      timeline=[list(e) for e in timeline])
    return ModeRun(report, orders)


# -- the benchmark ---------------------------------------------------------------------
@dataclasses.dataclass
class Measurement:
    """The report, and what a test checks it against."""

    report: dict[str, Any]
    orders: dict[str, list[list[list[str]]]]  # mode -> job -> epoch -> paths
    paths: list[str]  # the dataset's paths (every job's shard: world size 1)


def _goals(summary: dict[str, Any]) -> dict[str, bool]:
    return {k: (summary[k] <= bound if op == "<=" else summary[k] >= bound)
            for k, (op, bound) in GOALS.items()}


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The dataset uploaded, behind the proxy, and the nodes' cache and chunk sizes."""

    data: Dataset
    proxy: ThrottleProxy
    upload_s: float
    node_cache: int
    chunk_bytes: int
    chunking: dict[str, Any]


@contextlib.contextmanager
def uploaded(size: Size, workdir: str) -> Iterator[Bucket]:
    """The synthetic dataset of ``size`` in the GCS emulator, behind a proxy capped at
    its bucket rate."""
    with running_emulator(concurrent=True) as emulator:
        emulator.create_bucket(BUCKET)
        started = time.monotonic()
        data = upload_synthetic(emulator.host, BUCKET, DATASET, workdir, size.items,
                                size.classes, seed=7, mean_size=size.mean_item_bytes)
        upload_s = time.monotonic() - started
        node_cache = int(CACHE_FRACTION * data.bytes / len(NODES))
        chunk_bytes, chunking = choose_chunk_bytes(data, node_cache)
        with throttled(emulator.host, size.bucket_rate) as proxy:
            yield Bucket(data, proxy, upload_s, node_cache, chunk_bytes, chunking)


def _settings(size: Size) -> dict[str, Any]:
    return {**dataclasses.asdict(size), "nodes": len(NODES), "cache_fraction": CACHE_FRACTION,
            "readers_per_job": READERS, "prefetch_batches": PREFETCH_BATCHES,
            "heartbeat_timeout_s": HEARTBEAT_TIMEOUT, "probe_batches": PROBE_BATCHES,
            "force_evict_after_s": FORCE_EVICT_AFTER}


def measure(size: Size, workdir: str) -> Measurement:
    """Upload the dataset, run every mode, and summarize."""
    runs: dict[str, ModeRun] = {}
    with uploaded(size, workdir) as bucket:
        data, upload_s, node_cache = bucket.data, bucket.upload_s, bucket.node_cache
        chunking = bucket.chunking
        for mode in MODES:
            with BackgroundCpu() as background:
                runs[mode] = run_mode(mode, data, bucket.proxy, size, workdir, node_cache,
                                      bucket.chunk_bytes)
            # CPUs kept busy meanwhile by other sessions' work and the GCS emulator
            runs[mode].report["background_cpu_cores"] = round(background.cores, 2)
    steady = {mode: r.report["steady"] for mode, r in runs.items()}
    sub = runs["sub"].report
    expected = sorted(data.paths)
    summary = {
        "bucket_bytes_ratio": round(steady["sub"]["bucket_bytes_ratio"], 3),
        "speedup_vs_direct": round(steady["sub"]["items_per_s"]
                                   / steady["direct"]["items_per_s"], 2),
        "speedup_vs_lru": round(steady["sub"]["items_per_s"] / steady["lru"]["items_per_s"], 2),
        "max_resident_chunks": sub["max_resident_coordinator"],
        "max_resident_chunks_timeline": sub["max_resident_timeline"],
        "resident_chunk_limit": chunking["resident_chunks"],
        **{f"items_per_s_{mode}": round(s["items_per_s"], 1) for mode, s in steady.items()},
        **{f"bucket_bytes_ratio_{mode}": round(s["bucket_bytes_ratio"], 3)
           for mode, s in steady.items() if mode != "sub"},
        "hit_ratio_sub": round(steady["sub"]["manifest_hit_ratio"], 4),
        "bucket_fetch_causes": steady["sub"]["bucket_fetch_causes"],
        "exactly_once": all(sorted(paths) == expected for r in runs.values()
                            for job in r.orders for paths in job),
    }
    summary["goals_met"] = _goals(summary)
    report = {
        "dataset": {"items": len(data.paths), "bytes": data.bytes,
                    "upload_seconds": round(upload_s, 1)},
        "cache": {"node_cache_bytes": node_cache, **chunking},
        "settings": _settings(size),
        "definitions": {
            "bucket_bytes_ratio": "bytes through the bucket's proxy (HTTP included) per "
                                  "steady-state epoch of all jobs / dataset bytes "
                                  "(mountd_bucket_bytes_ratio: the nodes' own count)",
            "items_per_s": "items read by all jobs / wall seconds, steady-state epochs "
                           "(epochs after the first with a cache, every epoch direct)",
            "speedup_vs_direct": "items_per_s of sub / of direct (GCS client, same proxy)",
            "speedup_vs_lru": "items_per_s of sub / of lru (exact reads, each job's own "
                              "permutation, through the same nodes)",
            "max_resident_chunks": "the coordinator's cycle max_resident (_timeline: "
                                   "replayed from its chunk-state events)",
            "resident_chunk_limit": "K: the chunks the coordinator allots the dataset "
                                    "(all caches less 20% headroom, in whole chunks)",
            "bucket_fetch_causes": "mountd's bucket fetches of the dataset by cause, "
                                   "{cause: {fetches, bytes}}: in the summary and a mode's "
                                   "steady, sub's steady-state epochs summed over the nodes; "
                                   "per epoch in epochs; per node for the whole run in the "
                                   "mode's report",
            "goals": {k: f"{op} {bound}" for k, (op, bound) in GOALS.items()}},
        "modes": {mode: r.report for mode, r in runs.items()},
        "summary": summary,
    }
    return Measurement(report, {mode: r.orders for mode, r in runs.items()}, expected)


# -- --kill-coordinator ----------------------------------------------------------------
FAILOVER_EPOCHS = 3  # a warm-up, an epoch without the kill, and the epoch of the kill
MAX_FAILOVER_S = 10.0  # the bound at the defaults; also at most 2 lease TTLs
FAILOVER_GOALS = {"speedup_failover_ratio": (">=", 0.9),
                  "bucket_bytes_ratio_failover": ("<=", 1.15)}


def _generation(status: dict[str, Any]) -> int:
    """The dataset's chunk-cycle generation in a leader's status."""
    return next(int(ds["generation"]) for ds in status["datasets"] if ds["name"] == DATASET)


class LeaderKill:
    """SIGKILLs the leading coordinator ``after`` seconds from ``start`` (in a thread),
    then waits for the other to lead, noting the cycle's generation on both sides."""

    def __init__(self, cluster: Cluster, after: float) -> None:
        self.cluster = cluster
        self.ha = cluster.ha
        self.leader = self.ha.leader()
        self.noted: dict[str, Any] = {}
        self.failed: BaseException | None = None
        self._timer = threading.Timer(after, self._kill)

    def __enter__(self) -> LeaderKill:
        self._timer.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is not None:
            self._timer.cancel()  # the epoch failed: no kill to measure
        self._timer.join()
        if self.failed is not None:
            raise RuntimeError(f"killing the leader failed: {self.failed!r}")

    def _kill(self) -> None:
        try:
            self.noted["generation_at_kill"] = _generation(self.ha.status(self.leader))
            self.noted["killed"] = self.ha.kill(self.leader)
            new = self.ha.wait_for_leader(other_than=self.leader)
            status = self.ha.status(new)
            self.noted["generation_after_takeover"] = _generation(status)
            self.noted["takeover"] = status["coordinator"]["last_takeover"]
            self.noted["lease_ttl_s"] = status["coordinator"]["lease_ttl"]
            self.cluster.coordinator = new
        except BaseException as exc:  # raised in the parent by __exit__
            self.failed = exc


def _etcd_writes(cluster: Cluster) -> dict[str, int]:
    """The leading coordinator's state writes to etcd so far."""
    entry = cluster.ha.status(cluster.ha.leader())["coordinator"]
    return {k: int(entry[k]) for k in ("etcd_writes", "etcd_keys_written",
                                        "etcd_bytes_written")}


def _switches(cluster: Cluster, address: str) -> dict[str, float]:
    """When each node took its first answer from the coordinator at ``address``
    (wall-clock), once every node follows it."""
    deadline = time.monotonic() + MEMBERSHIP_TIMEOUT
    while True:
        followed = {n: m.status()["cluster"]["coordinators"] for n, m in cluster.nodes.items()}
        if all(f["in_use"] == address for f in followed.values()):
            return {n: float(f["last_switch"]) for n, f in followed.items()}
        if time.monotonic() > deadline:
            raise RuntimeError(f"the nodes did not all follow {address} within "
                               f"{MEMBERSHIP_TIMEOUT:.0f} s: {followed}")
        time.sleep(0.1)


def measure_failover(size: Size, workdir: str) -> Measurement:
    """The sub jobs on a cluster whose coordinator is two on etcd: a warm-up epoch, an
    epoch without a failure, and the same epoch with the leader SIGKILLed half-way
    through it (by the first epoch's time)."""
    with uploaded(size, workdir) as bucket, BackgroundCpu() as background:
        data = bucket.data
        base = os.path.join(workdir, "failover")
        os.makedirs(base, exist_ok=True)
        load_before = os.getloadavg()[0]
        with running_cluster(base, data, bucket.node_cache, bucket.chunk_bytes,
                             bucket.proxy.url, ha=True) as cluster:
            roots = [os.path.join(cluster.nodes[n].root, DATASET) for n in NODES]
            specs = {f"{i}-sub": JobSpec("sub", roots[i % len(roots)], seed=i,
                                         batch_size=size.batch_size, compute_s=size.compute_s,
                                         epochs=FAILOVER_EPOCHS) for i in range(size.jobs)}
            with running_jobs(reading_job.__name__, specs, base, EPOCH_TIMEOUT) as jobs, \
                    TimelineRecorder(cluster) as recorder:
                records, orders = _epochs(jobs, FAILOVER_EPOCHS - 2, bucket.proxy,
                                          cluster.counters)
                writes_before = _etcd_writes(cluster)
                calm_records, calm_orders = _epochs(jobs, 1, bucket.proxy, cluster.counters,
                                                    first=FAILOVER_EPOCHS - 2)
                writes = {k: v - writes_before[k] for k, v in _etcd_writes(cluster).items()}
                records += calm_records
                orders = [o + c for o, c in zip(orders, calm_orders)]
                calm = records[-1]
                with LeaderKill(cluster, calm["seconds"] / 2) as kill:
                    last, last_orders = _epochs(jobs, 1, bucket.proxy, cluster.counters,
                                                first=FAILOVER_EPOCHS - 1)
                if kill.noted["killed"] >= last[0]["start"] + last[0]["seconds"]:
                    raise RuntimeError("the epoch ended before the leader was killed")
                switched = _switches(cluster, cluster.coordinator.address)
                for job in jobs:
                    job.finish(JOB_STOP_TIMEOUT)
    noted = kill.noted
    killed = noted["killed"]
    failed = last[0]
    expected = sorted(data.paths)
    summary = {
        "failover_s": round(min(switched.values()) - killed, 2),
        "failover_s_last_node": round(max(switched.values()) - killed, 2),
        "takeover_s": round(noted["takeover"] - killed, 2),
        "lease_ttl_s": noted["lease_ttl_s"],
        "speedup_failover_ratio": round(calm["seconds"] / failed["seconds"], 3),
        "items_per_s_calm": round(calm["items"] / calm["seconds"], 1),
        "items_per_s_failover": round(failed["items"] / failed["seconds"], 1),
        "bucket_bytes_ratio_calm": round(calm["proxy_bytes"] / data.bytes, 3),
        "bucket_bytes_ratio_failover": round(failed["proxy_bytes"] / data.bytes, 3),
        "generation_at_kill": noted["generation_at_kill"],
        "generation_after_takeover": noted["generation_after_takeover"],
        "etcd_writes_per_s_calm": round(writes["etcd_writes"] / calm["seconds"], 2),
        "etcd_keys_written_per_s_calm": round(writes["etcd_keys_written"] / calm["seconds"],
                                              2),
        "etcd_bytes_written_per_s_calm": round(writes["etcd_bytes_written"] / calm["seconds"]),
        "exactly_once": all(sorted(paths) == expected
                            for job in (*orders, *last_orders) for paths in job),
    }
    goals = {k: (summary[k] <= bound if op == "<=" else summary[k] >= bound)
             for k, (op, bound) in FAILOVER_GOALS.items()}
    goals["failover_s"] = summary["failover_s"] <= min(2 * summary["lease_ttl_s"],
                                                       MAX_FAILOVER_S)
    goals["cycle_kept"] = (summary["generation_after_takeover"]
                           >= summary["generation_at_kill"])
    goals["exactly_once"] = summary["exactly_once"]
    summary["goals_met"] = goals
    report = {
        "dataset": {"items": len(data.paths), "bytes": data.bytes,
                    "upload_seconds": round(bucket.upload_s, 1)},
        "cache": {"node_cache_bytes": bucket.node_cache, **bucket.chunking},
        "settings": {**_settings(size), "epochs": FAILOVER_EPOCHS, "coordinators": 2},
        "definitions": {
            "failover_s": "from the leader's SIGKILL to the first heartbeat the new leader "
                          "answered (the earliest of the nodes' switches to it; "
                          "_last_node: the latest); takeover_s: to its leading",
            "speedup_failover_ratio": "items/s of the epoch with the kill / of the epoch "
                                      "before it, without (the same jobs, sub)",
            "bucket_bytes_ratio_failover": "bytes through the bucket's proxy in the epoch "
                                           "of the kill / dataset bytes (_calm: the epoch "
                                           "before)",
            "etcd_writes_per_s_calm": "the leader's state transactions in etcd a second "
                                      "over the epoch without the kill (_keys_written: "
                                      "keys put or deleted by them; _bytes_written: the "
                                      "bytes of the values put)",
            "generation_at_kill": "the chunk cycle's generation at the killed leader just "
                                  "before the kill; _after_takeover: at the new leader "
                                  "when it first led (goals: cycle_kept, not lower)",
            "goals": {**{k: f"{op} {bound}" for k, (op, bound) in FAILOVER_GOALS.items()},
                      "failover_s": f"<= 2 x lease_ttl_s and <= {MAX_FAILOVER_S:g}"}},
        "epochs": [*records, *last],
        "switches": {n: round(t - killed, 2) for n, t in switched.items()},
        "timeline": [list(e) for e in recorder.timeline()],
        "load_average": [load_before, os.getloadavg()[0]],
        "background_cpu_cores": round(background.cores, 2),
        "summary": summary,
    }
    return Measurement(report, {"sub": [o + lo for o, lo in zip(orders, last_orders)]},
                       expected)


STATE_COLORS = {"loading": "tab:orange", "active": "tab:green", "marked": "tab:red"}


def plot_timeline(report: dict[str, Any], out: str) -> None:
    """Which chunks are resident over time (x: seconds, y: chunk), like Figure 7 of the
    paper: a bar per chunk state, the epoch boundaries of the sub run as dashed lines."""
    from matplotlib.patches import Patch

    plt = figures.pyplot()
    sub = report["modes"]["sub"]
    chunks = report["cache"]["chunks"]
    t0 = sub["epochs"][0]["start"]
    end = sub["epochs"][-1]["start"] + sub["epochs"][-1]["seconds"] - t0
    spans: dict[str, list[tuple[int, float, float]]] = {s: [] for s in STATE_COLORS}
    since: dict[int, tuple[float, str]] = {}
    for t, chunk, state in sub["timeline"]:
        if chunk in since and since[chunk][1] in spans:
            began, old = since[chunk]
            spans[old].append((chunk, began - t0, t - began))
        since[chunk] = (t, state)
    for chunk, (began, state) in since.items():
        if state in spans:
            spans[state].append((chunk, began - t0, max(0.0, end - (began - t0))))
    fig, ax = plt.subplots(figsize=(10, 0.35 * chunks + 2))
    for state, bars in spans.items():
        for chunk, start, width in bars:
            ax.broken_barh([(start, width)], (chunk - 0.4, 0.8), color=STATE_COLORS[state])
    for e in sub["epochs"][1:]:
        ax.axvline(e["start"] - t0, color="grey", linestyle="--", linewidth=0.8)
    s = report["summary"]
    ax.set_title(f"{sub['jobs']} jobs on {len(NODES)} nodes, cache {CACHE_FRACTION:.0%} of "
                 f"the dataset, {chunks} chunks: at most {s['max_resident_chunks']} "
                 f"resident; bucket bytes/epoch {s['bucket_bytes_ratio']:.2f}x the dataset",
                 fontsize=9)
    ax.set_xlabel("seconds since the first epoch began (dashed: epoch boundaries)")
    ax.set_ylabel("chunk")
    ax.set_yticks(range(chunks))
    ax.set_xlim(0, end)
    ax.legend(handles=[Patch(color=c, label=st) for st, c in STATE_COLORS.items()],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    figures.save(fig, out)


def run(quick: bool, workdir: str, plot: str | None = None, size: str | None = None,
        kill_coordinator: bool = False) -> dict:
    """The benchmark; ``size`` ("full", "quick", "tiny") overrides ``quick``; ``plot``
    names a PNG to draw the chunk timeline in; ``kill_coordinator``: the sub jobs alone,
    on two coordinators whose leader is killed in an epoch (measure_failover)."""
    name = size or ("quick" if quick else "full")
    if kill_coordinator:
        if plot:
            raise QuietError("--plot: the cluster benchmark draws no figure with "
                             "--kill-coordinator; leave one of them out", ExitCode.USAGE)
        if not etcd_available():
            log.warning("%s: skipped", ETCD_MISSING)
            return {"summary": {"skipped": ETCD_MISSING}}
        report = measure_failover(SIZES[name], workdir).report
        report["size"] = name
        return report
    report = measure(SIZES[name], workdir).report
    report["size"] = name
    if plot:
        plot_timeline(report, plot)
    return report

"""``quiver bench loader``: chunk loads across loader processes, and what they cost the
reads mountd serves meanwhile.

For 1 and for 2 loader processes (``--loader-processes``):

- **throughput**: a fresh mountd, a substitutable job on dataset ``loads`` (bigger than
  the cache, so it is cached in chunks) whose first manifest starts the chunk loads that
  fill its K resident chunks. Chunk-load objects/s is the rate of the dataset's
  ``chunk_load`` fetches, polled every POLL_S from the first to the last;
- **latency**: another fresh mountd caches dataset ``hits`` by reading its files once,
  reads them IDLE_PASSES times more (one reader process, each file's pages dropped
  after its read) for the *idle* open-to-last-byte times, then starts the same chunk
  loads and reads ``hits`` the same way while they run: the times *during a chunk
  load*.

The bucket is the GCS emulator serving requests concurrently over kept-alive
connections (``running_emulator(concurrent=True)``: as shipped it serves one request at
a time, which caps any number of processes at its rate), behind the throttle proxy,
which holds the first byte of every response for ``latency_ms`` (default 30 ms, GCS's
time to first byte) and caps nothing. Both run on this machine, so their CPU is part of
what the loader processes share the two cores with (the emulator at a lower priority,
as a bucket elsewhere takes none); ``cpu_ms_per_object`` says who spent what.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import multiprocessing
import os
import random
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event as EventType
from typing import Any

import numpy as np

from quiverfs.bench.bucket_dataset import Dataset, upload_synthetic
from quiverfs.bench.cpu_time import machine_busy_seconds, process_cpu_seconds
from quiverfs.bench.emulator import running_emulator
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench.reading_job import read_dropping_pages
from quiverfs.bench.throttle_proxy import UNCAPPED, throttled
from quiverfs.counters import ReadCounter

PROCESSES = (1, 2)
LATENCY_MS = 30.0  # the bucket's time to first byte, as GCS's
ITEM_BYTES = 25_000  # mean item size: small objects, where a request's CPU dominates
# (hits items, loads items) at each size
SIZES = {"full": (500, 20_000), "quick": (200, 2_400), "tiny": (60, 600)}
CACHE_OF_LOADS = 0.5  # cache bytes / the loads dataset's bytes
HITS_IN_CACHE = 8  # cache bytes / the hits dataset's bytes, at least
IDLE_PASSES = 6  # over the cached files, for the idle latencies
POLL_S = 0.05  # seconds between status polls while the chunks load
SETTLE_TIMEOUT = 120.0  # seconds the first chunk loads may take
# The bucket is a process of this machine here, but not in production: it yields the
# cores to the processes under test.
EMULATOR_NICENESS = 10
GOALS = {"scaling_2_vs_1": 1.7, **{f"p99_during_load_vs_idle_{p}": 2.0 for p in PROCESSES}}


def _read_pass(paths: list[str], stop: EventType) -> list[float]:
    """Seconds per file, reading ``paths`` in turn until ``stop`` is set."""
    times = []
    for path in paths:
        if stop.is_set():
            break
        started = time.perf_counter()
        read_dropping_pages(path)
        times.append(time.perf_counter() - started)
    return times


def _timed_reads(paths: list[str], passes: int, stop: EventType, out: Connection) -> None:
    """A reader process: ``passes`` passes over ``paths`` (0: until ``stop``); sends the
    seconds per file. A process of its own, so that no thread of the benchmark's (the
    status polls) holds its GIL while it times a read."""
    out.send("ready")
    times: list[float] = []
    done = 0
    while not stop.is_set() and (passes == 0 or done < passes):
        times.extend(_read_pass(paths, stop))
        done += 1
    out.send(times)


@contextlib.contextmanager
def _reader(paths: list[str], passes: int = 0) -> Iterator[list[float]]:
    """Time reads of ``paths`` in a reader process while the block runs (``passes``: as
    many as that, then it waits); the list holds the times once the block has ended."""
    context = multiprocessing.get_context("spawn")
    stop = context.Event()
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_timed_reads, args=(paths, passes, stop, send),
                              name="timed reads")
    times: list[float] = []
    process.start()
    try:
        if receive.recv() != "ready":  # imported and about to read
            raise RuntimeError("the reader process did not start")
        yield times
    finally:
        if passes == 0:
            stop.set()
        times.extend(receive.recv())
        process.join()


def _percentiles(times: list[float]) -> dict[str, Any]:
    ms = np.array(times) * 1e3
    return {"reads": len(times), "p50_ms": round(float(np.percentile(ms, 50)), 3),
            "p99_ms": round(float(np.percentile(ms, 99)), 3),
            "max_ms": round(float(ms.max()), 3)}


def _counters(m: MountdProcess, name: str) -> collections.Counter[str]:
    return collections.Counter(next(d["counters"] for d in m.status()["datasets"]
                                    if d["name"] == name))


def _chunk_loads(m: MountdProcess, name: str) -> tuple[int, list[str]]:
    """The dataset's chunk-load fetches so far, and its job's chunk states."""
    status = m.status()
    fetched = next(d["bucket_fetch_causes"] for d in status["datasets"] if d["name"] == name)
    jobs = [j for j in status["jobs"] if j["dataset"] == name and j.get("chunks")]
    return fetched["chunk_load"]["fetches"], jobs[0]["chunks"]["states"] if jobs else []


def _loader_cpu(mountd_pid: int) -> float:
    """CPU seconds of mountd's loader processes (its children running one)."""
    total = 0.0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii") as f:
                ppid = next(int(line.split()[1]) for line in f if line.startswith("PPid:"))
            if ppid != mountd_pid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"mountd.fetch.loader_process" in f.read():
                    total += process_cpu_seconds(int(entry))
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited since the listing
    return total


@dataclasses.dataclass(frozen=True)
class Bucket:
    """Where mountd reads the bucket (the proxy), and the emulator's pid."""

    endpoint: str
    emulator_pid: int


def _cpu(m: MountdProcess, bucket: Bucket) -> dict[str, float]:
    return {"mountd": process_cpu_seconds(m.proc.pid), "loaders": _loader_cpu(m.proc.pid),
            "emulator": process_cpu_seconds(bucket.emulator_pid),
            "machine": machine_busy_seconds()}


def _mount(m: MountdProcess, bucket: Bucket, name: str, ds: Dataset) -> None:
    """Mount ``ds`` as ``name`` and wait for the loader processes the mount starts (a
    daemon's start long before a job's; here they would share the loads' cores)."""
    m.call({"op": "mount", "name": name, "digest": ds.digest, "emulator_host": bucket.endpoint})
    m.wait_for_loaders()


def _load_chunks(m: MountdProcess, bucket: Bucket) -> dict[str, Any]:
    """Start a job on the mounted ``loads`` and wait until its first chunks are loaded:
    the rate of its chunk-load fetches, and the CPU each process spent per object."""
    from quiverfs.torch import QuiverBatchSampler  # here: a reader process need not import torch

    before = _cpu(m, bucket)
    job = QuiverBatchSampler(os.path.join(m.root, "loads"), 16, seed=1)
    samples: list[tuple[float, int]] = []
    try:
        job.manifest(0)
        deadline = time.monotonic() + SETTLE_TIMEOUT
        while True:
            fetched, states = _chunk_loads(m, "loads")
            samples.append((time.perf_counter(), fetched))
            if states and "loading" not in states:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the chunk loads did not end within "
                                   f"{SETTLE_TIMEOUT:.0f} s")
            time.sleep(POLL_S)
        spent = _cpu(m, bucket)
    finally:
        job.close()
    loading = [(t, n) for t, n in samples if n > 0]
    if not loading:
        raise RuntimeError("the job's chunks loaded nothing from the bucket")
    (started, first), (ended, fetched) = loading[0], loading[-1]
    return {"chunk_load_objects": fetched,
            "loader_process_fetches":
                _counters(m, "loads")[ReadCounter.LOADER_PROCESS_FETCHES],
            "load_seconds": round(ended - started, 2),
            "objects_per_s": round((fetched - first) / (ended - started), 1)
            if ended > started else None,
            "cpu_ms_per_object": {k: round((spent[k] - before[k]) * 1e3 / max(1, fetched), 3)
                                  for k in before}}


def _throughput(processes: int, bucket: Bucket, loads: Dataset, cache: int,
                workdir: str) -> dict[str, Any]:
    """Chunk-load objects/s with ``processes`` loader processes, nothing else running."""
    with running_mountd(workdir, cache_size=str(cache), name=f"load{processes}",
                        extra_args=("--loader-processes", str(processes),
                                    "--probe-batches", "0")) as m:
        _mount(m, bucket, "loads", loads)
        return _load_chunks(m, bucket)


def _latency(processes: int, bucket: Bucket, hits: Dataset, loads: Dataset, cache: int,
             workdir: str) -> dict[str, Any]:
    """Read latencies of cached files idle, then while chunks load."""
    with running_mountd(workdir, cache_size=str(cache), name=f"read{processes}",
                        extra_args=("--loader-processes", str(processes),
                                    "--probe-batches", "0")) as m:
        _mount(m, bucket, "hits", hits)
        _mount(m, bucket, "loads", loads)
        paths = [os.path.join(m.root, "hits", p) for p in hits.paths]
        random.Random(0).shuffle(paths)
        for path in paths:
            read_dropping_pages(path)  # fills the store
        with _reader(paths, passes=IDLE_PASSES) as idle:
            pass
        misses = _counters(m, "hits")[ReadCounter.MISSES]
        with _reader(paths) as during:
            load = _load_chunks(m, bucket)
        misses = _counters(m, "hits")[ReadCounter.MISSES] - misses
    return {"idle": _percentiles(idle), "during_load": _percentiles(during),
            "load_objects_per_s": load["objects_per_s"],
            # a cached file culled by the loads would be read from the bucket
            "hits_misses_during_load": misses}


def run(quick: bool, workdir: str, latency_ms: float = LATENCY_MS,
        size: str | None = None) -> dict[str, Any]:
    """Both phases for each number of loader processes, with a bucket whose responses
    wait ``latency_ms`` for their first byte (``size``: one of SIZES; the tests' is
    "tiny")."""
    n_hits, n_loads = SIZES[size or ("quick" if quick else "full")]
    with running_emulator(concurrent=True, niceness=EMULATOR_NICENESS) as emu:
        emu.create_bucket("bench")
        hits = upload_synthetic(emu.host, "bench", "hits", workdir, n_hits, 10, seed=1,
                                mean_size=ITEM_BYTES)
        loads = upload_synthetic(emu.host, "bench", "loads", workdir, n_loads, 10, seed=2,
                                 mean_size=ITEM_BYTES)
        # K chunks of an eighth of the cache take up to 80% of it: the rest holds hits
        cache = max(int(CACHE_OF_LOADS * loads.bytes), HITS_IN_CACHE * hits.bytes)
        with throttled(emu.host, UNCAPPED, latency=latency_ms / 1000) as proxy:
            bucket = Bucket(proxy.url, emu.process.pid)
            runs = [{"loader_processes": p, **_throughput(p, bucket, loads, cache, workdir),
                     "reads": _latency(p, bucket, hits, loads, cache, workdir)}
                    for p in PROCESSES]
    by = {r["loader_processes"]: r for r in runs}
    summary: dict[str, Any] = {f"objects_per_s_{p}": by[p]["objects_per_s"] for p in PROCESSES}
    summary["scaling_2_vs_1"] = round(by[2]["objects_per_s"] / by[1]["objects_per_s"], 3)
    for p in PROCESSES:
        idle, during = by[p]["reads"]["idle"]["p99_ms"], by[p]["reads"]["during_load"]["p99_ms"]
        summary[f"read_p99_idle_ms_{p}"] = idle
        summary[f"read_p99_during_load_ms_{p}"] = during
        summary[f"p99_during_load_vs_idle_{p}"] = round(during / idle, 3)
    return {"summary": summary, "goals": GOALS, "runs": runs,
            "settings": {"latency_ms": latency_ms, "item_bytes": ITEM_BYTES,
                         "poll_s": POLL_S, "idle_passes": IDLE_PASSES,
                         "emulator_niceness": EMULATOR_NICENESS},
            "dataset": {"hits": {"items": n_hits, "bytes": hits.bytes},
                        "loads": {"items": n_loads, "bytes": loads.bytes},
                        "cache_bytes": cache}}

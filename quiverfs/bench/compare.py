"""``quiver bench compare``: Quiver beside what users would pick instead, on one capped bucket.

A synthetic ImageFolder dataset sits in the GCS emulator behind one bandwidth-capped
proxy (``throttle_proxy``) that every configuration reads through, so the "bucket" is
shared and slower than a local cache, and the proxy counts the bytes it serves. k jobs
(separate processes, running concurrently) each train for E epochs with torchvision's
``ImageFolder`` and a ``DataLoader`` with worker processes, sleeping a simulated compute
time per batch. Five ways to read:

- ``direct``: no cache; a Dataset whose ``__getitem__`` downloads the object with the
  google-cloud-storage client;
- ``rclone``: ``rclone mount`` of the bucket (GCS backend, ``--vfs-cache-mode full``,
  ``--vfs-cache-max-size`` = the cache budget), a plain ImageFolder over it;
- ``exact``: a plain ImageFolder over a ``quiver mountd`` mount (its LRU store of the
  budget size);
- ``sub``: the same mount with ``quiverfs.torch.QuiverBatchSampler``;
- ``view``: a plain ImageFolder over a ``--view substitutable`` mount of the dataset,
  each job its own ``QUIVER_JOB``: substitution without the sampler.

Cache budgets are 10%, 50% and 100% of the dataset, with 1 and with 4 jobs (``view``:
10% with the most jobs only, beside ``sub``'s summary configuration). The parent
holds the jobs at every epoch boundary to read the proxy's byte count, the daemon's CPU
time and mountd's hit counters and bucket fetches by cause per epoch; epoch 0 (cold
cache) is left out of the steady-state numbers. A thread samples how much the cache
holds (mountd's store volume, rclone's cache directory) for its peak.

How busy the bucket is while jobs wait: each job times how long its training loop
waits for the DataLoader's next batch (intervals of wall-clock time); the parent takes
the union of those intervals over the jobs and asks the proxy, which keeps the bytes it
sent in time bins, how many bytes went out within it. With ``latency_ms`` the proxy
also delays every response's first byte, as a cloud bucket's time to first byte does.

rclone downloads an object from the ``mediaLink`` in its metadata, not from its
configured endpoint, and the emulator builds that link from the Host header of the
request that uploaded the object. So the dataset is uploaded through the proxy: its
links then point at the proxy, and rclone's downloads pass the same cap as everyone's.

Run as ``python -m quiverfs.bench.compare`` this module is one job (the worker).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import math
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from quiverfs.bench import fetch_causes, figures
from quiverfs.bench.bucket_dataset import Dataset, upload_synthetic
from quiverfs.bench.cpu_time import own_cpu_seconds, process_cpu_seconds
from quiverfs.bench.emulator import Emulator, gcs_client, running_emulator
from quiverfs.bench.job_child import JobChild, run_epoch
from quiverfs.bench.processes import MountdProcess, running_mountd, terminate, unmount
from quiverfs.bench.reading_job import read_dropping_pages
from quiverfs.bench.throttle_proxy import ThrottleProxy, throttled
from quiverfs.counters import ReadCounter, SamplerJobCounter, ViewJobCounter
from quiverfs.job_protocol import JOB_ENV
from quiverfs.mount_point import is_mounted

log = logging.getLogger(__name__)

BUCKET = "bench"
DATASET = "syn"
MODES = ("direct", "rclone", "exact", "sub", "view")
LABELS = {"direct": "direct (no cache)", "rclone": "rclone mount", "exact": "Quiver exact",
          "sub": "Quiver substitutable", "view": "Quiver substitutable view"}
CACHED_MODES = ("rclone", "exact", "sub")  # each at every budget and job count
FRACTIONS = (0.1, 0.5, 1.0)  # cache budgets, of the dataset's bytes
VIEW_FRACTION = 0.1  # the view runs at this budget, with the most jobs only
# Benefit probing forces this many batches of misses per substitutable job in epoch 0
# (mountd's default, 100, is more than an epoch of these datasets).
PROBE_BATCHES = 5
# rclone enforces --vfs-cache-max-size only when it polls (default every minute, longer
# than an epoch here); polling every few seconds holds it to the budget.
RCLONE_POLL = "500ms"
USAGE_SAMPLE_S = 0.5  # seconds between samples of what a cache holds
CROP = 64  # pixels: every image is center-cropped to CROP x CROP before collation
START_TIMEOUT = 120.0  # seconds for a job to import torch, or to set up a configuration
EPOCH_TIMEOUT = 600.0  # seconds a job may take for one epoch
JOB_STOP_TIMEOUT = 30.0  # seconds a job may take to exit after its stdin closes
MOUNT_TIMEOUT = 30.0  # seconds for rclone's mount to appear


@dataclasses.dataclass(frozen=True)
class Size:
    """How big a run is."""

    items: int  # synthetic dataset items
    classes: int
    mean_item_bytes: int
    bucket_rate: float  # bytes/s through the proxy, all connections together
    epochs: int  # per cached configuration; epoch 0 is the warm-up
    epochs_direct: int  # without a cache every epoch counts
    batch_size: int
    compute_s: float  # simulated compute per batch (seconds)
    workers: int  # DataLoader worker processes per job
    job_counts: tuple[int, ...]  # concurrent jobs; the largest is the summary's


SIZES = {
    "full": Size(1250, 10, 25_000, 2.6e6, 2, 1, 8, 0.08, 1, (1, 4)),
    "quick": Size(625, 10, 25_000, 6e6, 2, 1, 8, 0.03, 1, (4,)),
    "tiny": Size(60, 4, 20_000, 4e6, 2, 1, 8, 0.01, 1, (1, 2)),
}


# -- the job (a separate process) ------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class JobSpec:
    """One configuration as a job runs it; sent to the job as a JSON line."""

    mode: str  # one of MODES
    source: str  # the dataset's directory in a mount; for "direct" the bucket's endpoint
    seed: int
    batch_size: int
    compute_s: float
    workers: int


def _decode(data: bytes) -> Any:
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def load_image(path: str) -> Any:
    """ImageFolder's loader, dropping the file's pages after reading: else the kernel's
    page cache, not the cache under test, would serve later epochs."""
    return _decode(read_dropping_pages(path))


class BucketImages:
    """The dataset as ImageFolder would list it, each item downloaded from the bucket
    with the google-cloud-storage client (one client per DataLoader worker)."""

    def __init__(self, endpoint: str, transform: Callable[[Any], Any]) -> None:
        self.endpoint = endpoint
        self.transform = transform
        client = gcs_client(endpoint)
        try:
            names = sorted(b.name for b in client.list_blobs(BUCKET, prefix=f"{DATASET}/"))
        finally:
            client.close()
        classes = sorted({name.split("/")[1] for name in names})
        self.samples = [(name, classes.index(name.split("/")[1])) for name in names]
        self._client: Any = None  # made in each worker process, after the fork

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if self._client is None:
            self._client = gcs_client(self.endpoint)
        name, label = self.samples[index]
        data = self._client.bucket(BUCKET).blob(name).download_as_bytes(checksum=None)
        return self.transform(_decode(data)), label


def timed_waits(batches: Iterable[Any], waits: list[tuple[float, float]]) -> Iterator[Any]:
    """``batches``, appending to ``waits`` when the loop began and stopped waiting for
    each one (wall-clock time, which the parent compares with the proxy's)."""
    it = iter(batches)
    while True:
        asked = time.time()
        batch = next(it, None)
        if batch is None:
            return
        waits.append((asked, time.time()))
        yield batch


class _Training:
    """One configuration inside a job: its dataset, DataLoader and epoch counter."""

    def __init__(self, spec: JobSpec) -> None:
        import torch
        from torchvision import datasets, transforms

        from quiverfs.torch import QuiverBatchSampler

        self.spec = spec
        self.epoch = 0
        transform = transforms.Compose([transforms.CenterCrop(CROP), transforms.PILToTensor()])
        if spec.mode == "direct":
            dataset: Any = BucketImages(spec.source, transform)
        else:  # the view, too, is a plain ImageFolder: the mount substitutes
            dataset = datasets.ImageFolder(spec.source, transform=transform, loader=load_image)
        # fork: the workers are this process's children, so RUSAGE_CHILDREN counts them
        common = {"num_workers": spec.workers, "multiprocessing_context": "fork"}
        self.sampler: QuiverBatchSampler | None = None
        if spec.mode == "sub":
            self.sampler = QuiverBatchSampler(dataset.root, spec.batch_size, seed=spec.seed,
                                              dataset=dataset)
            self.loader = torch.utils.data.DataLoader(dataset, batch_sampler=self.sampler,
                                                      **common)
        else:
            self.loader = torch.utils.data.DataLoader(
                dataset, batch_size=spec.batch_size, shuffle=True,
                generator=torch.Generator().manual_seed(spec.seed), **common)

    def run_epoch(self) -> dict[str, Any]:
        """Train one epoch; its items, seconds and CPU seconds."""
        if self.sampler is not None:
            self.sampler.set_epoch(self.epoch)
        cpu = own_cpu_seconds()
        start = time.monotonic()
        items = 0
        waits: list[tuple[float, float]] = []
        for _, labels in timed_waits(self.loader, waits):
            time.sleep(self.spec.compute_s)  # the simulated training step
            items += len(labels)
        record = {"epoch": self.epoch, "items": items, "seconds": time.monotonic() - start,
                  "cpu_s": own_cpu_seconds() - cpu, "waits": waits}
        self.epoch += 1
        return record

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()


def job_main() -> int:
    """A job: one JSON line per command on stdin, one JSON line back. A JobSpec sets up a
    configuration, ``go`` runs its next epoch, ``end`` closes it; EOF exits. The process
    outlives configurations so that importing torch is paid once."""
    import torch

    torch.set_num_threads(1)  # two cores are shared by every job and daemon
    print(json.dumps({"ready": True}), flush=True)
    training: _Training | None = None
    try:
        for line in sys.stdin:
            command = line.strip()
            if command == "go" and training is not None:
                reply = training.run_epoch()
            elif command == "end" and training is not None:
                training.close()
                training = None
                reply = {"ended": True}
            elif command.startswith("{") and training is None:
                training = _Training(JobSpec(**json.loads(command)))
                reply = {"ready": True}
            else:
                print(f"unexpected command {command!r}", file=sys.stderr)
                return 1
            print(json.dumps(reply), flush=True)
    finally:
        if training is not None:
            training.close()
    return 0


# -- the parent: jobs ------------------------------------------------------------------
@contextlib.contextmanager
def running_jobs(n: int, log_dir: str) -> Iterator[list[JobChild]]:
    """``n`` started job processes (this module), all ready; stopped (or killed) on exit.
    Each starts with a QUIVER_JOB of its own: they share this process's process group,
    which a view would otherwise take for one job."""
    jobs: list[JobChild] = []
    try:
        for i in range(n):
            jobs.append(JobChild(str(i), [sys.executable, "-m", __name__],
                                 os.path.join(log_dir, f"job{i}.log"),
                                 env={JOB_ENV: f"compare-{os.getpid()}-{n}jobs-{i}"}))
        for job in jobs:
            job.receive(START_TIMEOUT)
        yield jobs
    finally:
        codes = [job.stop(JOB_STOP_TIMEOUT) for job in jobs]
    if any(codes):
        raise RuntimeError(f"job processes exited with {codes}")


# -- the parent: what the jobs read ----------------------------------------------------
@dataclasses.dataclass
class Target:
    """Where one configuration's jobs read, and what is measured there."""

    source: str  # the dataset's directory in a mount, or the bucket's endpoint
    daemon_pid: int | None  # mountd or rclone, whose CPU time is counted
    cache_used: Callable[[], int] | None = None  # bytes the cache holds now (sampled)
    mountd_counters: Callable[[], MountdCounters] | None = None
    cache_dir: str | None = None  # where the cache keeps its files (rclone's)


@dataclasses.dataclass(frozen=True)
class MountdCounters:
    """What mountd has counted of the dataset so far."""

    hits: int
    lookups: int
    causes: fetch_causes.Causes  # status's bucket_fetch_causes
    jobs: int  # the sampler's or the view's jobs mountd tells apart (exact: 0)


def _quiver_counters(m: MountdProcess, mode: str) -> MountdCounters:
    """Hits and lookups so far (for ``sub`` the items its manifests listed as cached,
    over all items planned; for ``view`` the opens it served a cached item, over all
    opens; for ``exact`` reads served from the store, over all reads), and the bucket
    fetches by cause."""
    status = m.status()
    ds = next(ds for ds in status["datasets"] if ds["name"] == DATASET)
    counters = []
    if mode == "sub":
        counters = [job["counters"] for job in status["jobs"]]
        hits = sum(c.get(SamplerJobCounter.HITS, 0) for c in counters)
        lookups = hits + sum(c.get(SamplerJobCounter.FETCHED, 0) for c in counters)
    elif mode == "view":
        counters = [job["counters"] for job in status["view_jobs"]
                    if job["dataset"] == DATASET]
        hits = sum(c.get(ViewJobCounter.HITS, 0) for c in counters)
        lookups = hits + sum(c.get(ViewJobCounter.MISSES, 0) for c in counters)
    else:
        c = ds["counters"]
        hits = c.get(ReadCounter.LOCAL_HITS, 0)
        lookups = hits + c.get(ReadCounter.MISSES, 0) + c.get(ReadCounter.PROBE_MISSES, 0)
    return MountdCounters(hits, lookups, ds["bucket_fetch_causes"], len(counters))


@contextlib.contextmanager
def quiver_mount(mode: str, data: Dataset, proxy: ThrottleProxy, cache_bytes: int,
                 workdir: str, name: str, probe_batches: int | None = PROBE_BATCHES
                 ) -> Iterator[Target]:
    """A mountd with an LRU store of ``cache_bytes`` and the dataset mounted through the
    proxy (as a substitutable view for ``view``), its loader processes ready (they start
    at the mount, as a daemon's are long before a training job starts); stopped,
    unmounted and its cache removed on exit."""
    probing = ("--probe-batches", str(probe_batches)) if probe_batches is not None else ()
    with running_mountd(workdir, cache_size=str(cache_bytes), name=name,
                        extra_args=probing) as m:
        request = {"op": "mount", "name": DATASET, "digest": data.digest,
                   "emulator_host": proxy.url}
        if mode == "view":
            request["view"] = "substitutable"
        m.call(request)
        m.wait_for_loaders()
        try:
            yield Target(os.path.join(m.root, DATASET), m.proc.pid,
                         cache_used=lambda: int(m.status()["cache"]["used_bytes"]),
                         mountd_counters=lambda: _quiver_counters(m, mode))
        finally:
            shutil.rmtree(m.cache_dir, ignore_errors=True)


def rclone_available() -> bool:
    return shutil.which("rclone") is not None


@contextlib.contextmanager
def rclone_mount(endpoint: str, cache_bytes: int, workdir: str, name: str,
                 remote: str = f"{BUCKET}/{DATASET}") -> Iterator[Target]:
    """``rclone mount`` of ``remote`` (bucket/prefix) with a full VFS cache of
    ``cache_bytes``, its GCS backend pointed at ``endpoint`` (the proxy's URL, or the
    emulator's); unmounted, stopped and its cache removed on exit."""
    root = os.path.join(workdir, f"{name}-mnt")
    cache_dir = os.path.join(workdir, f"{name}-cache")
    config = os.path.join(workdir, f"{name}.conf")
    os.makedirs(root)
    with open(config, "w", encoding="utf-8") as f:
        f.write(f"[bucket]\ntype = google cloud storage\nanonymous = true\n"
                f"endpoint = {endpoint}\n")
    argv = ["rclone", "--config", config, "mount", f"bucket:{remote}", root,
            "--read-only", "--vfs-cache-mode", "full",
            "--vfs-cache-max-size", f"{cache_bytes}B", "--vfs-cache-poll-interval",
            RCLONE_POLL, "--cache-dir", cache_dir,
            "--log-file", os.path.join(workdir, f"{name}.log")]
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(root, fuse_only=True):
            if proc.poll() is not None:
                raise RuntimeError(f"rclone mount exited with {proc.returncode}; see "
                                   f"{name}.log in {workdir}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"rclone did not mount {root} in {MOUNT_TIMEOUT:.0f} s")
            time.sleep(0.05)
        # sampled: rclone evicts only when it polls (mountd's store on every insert)
        yield Target(root, proc.pid, cache_used=lambda: disk_usage(cache_dir),
                     cache_dir=cache_dir)
    finally:
        unmount(root)  # rclone exits once its mount is gone
        terminate(proc)
        unmount(root)
        shutil.rmtree(cache_dir, ignore_errors=True)


@contextlib.contextmanager
def direct_reads(proxy: ThrottleProxy) -> Iterator[Target]:
    """No cache and no daemon: the jobs download from the bucket through the proxy."""
    yield Target(proxy.url, None)


def disk_usage(path: str) -> int:
    """Bytes allocated to the files under ``path`` (a sparse file counts what it holds)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for name in names:
            with contextlib.suppress(FileNotFoundError):  # evicted while we walk
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


class PeakUsage:
    """The most a cache held (``used()``, sampled every USAGE_SAMPLE_S by a thread; a
    cache can hold more than its budget between evictions); None without ``used``."""

    def __init__(self, used: Callable[[], int] | None) -> None:
        self.used = used
        self.peak: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cache-usage", daemon=True)

    def __enter__(self) -> PeakUsage:
        if self.used is not None:
            self.peak = 0
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.used())
            if self._stop.wait(USAGE_SAMPLE_S):
                return


# -- the parent: one configuration -----------------------------------------------------
def _snapshot(target: Target, proxy: ThrottleProxy) -> dict[str, Any]:
    counters = target.mountd_counters() if target.mountd_counters else None
    cpu = process_cpu_seconds(target.daemon_pid) if target.daemon_pid else 0.0
    return {"bucket_bytes": proxy.bytes_down, "daemon_cpu_s": cpu, "mountd": counters}


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, as disjoint intervals in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _epoch_record(epoch: int, seconds: float, replies: list[dict[str, Any]],
                  before: dict[str, Any], after: dict[str, Any], proxy: ThrottleProxy
                  ) -> dict[str, Any]:
    waiting = union((t0, t1) for r in replies for t0, t1 in r["waits"])
    record = {"epoch": epoch, "seconds": round(seconds, 3),
              "items": sum(r["items"] for r in replies),
              "job_seconds": [round(r["seconds"], 3) for r in replies],
              "job_cpu_s": [round(r["cpu_s"], 3) for r in replies],
              "job_wait_s": [round(sum(t1 - t0 for t0, t1 in r["waits"]), 3) for r in replies],
              "wait_any_s": round(sum(t1 - t0 for t0, t1 in waiting), 3),
              "bucket_bytes_waiting": round(proxy.sent.within(waiting)),
              "daemon_cpu_s": round(after["daemon_cpu_s"] - before["daemon_cpu_s"], 3),
              "bucket_bytes": after["bucket_bytes"] - before["bucket_bytes"],
              "hits": None, "lookups": None, "bucket_fetch_causes": None,
              "mountd_jobs": None}
    m0, m1 = before["mountd"], after["mountd"]
    if m1 is not None:
        record.update(hits=m1.hits - m0.hits, lookups=m1.lookups - m0.lookups,
                      bucket_fetch_causes=fetch_causes.since(m0.causes, m1.causes),
                      mountd_jobs=m1.jobs)
    return record


def measure(mode: str, target: Target, jobs: list[JobChild], n_epochs: int, size: Size,
            proxy: ThrottleProxy) -> list[dict[str, Any]]:
    """Run ``n_epochs`` epochs of ``mode`` on every job, all starting each epoch together;
    a record per epoch. A failure kills the jobs (the mount can then go)."""
    records = []
    try:
        for seed, job in enumerate(jobs):
            job.send(json.dumps(dataclasses.asdict(JobSpec(
                mode, target.source, seed, size.batch_size, size.compute_s, size.workers))))
        for job in jobs:
            job.receive(START_TIMEOUT)
        for epoch in range(n_epochs):
            before = _snapshot(target, proxy)
            replies, seconds = run_epoch(jobs, EPOCH_TIMEOUT)
            records.append(_epoch_record(epoch, seconds, replies, before,
                                         _snapshot(target, proxy), proxy))
        for job in jobs:
            job.send("end")
        for job in jobs:
            job.receive(START_TIMEOUT)
    except BaseException:
        for job in jobs:
            job.kill()
        raise
    return records


def aggregate(records: list[dict[str, Any]], data: Dataset, rate: float) -> dict[str, Any]:
    """Totals and rates over some epochs of one configuration (``rate``: the proxy's cap)."""
    seconds = sum(r["seconds"] for r in records)
    items = sum(r["items"] for r in records)
    bucket = sum(r["bucket_bytes"] for r in records)
    read = items * data.bytes / len(data.paths)  # every job reads every item once an epoch
    job_seconds = [s for r in records for s in r["job_seconds"]]
    counted = [r for r in records if r["lookups"]]
    hits, lookups = sum(r["hits"] for r in counted), sum(r["lookups"] for r in counted)
    waiting = sum(r["wait_any_s"] for r in records)
    return {"epochs": len(records), "seconds": round(seconds, 2), "items": items,
            "items_per_s": round(items / seconds, 2),
            "epoch_s_per_job": round(sum(job_seconds) / len(job_seconds), 2),
            "bucket_bytes": bucket,
            "bucket_bytes_per_epoch": round(bucket / len(records) / data.bytes, 3),
            "byte_hit_ratio": round(1 - bucket / read, 4),
            "hit_ratio": round(hits / lookups, 4) if lookups else None,
            "wait_s_per_job": round(sum(s for r in records for s in r["job_wait_s"])
                                    / len(job_seconds), 2),
            "wait_any_s": round(waiting, 2),
            "bucket_utilization_waiting": round(
                sum(r["bucket_bytes_waiting"] for r in records) / waiting / rate, 3)
            if waiting else None,
            "cpu_s_jobs": round(sum(s for r in records for s in r["job_cpu_s"]), 1),
            "cpu_s_daemon": round(sum(r["daemon_cpu_s"] for r in records), 1)}


def run_config(mode: str, fraction: float | None, jobs: list[JobChild], data: Dataset,
               proxy: ThrottleProxy, size: Size, workdir: str,
               probe_batches: int | None = PROBE_BATCHES) -> dict[str, Any]:
    """One configuration: ``mode`` with a cache of ``fraction`` of the dataset (None: no
    cache), read by every job in ``jobs``, mountd probing jobs for ``probe_batches``
    batches (None: mountd's default)."""
    # Rounded up: mountd sizes a lone node's chunks at an eighth of its cache, and a
    # budget a byte short of 10% would make 81 chunks instead of 80.
    cache_bytes = math.ceil(fraction * data.bytes) if fraction is not None else 0
    name = f"{mode}-{round(fraction * 100) if fraction else 0}pct-{len(jobs)}jobs"
    log.info("%s: cache %d bytes", name, cache_bytes)
    if mode == "direct":
        target_cm = direct_reads(proxy)
    elif mode == "rclone":
        target_cm = rclone_mount(proxy.url, cache_bytes, workdir, name)
    else:
        target_cm = quiver_mount(mode, data, proxy, cache_bytes, workdir, name,
                                 probe_batches)
    n_epochs = size.epochs_direct if mode == "direct" else size.epochs
    with target_cm as target, PeakUsage(target.cache_used) as usage:
        records = measure(mode, target, jobs, n_epochs, size, proxy)
    warm = records if mode == "direct" else records[1:]
    rate, peak = proxy.bucket.rate, usage.peak
    causes = (fetch_causes.total(r["bucket_fetch_causes"] for r in records)
              if target.mountd_counters else None)
    return {"mode": mode, "cache_fraction": fraction, "cache_bytes": cache_bytes,
            "peak_cache_bytes": peak,
            "budget_used": round(peak / cache_bytes, 3) if peak is not None else None,
            "jobs": len(jobs), "bucket_fetch_causes": causes, "epochs": records,
            "all": aggregate(records, data, rate), "steady": aggregate(warm, data, rate),
            "epoch0": aggregate(records[:1], data, rate)}


# -- the benchmark ---------------------------------------------------------------------
def upload_dataset(emulator: Emulator, proxy: ThrottleProxy, size: Size,
                   workdir: str) -> Dataset:
    """Write the synthetic dataset, upload it through the proxy (see the module's
    docstring) and digest it from the emulator directly (unthrottled)."""
    return upload_synthetic(emulator.host, BUCKET, DATASET, workdir, size.items, size.classes,
                            seed=5, mean_size=size.mean_item_bytes, upload_host=proxy.url)


def _summary(configs: list[dict[str, Any]], job_counts: tuple[int, ...]) -> dict[str, Any]:
    """The headline numbers: ``max(job_counts)`` jobs unless a key says otherwise."""
    jobs = max(job_counts)

    def config(mode: str, fraction: float, n_jobs: int = jobs) -> dict[str, Any]:
        return next(c for c in configs if c["mode"] == mode and c["jobs"] == n_jobs
                    and c["cache_fraction"] == fraction)

    def vs_rclone(key: str, fraction: float, digits: int, n_jobs: int = jobs,
                  epochs: str = "steady", mode: str = "sub") -> float | None:
        ours, rclone = (config(m, fraction, n_jobs)[epochs][key] for m in (mode, "rclone"))
        return round(ours / rclone, digits) if rclone else None

    summary: dict[str, Any] = {f"speedup_vs_rclone_{round(f * 100)}":
                               vs_rclone("items_per_s", f, 2) for f in FRACTIONS}
    summary["speedup_vs_rclone_10_1job"] = (vs_rclone("items_per_s", 0.1, 2, n_jobs=1)
                                            if 1 in job_counts else None)
    summary["bucket_bytes_vs_rclone_10"] = vs_rclone("bucket_bytes", 0.1, 3)
    sub_10 = config("sub", 0.1)
    summary["epoch0_bucket_ratio_sub_10"] = sub_10["epoch0"]["bucket_bytes_per_epoch"]
    summary["epoch0_speedup_vs_rclone_10"] = vs_rclone("items_per_s", 0.1, 2,
                                                       epochs="epoch0")
    summary["epoch0_exact_vs_rclone_10_1job"] = (
        vs_rclone("items_per_s", 0.1, 2, n_jobs=1, epochs="epoch0", mode="exact")
        if 1 in job_counts else None)
    summary["bucket_utilization_sub_10"] = sub_10["steady"]["bucket_utilization_waiting"]
    summary["wait_any_s_sub_10"] = sub_10["steady"]["wait_any_s"]
    summary["budget_used_sub_50"] = config("sub", 0.5)["budget_used"]
    view_10 = config("view", VIEW_FRACTION)
    summary["speedup_vs_rclone_10_view"] = vs_rclone("items_per_s", VIEW_FRACTION, 2,
                                                     mode="view")
    summary["speedup_view_vs_sub_10"] = round(
        view_10["steady"]["items_per_s"] / sub_10["steady"]["items_per_s"], 3)
    summary["bucket_bytes_vs_rclone_10_view"] = vs_rclone("bucket_bytes", VIEW_FRACTION, 3,
                                                          mode="view")
    summary["hit_ratio_sub_10"] = sub_10["steady"]["hit_ratio"]
    summary["hit_ratio_view_10"] = view_10["steady"]["hit_ratio"]
    return summary


GOALS = {"speedup_vs_rclone_10": (">=", 3.0), "speedup_vs_rclone_50": (">=", 2.0),
         "speedup_vs_rclone_100": (">=", 1.0), "bucket_bytes_vs_rclone_10": ("<=", 1 / 3),
         "speedup_vs_rclone_10_1job": (">=", 0.95), "epoch0_bucket_ratio_sub_10": ("<=", 1.1),
         "epoch0_speedup_vs_rclone_10": (">=", 1.0), "bucket_utilization_sub_10": (">=", 0.9),
         # a lone job's first epoch through exact reads, at the bucket's speed
         "epoch0_exact_vs_rclone_10_1job": (">=", 0.95),
         "budget_used_sub_50": (">=", 0.8),
         # the view within 10% of the sampler, with no change to the training code
         "speedup_view_vs_sub_10": (">=", 0.9)}


def _goals(summary: dict[str, Any]) -> dict[str, bool | None]:
    """Whether each goal is met (None: not measurable, e.g. rclone read no bytes)."""
    met: dict[str, bool | None] = {}
    for key, (op, bound) in GOALS.items():
        value = summary[key]
        met[key] = None if value is None else (value >= bound if op == ">=" else value <= bound)
    return met


def plot_bars(report: dict[str, Any], out: str) -> None:
    """Grouped bars: steady-state aggregate items/s per configuration and cache budget, one
    panel per job count."""
    plt = figures.pyplot()
    configs = report["configs"]
    job_counts = sorted({c["jobs"] for c in configs})
    width = 0.8 / len(MODES)
    fig, axes = plt.subplots(1, len(job_counts), figsize=(5.5 * len(job_counts), 4.2),
                             squeeze=False, sharey=True)
    for ax, jobs in zip(axes[0], job_counts):
        for k, mode in enumerate(MODES):
            xs, rates = [], []
            for i, fraction in enumerate(FRACTIONS):
                # direct has no cache: the same bar in every group; the view runs at one
                rate = next((c["steady"]["items_per_s"] for c in configs
                             if c["mode"] == mode and c["jobs"] == jobs
                             and c["cache_fraction"] in (fraction, None)), None)
                if rate is not None:
                    xs.append(i + (k - (len(MODES) - 1) / 2) * width)
                    rates.append(rate)
            if not rates:
                continue
            bars = ax.bar(xs, rates, width, label=LABELS[mode], color=f"C{k}")
            ax.bar_label(bars, fmt="%.0f", fontsize=7)
        ax.set_xticks(range(len(FRACTIONS)), [f"{round(f * 100)}%" for f in FRACTIONS])
        ax.set_xlabel("cache budget (of the dataset)")
        ax.set_title(f"{jobs} job{'s' if jobs > 1 else ''}")
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("aggregate items/s (steady state)")
    handles: dict[str, Any] = {}  # every mode's, whichever panel has it (the view: one)
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    axes[0][0].legend(handles.values(), handles.keys(), fontsize=8)
    settings = report["settings"]
    fig.suptitle(f"{report['dataset']['items']} items, bucket capped at "
                 f"{settings['bucket_rate'] / 1e6:g} MB/s", fontsize=10)
    figures.save(fig, out)


def run(quick: bool, workdir: str, plot: str | None = None, size: str | None = None,
        latency_ms: float = 0.0) -> dict:
    """The benchmark; ``size`` ("full", "quick", "tiny") overrides ``quick``;
    ``latency_ms`` delays the first byte of every response from the bucket."""
    s = SIZES[size or ("quick" if quick else "full")]
    load_at_start = os.getloadavg()[0]  # other work on the machine skews every number
    configs: list[dict[str, Any]] = []
    with running_emulator(concurrent=True) as emulator, throttled(emulator.host, s.bucket_rate,
                                                   latency=latency_ms / 1000) as proxy:
        emulator.create_bucket(BUCKET)
        data = upload_dataset(emulator, proxy, s, workdir)
        for n_jobs in s.job_counts:
            with running_jobs(n_jobs, workdir) as jobs:
                configs.append(run_config("direct", None, jobs, data, proxy, s, workdir))
                for fraction in FRACTIONS:
                    for mode in CACHED_MODES:
                        configs.append(run_config(mode, fraction, jobs, data, proxy, s,
                                                  workdir))
                    if fraction == VIEW_FRACTION and n_jobs == max(s.job_counts):
                        # right after sub's summary configuration, on the same jobs
                        configs.append(run_config("view", fraction, jobs, data, proxy, s,
                                                  workdir))
    summary = _summary(configs, s.job_counts)
    report = {
        "dataset": {"items": len(data.paths), "bytes": data.bytes,
                    "classes": len(set(data.labels))},
        "settings": {**dataclasses.asdict(s), "fractions": FRACTIONS,
                     "probe_batches": PROBE_BATCHES, "latency_ms": latency_ms,
                     "rclone_poll_interval": RCLONE_POLL, "crop": CROP,
                     "summary_jobs": max(s.job_counts)},
        "definitions": {
            "steady": "epochs after the first (direct: every epoch); all: every epoch; "
                      "epoch0: the first (cold) epoch",
            "latency_ms": "the proxy delays the first byte of every response this long",
            "items_per_s": "items read by all jobs / wall seconds (jobs start each epoch "
                           "together)",
            "epoch_s_per_job": "mean seconds a job took for one epoch",
            "bucket_bytes": "bytes the proxy passed from the bucket (HTTP included)",
            "bucket_bytes_per_epoch": "bucket_bytes per epoch / dataset bytes",
            "byte_hit_ratio": "1 - bucket_bytes / bytes the jobs read (the only hit ratio "
                              "rclone exposes)",
            "hit_ratio": "mountd's counters; exact: reads served from the store / reads; "
                         "sub: items its manifests listed as cached / items; view: "
                         "opens served a cached item / opens (status view_jobs)",
            "cpu_s": "user + system seconds; jobs: the job processes and their DataLoader "
                     "workers; daemon: mountd or rclone",
            "wait_s_per_job": "mean seconds a job's training loop waited for the "
                              "DataLoader's next batch, per epoch",
            "wait_any_s": "seconds in which at least one job waited (the union of every "
                          "job's waits)",
            "bucket_utilization_waiting": "bytes the proxy sent within wait_any_s / "
                                          "wait_any_s / the proxy's cap",
            "peak_cache_bytes": "the most the cache held, sampled every "
                                f"{USAGE_SAMPLE_S:g} s: mountd's store volume (status "
                                "cache.used_bytes), rclone's cache directory on disk",
            "budget_used": "peak_cache_bytes / cache_bytes",
            "mountd_jobs": "per epoch, the jobs mountd told apart at its end: sub's "
                           "sampler jobs, the view's jobs (one per QUIVER_JOB); exact: 0",
            "bucket_fetch_causes": "mountd's bucket fetches of the dataset by cause "
                                   "(status bucket_fetch_causes): {cause: {fetches, "
                                   "bytes}}, per epoch and for the configuration",
            "speedup_vs_rclone_N": "sub / rclone, steady items_per_s, summary_jobs jobs, "
                                   "cache N%",
            "bucket_bytes_vs_rclone_10": "sub / rclone, steady bucket_bytes, summary_jobs "
                                         "jobs, cache 10%",
            "speedup_vs_rclone_10_1job": "sub / rclone, steady items_per_s, 1 job, cache "
                                         "10% (null when the size runs no lone job)",
            "epoch0_bucket_ratio_sub_10": "sub, summary_jobs jobs, cache 10%: bucket_bytes "
                                          "of epoch 0 / dataset bytes",
            "epoch0_speedup_vs_rclone_10": "sub / rclone, epoch 0 items_per_s, "
                                           "summary_jobs jobs, cache 10%",
            "epoch0_exact_vs_rclone_10_1job": "exact / rclone, epoch 0 items_per_s, 1 job, "
                                              "cache 10% (null when the size runs no "
                                              "lone job)",
            "bucket_utilization_sub_10": "sub, summary_jobs jobs, cache 10%: steady "
                                         "bucket_utilization_waiting",
            "wait_any_s_sub_10": "sub, summary_jobs jobs, cache 10%: steady wait_any_s",
            "budget_used_sub_50": "sub, summary_jobs jobs, cache 50%: budget_used",
            "speedup_vs_rclone_10_view": "view / rclone, steady items_per_s, summary_jobs "
                                         "jobs, cache 10%: plain ImageFolder + "
                                         "DataLoader(shuffle=True) through a --view "
                                         "substitutable mount, one QUIVER_JOB per job",
            "speedup_view_vs_sub_10": "view / sub, steady items_per_s, summary_jobs jobs, "
                                      "cache 10% (speedup_vs_rclone_10_view / "
                                      "speedup_vs_rclone_10)",
            "bucket_bytes_vs_rclone_10_view": "view / rclone, steady bucket_bytes, "
                                              "summary_jobs jobs, cache 10%",
            "hit_ratio_sub_10": "sub, summary_jobs jobs, cache 10%: steady hit_ratio",
            "hit_ratio_view_10": "view, summary_jobs jobs, cache 10%: steady hit_ratio"},
        "load_average_1min": {"start": load_at_start, "end": os.getloadavg()[0]},
        "configs": configs,
        "goals": _goals(summary),
        "summary": summary,
    }
    if plot:
        plot_bars(report, plot)
    return report


if __name__ == "__main__":
    sys.exit(job_main())

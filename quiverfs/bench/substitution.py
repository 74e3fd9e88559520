"""``quiver bench substitution``: substitutable reads against exact (LRU) reads.

Single node, one mountd per configuration, the cache at 10% or 20% of a synthetic
ImageFolder dataset kept in the GCS emulator behind a bandwidth-capped proxy
(``throttle_proxy``), so the "bucket" is slower than the local cache, as a shared
bucket is. Each job is a separate process (``reading_job``) reading through the real
mount:

- ``sub``: batches from ``QuiverBatchSampler`` (iterated as a DataLoader does; one job
  per process, each its own seed, world size 1);
- ``lru``: the job's own seeded permutation of the same files (a plain global shuffle,
  exact reads; the store evicts least-recently-used);
- ``view`` (the summary configuration only): the same plain shuffle of every path, read
  through a substitutable view of the dataset (``"view": "substitutable"``), which
  serves for each open an item of the same label that the job has not had in this
  pass, cached ones first. Each job names itself with ``QUIVER_JOB`` (the jobs share
  the parent's process group) and records what each open served (the file's
  ``user.quiver.served.*`` xattrs), so that exactly-once can be checked per label.

A job reads each batch's files with a few threads (like DataLoader workers, one batch
ahead), drops their pages from the kernel's cache, and sleeps a simulated compute time
per batch. The parent holds all jobs at every epoch boundary, so mountd's counters can
be read per epoch; epoch 0 (cold cache) is left out of the steady-state numbers.

A small extra configuration, ``cached``, measures what substitution costs where there
is nothing to substitute: a cache that holds the whole dataset (allotted ``full``),
every item read once beforehand, then one ``sub`` job and one ``lru`` job taking their
epochs in turn (each alone), then one ``view`` job (through a substitutable view of the
same digest), with no compute.
``sub_vs_exact_cached`` is the ``sub`` job's items/s over the ``lru`` job's, and
``view_vs_exact_cached`` the ``view`` job's, after each job's warm-up epoch.

Then a small CNN (``quiverfs.bench.demo.small_cnn``) is trained on the scikit-learn
digits over a real mount, with a global shuffle, with ``QuiverBatchSampler``, and with a
plain ``DataLoader(shuffle=True)`` over a substitutable view of the same digest, for
several seeds; each mode's test accuracy on a held-out split (read exactly) is compared
with the global shuffle's, paired by seed, with a 95% confidence interval of the gap.
Each training run is a process of its own (``python -m quiverfs.bench.substitution
SPEC``) in a process group of its own, as a training script started from a shell is.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import math
import os
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from digest_tools.create import create_digest
from quiverfs import digest as digest_format
from quiverfs.bench import fetch_causes, floor, reading_job
from quiverfs.bench.bucket_dataset import Dataset, upload_synthetic
from quiverfs.bench.data import write_digits_tree
from quiverfs.bench.emulator import running_emulator
from quiverfs.bench.job_child import JobProcess, run_epoch, running_jobs
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench.reading_job import PREFETCH_BATCHES, READERS, JobSpec, MountSource
from quiverfs.bench.throttle_proxy import ThrottleProxy, throttled
from quiverfs.counters import ReadCounter, SamplerJobCounter, ViewJobCounter
from quiverfs.job_protocol import JOB_ENV

log = logging.getLogger(__name__)

BUCKET = "bench"
DATASET = "syn"
VIEW = "syn-view"  # the view configuration's mount of the dataset
DIGITS = "digits"
DIGITS_VIEW = "digits-view"  # a substitutable view of the digits, beside the exact mount
ACCURACY_MODES = ("global", "sub", "view")
BUCKET_RATE = 20e6  # bytes/s the proxy lets through from the bucket (all connections)
# Benefit probing (paper §5.3) is off: it forces 100 batches of misses per job (more
# than an epoch here) whose fetches flush the resident chunks from the store, and its
# verdict can switch the dataset's cache off mid-run. Unprobed jobs count as benefiting.
PROBE_BATCHES = 0
# The cached configuration's cache, in dataset bytes: the whole dataset fits with room
# for the store's own footprint, so the allocation gives it ``full``.
CACHED_CACHE = 2.0
EPOCH_TIMEOUT = 600.0  # seconds a job may take for one epoch (or to start)
MODE_TIMEOUT = 60.0  # seconds the cached dataset may take to be allotted full
JOB_STOP_TIMEOUT = 30.0  # seconds a job may take to unregister and exit
DIGITS_TEST_FRACTION = 0.2
ACCURACY_BATCH = 64
# Simulated compute per training step on the digits, standing for a model that takes
# longer per batch than reading it (the small CNN on 8x8 images takes far less).
ACCURACY_STEP_S = 0.1
# Student t quantiles, two-sided 95% (0.975), by degrees of freedom (scipy is not a
# dependency); past the table the last one, which makes the interval slightly wider.
T_975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
         2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
         2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


@dataclasses.dataclass(frozen=True)
class Size:
    """How big a run is."""

    items: int  # synthetic dataset items (~110 KB each)
    classes: int
    epochs: int  # per configuration; epoch 0 is the warm-up
    batch_size: int
    compute_s: float  # simulated compute per batch (seconds)
    configs: tuple[tuple[float, int], ...]  # (cache fraction, concurrent jobs); first: summary
    window: int  # items per label-histogram window
    accuracy_seeds: tuple[int, ...]
    accuracy_epochs: int
    cached_epochs: int  # per job of the cached configuration; the first is the warm-up


SIZES = {
    "full": Size(1200, 10, 3, 8, 0.125, ((0.2, 4), (0.1, 4), (0.2, 1)), 1000,
                 tuple(range(10)), 3, 61),
    "quick": Size(300, 10, 3, 8, 0.125, ((0.2, 4),), 100, (0, 1), 1, 11),
    "tiny": Size(120, 10, 3, 8, 0.02, ((0.5, 2),), 30, (0,), 1, 2),
}


# -- the parent: one configuration -----------------------------------------------------
def mountd_args() -> tuple[str, ...]:
    """mountd's options for a run: no probing; chunks of mountd's default size (an
    eighth of the cache on a lone node, so the cycle holds several)."""
    return ("--probe-batches", str(PROBE_BATCHES))


@dataclasses.dataclass
class ConfigRun:
    """What one configuration measured: per-epoch records, and each job's epoch orders
    (in a view, the paths served, in the order read)."""

    report: dict[str, Any]
    orders: list[list[list[str]]]  # job -> epoch -> paths in the order read


def _snapshot(status: dict[str, Any], dataset: str, proxy: ThrottleProxy) -> dict[str, int]:
    counters = next(ds["counters"] for ds in status["datasets"] if ds["name"] == dataset)
    keys = (ReadCounter.LOCAL_HITS, ReadCounter.MISSES, ReadCounter.PROBE_MISSES,
            ReadCounter.BUCKET_FETCHES, ReadCounter.BUCKET_BYTES, ReadCounter.COALESCED)
    return {**{k: int(counters.get(k, 0)) for k in keys}, "proxy_bytes": proxy.bytes_down}


def view_job_counters(status: dict[str, Any], dataset: str, name: str) -> dict[str, int]:
    """The counters of the view job named ``name`` (its ``QUIVER_JOB``) reading the view
    ``dataset``; zeros before its first open."""
    job = next((j for j in status.get("view_jobs", ())
                if j["dataset"] == dataset and j["identity"] in (name, f"env:{name}")), None)
    counters = job["counters"] if job else {}
    return {k: int(counters.get(k, 0)) for k in ViewJobCounter}


def _epoch_record(epoch: int, seconds: float, replies: list[dict[str, Any]],
                  before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    items = [len(r["paths"]) for r in replies]
    return {"epoch": epoch, "seconds": round(seconds, 2), "items": sum(items),
            "job_seconds": [round(r["seconds"], 2) for r in replies],
            "job_hits": [r["hits"] for r in replies], "job_items": items,
            "job_manifest_s": [round(r["manifest_s"], 2) for r in replies],
            "bytes_read": sum(r["bytes"] for r in replies),
            **{k: after[k] - before[k] for k in after}}


def _view_epoch(record: dict[str, Any], before: list[dict[str, int]],
                after: list[dict[str, int]]) -> None:
    """Add the view jobs' opens and hits in the epoch (mountd's view_jobs counters)."""
    record["job_hits"] = [a[ViewJobCounter.HITS] - b[ViewJobCounter.HITS]
                          for b, a in zip(before, after)]
    record["job_opens"] = [a[ViewJobCounter.OPENS] - b[ViewJobCounter.OPENS]
                           for b, a in zip(before, after)]


def _steady_state(mode: str, epochs: list[dict[str, Any]], dataset_bytes: int
                  ) -> dict[str, Any]:
    """Rates over the epochs after the first."""
    steady = epochs[1:]
    n = len(steady)
    total: collections.Counter[str] = collections.Counter()
    for e in steady:
        total.update({k: e[k] for k in ("items", "seconds", "local_hits", "misses",
                                         "probe_misses", "bucket_bytes", "proxy_bytes",
                                         "bucket_fetches")})
    reads = total["local_hits"] + total["misses"] + total["probe_misses"]
    read_hit_ratio = total["local_hits"] / reads if reads else None
    out: dict[str, Any] = {
        "epochs": n, "read_hit_ratio": read_hit_ratio,
        "bucket_bytes_ratio": total["bucket_bytes"] / n / dataset_bytes,
        "proxy_bytes_ratio": total["proxy_bytes"] / n / dataset_bytes,
        "bucket_fetches_per_epoch": total["bucket_fetches"] / n,
        "items_per_s": total["items"] / total["seconds"]}
    if mode in ("sub", "view"):  # hits over the manifests' items, or over the opens
        per = "job_items" if mode == "sub" else "job_opens"
        per_job = [sum(e["job_hits"][j] for e in steady) / sum(e[per][j] for e in steady)
                   for j in range(len(steady[0]["job_hits"]))]
        out["hit_ratio_per_job"] = per_job
        out["hit_ratio"] = sum(per_job) / len(per_job)
    else:
        out["hit_ratio"] = read_hit_ratio  # mountd's counters: one dataset, all jobs
    return out


def run_config(mode: str, fraction: float, n_jobs: int, data: Dataset, proxy: ThrottleProxy,
               size: Size, workdir: str) -> ConfigRun:
    """One mountd with the cache at ``fraction`` of the dataset, ``n_jobs`` jobs of ``mode``
    (``view``: reading a substitutable view of the dataset)."""
    name = f"{mode}-{round(fraction * 100)}pct-{n_jobs}jobs"
    cache_bytes = int(fraction * data.bytes)
    extra = mountd_args()
    log.info("%s: cache %d bytes, mountd %s", name, cache_bytes, " ".join(extra))
    view = mode == "view"
    dataset = VIEW if view else DATASET
    epochs: list[dict[str, Any]] = []
    orders: list[list[list[str]]] = [[] for _ in range(n_jobs)]
    asked: list[list[list[str]]] = [[] for _ in range(n_jobs)]  # job -> epoch -> paths opened
    served: list[list[list[list[Any]]]] = [[] for _ in range(n_jobs)]  # ... -> what each got
    # the jobs share this process's process group: each names itself to the view
    job_names = [f"{name}-job{k}" for k in range(n_jobs)]
    with running_mountd(workdir, cache_size=str(cache_bytes), name=name, extra_args=extra) as m:
        m.call({"op": "mount", "name": dataset, "digest": data.digest,
                "emulator_host": proxy.url, **({"view": "substitutable"} if view else {})})
        root = os.path.join(m.root, dataset)
        specs = {f"{seed}-{mode}": JobSpec(mode, root, seed, size.batch_size, size.compute_s,
                                           size.epochs) for seed in range(n_jobs)}
        envs = {spec: {JOB_ENV: job} for spec, job in zip(specs, job_names)}
        with running_jobs(reading_job.__name__, specs, workdir, EPOCH_TIMEOUT,
                          envs if view else None) as jobs:
            status = m.status()
            for epoch in range(size.epochs):
                before = _snapshot(status, dataset, proxy)
                view_before = [view_job_counters(status, dataset, n) for n in job_names]
                replies, seconds = run_epoch(jobs, EPOCH_TIMEOUT)
                status = m.status()
                record = _epoch_record(epoch, seconds, replies, before,
                                       _snapshot(status, dataset, proxy))
                if view:
                    _view_epoch(record, view_before,
                                [view_job_counters(status, dataset, n) for n in job_names])
                epochs.append(record)
                for j, reply in enumerate(replies):
                    if view:
                        asked[j].append(reply["paths"])
                        served[j].append(reply["served"])
                        orders[j].append([path for _, path, _ in reply["served"]])
                    else:
                        orders[j].append(reply["paths"])
            for job in jobs:
                job.finish(JOB_STOP_TIMEOUT)
    shutil.rmtree(os.path.join(workdir, f"{name}-cache"), ignore_errors=True)
    chunks = [j["chunks"] for j in status["jobs"] if j.get("chunks")]
    expected = sorted(data.paths)
    report = {"mode": mode, "cache_fraction": fraction, "cache_bytes": cache_bytes,
              "jobs": n_jobs, "bucket_fetch_causes": fetch_causes.of_dataset(status, dataset),
              "epochs": epochs,
              "steady": _steady_state(mode, epochs, data.bytes),
              "exactly_once": all(sorted(paths) == expected
                                  for job in orders for paths in job),
              "chunks": chunks[0]["chunks"] if chunks else None,
              "cache_mode": chunks[0].get("mode") if chunks else None,
              # a job whose dataset group never heard from the coordinator gets no hits
              "jobs_without_cycle": sum(j.get("chunks") is None for j in status["jobs"]),
              "max_resident_chunks": max((c["max_resident"] for c in chunks), default=None)}
    if view:
        report["served_check"] = check_served(asked, served, data)
        report["exactly_once"] = report["served_check"]["exactly_once"]
        report["view_jobs"] = [j for j in status.get("view_jobs", ())
                               if j["dataset"] == dataset]
    return ConfigRun(report, orders)


def _pool(path: str) -> tuple[str, str]:
    """What a view substitutes within: the directory and the lower-case extension."""
    directory, _, name = path.rpartition("/")
    return directory, os.path.splitext(name)[1].lower()


def check_served(asked: list[list[list[str]]], served: list[list[list[list[Any]]]],
                 data: Dataset) -> dict[str, Any]:
    """Exactly once through a view: in every job-epoch the items served are every item
    once, each open got an item of the opened path's label, the SHA-256 the view named
    is the digest's for the path it named, and the bytes read hash to it. ``asked``: job
    -> epoch -> paths opened; ``served``: the same shape, [sha256, path, intact] each."""
    digest = digest_format.decode(data.digest)
    sha_of = {digest.path(i): digest.hash(i).hex() for i in range(len(digest))}
    expected = sorted(data.paths)
    counts = {"job_epochs": 0, "reads": 0, "job_epochs_not_every_item_once": 0,
              "other_label": 0, "wrong_sha256": 0, "bytes_not_sha256": 0}
    for job_asked, job_served in zip(asked, served, strict=True):
        for paths, reads in zip(job_asked, job_served, strict=True):
            counts["job_epochs"] += 1
            if len(reads) != len(paths) or sorted(p for _, p, _ in reads) != expected:
                counts["job_epochs_not_every_item_once"] += 1
            for path, (sha, got, intact) in zip(paths, reads):
                counts["reads"] += 1
                counts["other_label"] += _pool(path) != _pool(got)
                counts["wrong_sha256"] += sha_of.get(got) != sha
                counts["bytes_not_sha256"] += not intact
    problems = ("job_epochs_not_every_item_once", "other_label", "wrong_sha256",
                "bytes_not_sha256")
    return {"exactly_once": counts["reads"] > 0 and not any(counts[k] for k in problems),
            **counts}


def run_cached(data: Dataset, proxy: ThrottleProxy, size: Size, workdir: str
               ) -> dict[str, Any]:
    """The cached configuration: a ``sub`` job and an ``lru`` job, their epochs taken in
    turn (each alone, the other waiting), then a ``view`` job, on one mountd whose cache
    holds the whole dataset, read once beforehand (the view is a second mount of the
    same digest). The epochs alternate so that a change in the machine's speed (a
    shared VM's varies by a third between minutes) falls on both jobs alike."""
    cache_bytes = int(CACHED_CACHE * data.bytes)
    runs: dict[str, dict[str, Any]] = {}
    with running_mountd(workdir, cache_size=str(cache_bytes), name="cached",
                        extra_args=("--probe-batches", str(PROBE_BATCHES))) as m:
        m.call({"op": "mount", "name": DATASET, "digest": data.digest,
                "emulator_host": proxy.url})
        m.call({"op": "mount", "name": VIEW, "digest": data.digest,
                "emulator_host": proxy.url, "view": "substitutable"})
        source = MountSource(os.path.join(m.root, DATASET))
        with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
            sum(pool.map(source.read, source.paths()))
        specs = {f"cached-{mode}": JobSpec(mode, os.path.join(m.root, DATASET), 0,
                                           size.batch_size, 0.0, size.cached_epochs)
                 for mode in ("sub", "lru")}
        with running_jobs(reading_job.__name__, specs, workdir, EPOCH_TIMEOUT,
                          {name: {JOB_ENV: name} for name in specs}) as jobs:
            # the warm-ups; the sub job's told the coordinator of it: it allots full
            replies = {job.name: [run_epoch([job], EPOCH_TIMEOUT)[0][0]] for job in jobs}
            m.wait_for_mode("full", MODE_TIMEOUT)
            for k in range(size.cached_epochs - 1):
                for job in jobs if k % 2 == 0 else jobs[::-1]:
                    replies[job.name].append(run_epoch([job], EPOCH_TIMEOUT)[0][0])
            status = m.status()
            for job in jobs:
                job.finish(JOB_STOP_TIMEOUT)
        for job in jobs:
            runs[specs[job.name].mode] = _cached_run(
                replies[job.name],
                all(sorted(r["paths"]) == sorted(data.paths) for r in replies[job.name]),
                next((j for j in status["jobs"] if j["job"] == job.job_id), None))
        runs["view"] = _cached_view(m, data, size, workdir)
        backing = shutil.copytree(os.path.join(m.root, DATASET),
                                  os.path.join(workdir, "floor-src"))
    shutil.rmtree(os.path.join(workdir, "cached-cache"), ignore_errors=True)
    try:
        floor_view = _floor_view(backing, size, workdir)
    finally:
        shutil.rmtree(backing)
    exact = runs["lru"]["items_per_s"]
    return {"cache_bytes": cache_bytes, "epochs": size.cached_epochs, "runs": runs,
            "floor_view": floor_view,
            "sub_vs_exact": runs["sub"]["items_per_s"] / exact,
            "view_vs_exact": runs["view"]["items_per_s"] / exact,
            "view_vs_floor": (runs["view"]["items_per_s"] / floor_view["items_per_s"]
                              if "items_per_s" in floor_view else None)}


def _cached_view(m: MountdProcess, data: Dataset, size: Size, workdir: str
                 ) -> dict[str, Any]:
    """The cached configuration's view job, alone: its timed epochs only read, as the
    others' do; its warm-up and one more epoch record what each open served, and its
    counters after each unchecked epoch say it opened every path once and ended one
    pass per pool."""
    name = "cached-view"
    spec = JobSpec("view", os.path.join(m.root, VIEW), 0, size.batch_size, 0.0,
                   size.cached_epochs + 1)
    with running_jobs(reading_job.__name__, {name: spec}, workdir, EPOCH_TIMEOUT,
                      {name: {JOB_ENV: name}}) as jobs:
        replies = [run_epoch(jobs, EPOCH_TIMEOUT)[0][0]]  # the warm-up
        counted = [view_job_counters(m.status(), VIEW, name)]
        for _ in range(size.cached_epochs - 1):
            replies.append(run_epoch(jobs, EPOCH_TIMEOUT, "go unchecked")[0][0])
            counted.append(view_job_counters(m.status(), VIEW, name))
        checked = [replies[0], run_epoch(jobs, EPOCH_TIMEOUT)[0][0]]
        status = m.status()
        jobs[0].finish(JOB_STOP_TIMEOUT)
    served = [[path for _, path, _ in r["served"]] for r in checked]
    return _cached_run(
        replies, (all(sorted(paths) == sorted(data.paths) for paths in served)
                  and _each_epoch_once(counted, data)),
        next((j for j in status["view_jobs"] if j["identity"] == f"env:{name}"), None))


def _cached_run(replies: list[dict[str, Any]], exactly_once: bool,
                job: dict[str, Any] | None) -> dict[str, Any]:
    """A cached job's record: its epochs, whether it read every item once each, and its
    counters and cache mode from mountd's status (``job``; None where it was missing)."""
    return {**_epochs_read(replies), "exactly_once": exactly_once,
            "counters": job["counters"] if job else None,
            "cache_mode": job["chunks"]["mode"] if job and job.get("chunks") else None}


def _floor_view(backing: str, size: Size, workdir: str) -> dict[str, Any]:
    """The floor for the cached view job: the same job (a plain shuffle of every path,
    alone, no compute) over libfuse's passthrough_ll serving a copy of the dataset's
    files as a view's are served (direct I/O, no attributes cached:
    quiverfs.bench.floor.VIEW_PATCH), with no substitution: what the kernel and libfuse
    cost for such files with no cache logic at all."""
    binary = floor.build(workdir, view=True)
    if binary is None:
        log.warning("%s", floor.MISSING)
        return {"skipped": floor.MISSING}
    with floor.mounted(binary, backing, workdir, floor.VIEW_OPTIONS) as (root, _):
        spec = JobSpec("lru", root, 0, size.batch_size, 0.0, size.cached_epochs)
        with running_jobs(reading_job.__name__, {"floor-view": spec}, workdir,
                          EPOCH_TIMEOUT) as jobs:
            replies = [run_epoch(jobs, EPOCH_TIMEOUT)[0][0]
                       for _ in range(size.cached_epochs)]
            jobs[0].finish(JOB_STOP_TIMEOUT)
    return _epochs_read(replies)


def _epochs_read(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """A lone job's epoch seconds, and its items/s over the epochs after its first."""
    steady = replies[1:]
    return {"epoch_seconds": [round(r["seconds"], 3) for r in replies],
            "items_per_s": sum(len(r["paths"]) for r in steady)
            / sum(r["seconds"] for r in steady)}


def _each_epoch_once(counted: list[dict[str, int]], data: Dataset) -> bool:
    """Whether, by a view job's counters read after each of its unchecked epochs, each
    epoch opened every path once and ended one pass over every pool (a pass serves each
    of the pool's items once): what the checked epochs see by the served xattrs."""
    pools = len({_pool(path) for path in data.paths})
    return all(after[ViewJobCounter.OPENS] - before[ViewJobCounter.OPENS] == len(data.paths)
               and after[ViewJobCounter.PASSES] - before[ViewJobCounter.PASSES] == pools
               for before, after in zip(counted, counted[1:]))


# -- order statistics ------------------------------------------------------------------
def order_spearman(orders: list[list[list[str]]], data: Dataset) -> float:
    """Mean |Spearman correlation| between position in the epoch and index in the digest."""
    index = {p: i for i, p in enumerate(data.paths)}
    values = []
    for job in orders:
        for paths in job:
            ranks = np.argsort(np.argsort([index[p] for p in paths]))
            values.append(abs(float(np.corrcoef(np.arange(len(ranks)), ranks)[0, 1])))
    return float(np.mean(values))


def label_hist_dev(orders: list[list[list[str]]], data: Dataset, window: int) -> float:
    """Mean total variation distance between the label histogram of each window of
    ``window`` consecutive items of an epoch and the whole dataset's histogram."""
    names = sorted(set(data.labels))
    label_of = {p: names.index(lab) for p, lab in zip(data.paths, data.labels)}
    overall = np.bincount([label_of[p] for p in data.paths], minlength=len(names))
    overall = overall / overall.sum()
    values = []
    for job in orders:
        for paths in job:
            labels = np.array([label_of[p] for p in paths])
            for start in range(0, len(labels) - window + 1, window):
                hist = np.bincount(labels[start:start + window], minlength=len(names)) / window
                values.append(0.5 * float(np.abs(hist - overall).sum()))
    return float(np.mean(values))


# -- accuracy --------------------------------------------------------------------------
def write_digits_split(dest: str, seed: int = 0) -> int:
    """The digits as ``dest/train/<digit>/`` and ``dest/test/<digit>/`` (a seeded 80/20
    split); returns the total bytes."""
    everything = os.path.join(dest, "all")
    tree = write_digits_tree(everything)
    files = sorted(os.path.relpath(os.path.join(d, f), everything)
                   for d, _, fs in os.walk(everything) for f in fs)
    test = np.random.default_rng(seed).random(len(files)) < DIGITS_TEST_FRACTION
    for rel, is_test in zip(files, test):
        target = os.path.join(dest, "test" if is_test else "train", rel)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        os.rename(os.path.join(everything, rel), target)
    shutil.rmtree(everything)
    return tree.bytes


def stored_bytes(digest: bytes, workdir: str) -> int:
    """Bytes the store counts for the whole dataset (``used_bytes``, what ``cache-size``
    bounds: an item's bytes, identical items once), measured by caching all of it."""
    with running_mountd(workdir, cache_size="1G", name="footprint") as m:
        m.call({"op": "mount", "name": "d", "digest": digest, "emulator_host": None})
        root = os.path.join(m.root, "d")
        source = MountSource(root)
        with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
            sum(pool.map(source.read, source.paths()))
        used = int(m.status()["cache"]["used_bytes"])
    shutil.rmtree(os.path.join(workdir, "footprint-cache"), ignore_errors=True)
    return used


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """One training run on the digits, as its process gets it (JSON on its command line)."""

    mode: str  # "global", "sub" (QuiverBatchSampler) or "view" (a shuffle over a view)
    train: str  # the ImageFolder root of the training split (in the view, for "view")
    test: str  # the test split's, in the exact mount
    seed: int
    epochs: int
    step_s: float = ACCURACY_STEP_S


@contextlib.contextmanager
def trained(spec: TrainSpec) -> Iterator[dict[str, Any]]:
    """Train ``small_cnn`` on ``spec.train``; yield the test accuracy (%) on ``spec.test``
    and the sampler's job id (``sub``) while the sampler is still registered."""
    import torch
    import torchvision
    from torch import nn

    from quiverfs.bench.demo import small_cnn
    from quiverfs.torch import QuiverBatchSampler

    tf = torchvision.transforms.Compose([torchvision.transforms.Grayscale(),
                                         torchvision.transforms.ToTensor()])
    train = torchvision.datasets.ImageFolder(spec.train, transform=tf)
    test = torchvision.datasets.ImageFolder(spec.test, transform=tf)
    torch.manual_seed(spec.seed)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with contextlib.ExitStack() as stack:
        sampler = None
        if spec.mode == "sub":
            sampler = QuiverBatchSampler(train.root, ACCURACY_BATCH, seed=spec.seed,
                                         dataset=train)
            stack.callback(sampler.close)
            loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=2)
        else:  # a global shuffle; through a view, which substitutes within each label
            loader = torch.utils.data.DataLoader(
                train, batch_size=ACCURACY_BATCH, shuffle=True, num_workers=2,
                generator=torch.Generator().manual_seed(spec.seed))
        for epoch in range(spec.epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                time.sleep(spec.step_s)
        correct = 0
        with torch.no_grad():
            for x, y in torch.utils.data.DataLoader(test, batch_size=256, num_workers=2):
                correct += int((model(x).argmax(1) == y).sum())
        yield {"accuracy": 100.0 * correct / len(test),
               "job": sampler.job_id if sampler is not None else None}


def train_main(argv: list[str]) -> int:
    """One training run (``python -m quiverfs.bench.substitution SPEC``), in a process
    group of its own as a script started from a shell is (a view forgets a job once its
    process groups are gone): print its result as a JSON line, wait for a line on stdin
    (the parent reads mountd's counters of the job meanwhile), exit."""
    os.setpgid(0, 0)
    spec = TrainSpec(**json.loads(argv[0]))
    with trained(spec) as result:
        print(json.dumps(result), flush=True)
        sys.stdin.readline()
    return 0


def train_run(m: MountdProcess, spec: TrainSpec, workdir: str) -> dict[str, Any]:
    """One training run in a process of its own (``QUIVER_JOB`` names it to a view): its
    test accuracy, and mountd's counters of its job (sampler or view)."""
    name = f"digits-{spec.mode}-seed{spec.seed}"
    job = JobProcess(name, __name__, spec, os.path.join(workdir, f"job-{name}.log"),
                     {JOB_ENV: name})
    try:
        result = job.receive(EPOCH_TIMEOUT * spec.epochs)
        status = m.status()
        job.finish(JOB_STOP_TIMEOUT)
    finally:
        job.kill()
    if spec.mode == "sub":
        counters = next(j["counters"] for j in status["jobs"] if j["job"] == result["job"])
        return {"accuracy": result["accuracy"], "hits": counters.get(SamplerJobCounter.HITS),
                "fetched": counters.get(SamplerJobCounter.FETCHED)}
    if spec.mode == "view":
        counters = view_job_counters(status, DIGITS_VIEW, name)
        return {"accuracy": result["accuracy"], "hits": counters[ViewJobCounter.HITS],
                "opens": counters[ViewJobCounter.OPENS]}
    return {"accuracy": result["accuracy"]}


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
    """The mean and the sample standard deviation (None for one value)."""
    mean = float(np.mean(values))
    return mean, float(np.std(values, ddof=1)) if len(values) > 1 else None


def paired_gap(base: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """``base - other`` per seed, their mean and standard deviation, and the 95%
    confidence interval of the mean (Student t; None for one seed)."""
    gaps = [b - o for b, o in zip(base, other, strict=True)]
    mean, std = mean_std(gaps)
    ci = None
    if std is not None:
        half = T_975[min(len(gaps) - 1, len(T_975)) - 1] * std / math.sqrt(len(gaps))
        ci = [mean - half, mean + half]
    return {"per_seed": gaps, "mean": mean, "std": std, "ci95": ci}


def accuracy(size: Size, workdir: str) -> dict[str, Any]:
    """Test accuracy per seed with a global shuffle, substitutable batches and a
    substitutable view, the cache at the summary configuration's fraction of the
    digits; each mode's mean and spread, and its gap to the global shuffle by seed."""
    src = os.path.join(workdir, "digits")
    total = write_digits_split(src)
    digest = create_digest(src, "digits", workers=2)
    stored = stored_bytes(digest, workdir)
    cache_bytes = int(size.configs[0][0] * stored)
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in ACCURACY_MODES}
    start = time.monotonic()
    with running_mountd(workdir, cache_size=str(cache_bytes), name="digits",
                        extra_args=mountd_args()) as m:
        m.call({"op": "mount", "name": DIGITS, "digest": digest, "emulator_host": None})
        m.call({"op": "mount", "name": DIGITS_VIEW, "digest": digest, "emulator_host": None,
                "view": "substitutable"})
        test = os.path.join(m.root, DIGITS, "test")
        for seed in size.accuracy_seeds:
            for mode in ACCURACY_MODES:
                train = os.path.join(m.root, DIGITS_VIEW if mode == "view" else DIGITS,
                                     "train")
                spec = TrainSpec(mode, train, test, seed, size.accuracy_epochs)
                runs[mode].append({"seed": seed, **train_run(m, spec, workdir)})
    values = {mode: [r["accuracy"] for r in rs] for mode, rs in runs.items()}
    return {"dataset_bytes": total, "stored_bytes": stored, "cache_bytes": cache_bytes,
            "epochs": size.accuracy_epochs, "batch_size": ACCURACY_BATCH, "runs": runs,
            "modes": {mode: dict(zip(("mean", "std"), mean_std(v)))
                      for mode, v in values.items()},
            "gaps": {mode: paired_gap(values["global"], values[mode]) for mode in ("sub", "view")},
            "seconds": round(time.monotonic() - start, 1)}


def accuracy_summary(acc: dict[str, Any]) -> dict[str, float | None]:
    """The summary's accuracy keys: each mode's mean and standard deviation over the
    seeds, and the gaps to the global shuffle with the upper bounds of their 95% CIs."""
    def rounded(value: float | None) -> float | None:
        return None if value is None else round(value, 2)

    modes = acc["modes"]
    out = {f"accuracy_{mode}": rounded(modes[mode]["mean"]) for mode in ACCURACY_MODES}
    out.update({f"accuracy_{mode}_std": rounded(modes[mode]["std"]) for mode in ACCURACY_MODES})
    for mode, key in (("sub", "accuracy_gap"), ("view", "accuracy_gap_view")):
        gap = acc["gaps"][mode]
        out[key] = rounded(gap["mean"])
        out[f"{key}_ci95"] = rounded(gap["ci95"][1]) if gap["ci95"] else None
    return out


# -- the benchmark ---------------------------------------------------------------------
def run(quick: bool, workdir: str, size: str | None = None) -> dict[str, Any]:
    """The benchmark; ``size`` ("full", "quick", "tiny") overrides ``quick``."""
    s = SIZES[size or ("quick" if quick else "full")]
    configs: dict[tuple[str, float, int], ConfigRun] = {}
    with running_emulator(concurrent=True) as emulator:
        emulator.create_bucket(BUCKET)
        data = upload_synthetic(emulator.host, BUCKET, DATASET, workdir, s.items, s.classes,
                                seed=5)
        with throttled(emulator.host, BUCKET_RATE) as proxy:
            for k, (fraction, n_jobs) in enumerate(s.configs):
                for mode in ("sub", "lru", "view") if k == 0 else ("sub", "lru"):
                    configs[mode, fraction, n_jobs] = run_config(
                        mode, fraction, n_jobs, data, proxy, s, workdir)
            cached = run_cached(data, proxy, s, workdir)
    acc = accuracy(s, workdir)
    key_fraction, key_jobs = s.configs[0]
    sub, lru, view = (configs[mode, key_fraction, key_jobs] for mode in ("sub", "lru", "view"))
    summary = {
        "hit_ratio_sub": round(sub.report["steady"]["hit_ratio"], 4),
        "hit_ratio_lru": round(lru.report["steady"]["hit_ratio"], 4),
        "hit_ratio_view": round(view.report["steady"]["hit_ratio"], 4),
        "bucket_bytes_ratio_sub": round(sub.report["steady"]["bucket_bytes_ratio"], 3),
        "bucket_bytes_ratio_lru": round(lru.report["steady"]["bucket_bytes_ratio"], 3),
        "bucket_bytes_ratio_view": round(view.report["steady"]["bucket_bytes_ratio"], 3),
        "items_per_s_sub": round(sub.report["steady"]["items_per_s"], 1),
        "items_per_s_lru": round(lru.report["steady"]["items_per_s"], 1),
        "items_per_s_view": round(view.report["steady"]["items_per_s"], 1),
        "exactly_once": (all(c.report["exactly_once"] for c in configs.values()
                             if c.report["mode"] != "view")
                         and all(r["exactly_once"] for mode, r in cached["runs"].items()
                                 if mode != "view")),
        "exactly_once_view": (view.report["exactly_once"]
                              and cached["runs"]["view"]["exactly_once"]),
        "order_spearman_sub": round(order_spearman(sub.orders, data), 4),
        "order_spearman_global": round(order_spearman(lru.orders, data), 4),
        "label_hist_dev_sub": round(label_hist_dev(sub.orders, data, s.window), 4),
        "label_hist_dev_global": round(label_hist_dev(lru.orders, data, s.window), 4),
        **accuracy_summary(acc),
        "max_resident_chunks": sub.report["max_resident_chunks"],
        "sub_vs_exact_cached": round(cached["sub_vs_exact"], 3),
        "view_vs_exact_cached": round(cached["view_vs_exact"], 3),
        "view_vs_floor_cached": (None if cached["view_vs_floor"] is None
                                 else round(cached["view_vs_floor"], 3)),
    }
    return {
        "dataset": {"items": len(data.paths), "bytes": data.bytes,
                    "classes": len(set(data.labels))},
        "settings": {**dataclasses.asdict(s), "bucket_rate_bytes_s": BUCKET_RATE,
                     "readers_per_job": READERS, "prefetch_batches": PREFETCH_BATCHES,
                     "probe_batches": PROBE_BATCHES,
                     "cached_cache": CACHED_CACHE,
                     "accuracy_step_s": ACCURACY_STEP_S, "accuracy_modes": ACCURACY_MODES,
                     "summary_config": {"jobs": key_jobs, "cache_fraction": key_fraction}},
        "definitions": {
            "hit_ratio": "steady state (epochs after the first), mean over jobs; sub: the "
                         "manifests' hits / items; view: mountd's view_jobs counters, hits / "
                         "opens of each job (an open served an item that was cached when "
                         "chosen); lru: mountd's local_hits / (local_hits + misses)",
            "read_hit_ratio": "mountd's local_hits / all reads of the jobs (what the manifests "
                              "listed as hits may have been evicted before the read)",
            "bucket_bytes_ratio": "mountd's bucket_bytes per steady-state epoch, all jobs, "
                                  "/ dataset bytes (proxy_bytes_ratio: bytes through the "
                                  "proxy, HTTP included)",
            "items_per_s": "items read by all jobs / wall seconds, steady-state epochs",
            "bucket_fetch_causes": "mountd's bucket fetches of the dataset by cause over "
                                   "the configuration's whole run: {cause: {fetches, bytes}}",
            "exactly_once": "every sub and lru job read every item once per epoch, in every "
                            "configuration and in the cached one",
            "exactly_once_view": "through the view, in every job-epoch the items served "
                                 "(user.quiver.served.path of each open file) were every "
                                 "item once, each of the opened path's label (directory "
                                 "and extension), with the digest's SHA-256 as "
                                 "user.quiver.served.sha256 said, and the bytes read hashed "
                                 "to it (configs[view].served_check counts the failures); "
                                 "and the cached view job was served every item once an "
                                 "epoch",
            "order_spearman": "mean |Spearman rho| of (position in epoch, digest index) over "
                              "job-epochs; global = the lru jobs' plain global shuffle",
            "label_hist_dev": f"mean total variation distance between the label histogram "
                              f"of each {s.window}-item window of an epoch and the dataset's",
            "accuracy": "mean test accuracy (%) of small_cnn on a held-out 20% of the "
                        "digits (read exactly), over the seeds; global: DataLoader("
                        "shuffle=True) over the exact mount; sub: QuiverBatchSampler; view: "
                        "DataLoader(shuffle=True) over a substitutable view of the same "
                        "digest; _std: sample standard deviation over the seeds",
            "accuracy_gap": "mean over the seeds of global - sub (accuracy_gap_view: "
                            "global - view), paired by seed; _ci95: the upper bound of its "
                            "95% confidence interval (Student t, seeds - 1 degrees of "
                            "freedom; null with one seed)",
            "sub_vs_exact_cached": "items/s of a sub job over an lru job (exact reads), "
                                   "their epochs taken in turn, each alone with no "
                                   "compute, the whole dataset cached (allotted full), "
                                   "epochs after each job's first",
            "view_vs_exact_cached": "the same for a view job (a plain shuffle of every "
                                    "path, read through a substitutable view of the "
                                    "dataset) over the lru job",
            "view_vs_floor_cached": "the view job's items/s over the same job's on "
                                    "libfuse's passthrough_ll serving a copy of the files "
                                    "as a view's are served (direct I/O, attributes not "
                                    "cached; quiverfs.bench.floor): null where it cannot "
                                    "be built"},
        "configs": [c.report for c in configs.values()],
        "cached": cached,
        "accuracy": acc,
        "summary": summary,
    }


if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))

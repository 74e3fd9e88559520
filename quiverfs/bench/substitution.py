"""``quiver bench substitution``: substitutable reads against exact (LRU) reads.

Single node, one mountd per configuration, the cache at 10% or 20% of a synthetic
ImageFolder dataset kept in the GCS emulator behind a bandwidth-capped proxy
(``throttle_proxy``), so the "bucket" is slower than the local cache, as a shared
bucket is. Each job is a separate process (``reading_job``) reading through the real
mount:

- ``sub``: batches from ``QuiverBatchSampler`` (iterated as a DataLoader does; one job
  per process, each its own seed, world size 1);
- ``lru``: the job's own seeded permutation of the same files (a plain global shuffle,
  exact reads; the store evicts least-recently-used).

A job reads each batch's files with a few threads (like DataLoader workers, one batch
ahead), drops their pages from the kernel's cache, and sleeps a simulated compute time
per batch. The parent holds all jobs at every epoch boundary, so mountd's counters can
be read per epoch; epoch 0 (cold cache) is left out of the steady-state numbers.

A small extra configuration, ``cached``, measures what substitution costs where there
is nothing to substitute: a cache that holds the whole dataset (allotted ``full``),
every item read once beforehand, then one ``sub`` job and one ``lru`` job in turn, with
no compute. ``sub_vs_exact_cached`` is the first's items/s over the second's, after
each job's warm-up epoch.

Then a small CNN (``quiverfs.bench.demo.small_cnn``) is trained on the scikit-learn
digits over a real mount, with a global shuffle and with ``QuiverBatchSampler``, and its
test accuracy on a held-out split compared.
"""
from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import shutil
import time
from typing import Any

import numpy as np

from digest_tools.create import create_digest
from quiverfs.bench.bucket_dataset import Dataset, upload_synthetic
from quiverfs.bench.data import write_digits_tree
from quiverfs.bench.emulator import running_emulator
from quiverfs.bench.job_child import run_epoch, running_jobs
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench import fetch_causes, reading_job
from quiverfs.bench.reading_job import PREFETCH_BATCHES, READERS, JobSpec, MountSource
from quiverfs.bench.throttle_proxy import ThrottleProxy, throttled

log = logging.getLogger(__name__)

BUCKET = "bench"
DATASET = "syn"
BUCKET_RATE = 20e6  # bytes/s the proxy lets through from the bucket (all connections)
# Chunks of 40% of the cache: two (double buffering) fit with room for cooperative
# fetches. mountd's default, 10% of the dataset, does not fit twice in a 10% or 20%
# cache, and the allocation then gives substitutable jobs no cache at all.
CHUNK_OF_CACHE = 0.4
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
# longer per batch than reading it (the small CNN on 8x8 images takes ~1 ms).
ACCURACY_STEP_S = 0.1


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
    "full": Size(1200, 10, 3, 8, 0.125, ((0.2, 4), (0.1, 4), (0.2, 1)), 1000, (0, 1, 2), 3, 21),
    "quick": Size(300, 10, 3, 8, 0.125, ((0.2, 4),), 100, (0,), 1, 11),
    "tiny": Size(120, 10, 3, 8, 0.02, ((0.5, 2),), 30, (0,), 1, 2),
}


# -- the parent: one configuration -----------------------------------------------------
def mountd_args(chunk_bytes: int) -> tuple[str, ...]:
    """mountd's options for a run: no probing, chunks of ``chunk_bytes`` item bytes."""
    return ("--probe-batches", str(PROBE_BATCHES), "--chunk-size", str(chunk_bytes))


@dataclasses.dataclass
class ConfigRun:
    """What one configuration measured: per-epoch records, and each job's epoch orders."""

    report: dict[str, Any]
    orders: list[list[list[str]]]  # job -> epoch -> paths in the order read


def _snapshot(m: MountdProcess, proxy: ThrottleProxy) -> dict[str, int]:
    status = m.status()
    counters = next(ds["counters"] for ds in status["datasets"] if ds["name"] == DATASET)
    keys = ("local_hits", "misses", "probe_misses", "bucket_fetches", "bucket_bytes",
            "coalesced")
    return {**{k: int(counters.get(k, 0)) for k in keys}, "proxy_bytes": proxy.bytes_down}


def _epoch_record(epoch: int, seconds: float, replies: list[dict[str, Any]],
                  before: dict[str, int], after: dict[str, int]) -> dict[str, Any]:
    items = [len(r["paths"]) for r in replies]
    return {"epoch": epoch, "seconds": round(seconds, 2), "items": sum(items),
            "job_seconds": [round(r["seconds"], 2) for r in replies],
            "job_hits": [r["hits"] for r in replies], "job_items": items,
            "job_manifest_s": [round(r["manifest_s"], 2) for r in replies],
            "bytes_read": sum(r["bytes"] for r in replies),
            **{k: after[k] - before[k] for k in after}}


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
    if mode == "sub":
        per_job = [sum(e["job_hits"][j] for e in steady) / sum(e["job_items"][j] for e in steady)
                   for j in range(len(steady[0]["job_hits"]))]
        out["hit_ratio_per_job"] = per_job
        out["hit_ratio"] = sum(per_job) / len(per_job)
    else:
        out["hit_ratio"] = read_hit_ratio  # mountd's counters: one dataset, all jobs
    return out


def run_config(mode: str, fraction: float, n_jobs: int, data: Dataset, proxy: ThrottleProxy,
               size: Size, workdir: str) -> ConfigRun:
    """One mountd with the cache at ``fraction`` of the dataset, ``n_jobs`` jobs of ``mode``."""
    name = f"{mode}-{round(fraction * 100)}pct-{n_jobs}jobs"
    cache_bytes = int(fraction * data.bytes)
    extra = mountd_args(int(CHUNK_OF_CACHE * cache_bytes))
    log.info("%s: cache %d bytes, mountd %s", name, cache_bytes, " ".join(extra))
    epochs: list[dict[str, Any]] = []
    orders: list[list[list[str]]] = [[] for _ in range(n_jobs)]
    with running_mountd(workdir, cache_size=str(cache_bytes), name=name, extra_args=extra) as m:
        m.call({"op": "mount", "name": DATASET, "digest": data.digest,
                "emulator_host": proxy.url})
        root = os.path.join(m.root, DATASET)
        specs = {f"{seed}-{mode}": JobSpec(mode, root, seed, size.batch_size, size.compute_s,
                                           size.epochs) for seed in range(n_jobs)}
        with running_jobs(reading_job.__name__, specs, workdir, EPOCH_TIMEOUT) as jobs:
            for epoch in range(size.epochs):
                before = _snapshot(m, proxy)
                replies, seconds = run_epoch(jobs, EPOCH_TIMEOUT)
                epochs.append(_epoch_record(epoch, seconds, replies, before,
                                            _snapshot(m, proxy)))
                for j, reply in enumerate(replies):
                    orders[j].append(reply["paths"])
            status = m.status()
            for job in jobs:
                job.finish(JOB_STOP_TIMEOUT)
    shutil.rmtree(os.path.join(workdir, f"{name}-cache"), ignore_errors=True)
    chunks = [j["chunks"] for j in status["jobs"] if j.get("chunks")]
    expected = sorted(data.paths)
    report = {"mode": mode, "cache_fraction": fraction, "cache_bytes": cache_bytes,
              "jobs": n_jobs, "bucket_fetch_causes": fetch_causes.of_dataset(status, DATASET),
              "epochs": epochs,
              "steady": _steady_state(mode, epochs, data.bytes),
              "exactly_once": all(sorted(paths) == expected
                                  for job in orders for paths in job),
              "chunks": chunks[0]["chunks"] if chunks else None,
              "cache_mode": chunks[0].get("mode") if chunks else None,
              # a job whose dataset group never heard from the coordinator gets no hits
              "jobs_without_cycle": sum(j.get("chunks") is None for j in status["jobs"]),
              "max_resident_chunks": max((c["max_resident"] for c in chunks), default=None)}
    return ConfigRun(report, orders)


def run_cached(data: Dataset, proxy: ThrottleProxy, size: Size, workdir: str
               ) -> dict[str, Any]:
    """The cached configuration: a ``sub`` job, then an ``lru`` job, each alone with no
    compute, on one mountd whose cache holds the whole dataset, read once beforehand."""
    cache_bytes = int(CACHED_CACHE * data.bytes)
    runs: dict[str, dict[str, Any]] = {}
    with running_mountd(workdir, cache_size=str(cache_bytes), name="cached",
                        extra_args=("--probe-batches", str(PROBE_BATCHES))) as m:
        m.call({"op": "mount", "name": DATASET, "digest": data.digest,
                "emulator_host": proxy.url})
        root = os.path.join(m.root, DATASET)
        source = MountSource(root)
        with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
            sum(pool.map(source.read, source.paths()))
        for mode in ("sub", "lru"):
            spec = JobSpec(mode, root, 0, size.batch_size, 0.0, size.cached_epochs)
            with running_jobs(reading_job.__name__, {f"cached-{mode}": spec}, workdir,
                              EPOCH_TIMEOUT) as jobs:
                replies = [run_epoch(jobs, EPOCH_TIMEOUT)[0][0]]  # the warm-up
                if mode == "sub":  # it told the coordinator of the job: it allots full
                    _wait_for_full(m)
                replies += [run_epoch(jobs, EPOCH_TIMEOUT)[0][0]
                            for _ in range(size.cached_epochs - 1)]
                status = m.status()
                jobs[0].finish(JOB_STOP_TIMEOUT)
            steady = replies[1:]
            job = next((j for j in status["jobs"] if j["job"] == jobs[0].job_id), None)
            runs[mode] = {
                "epoch_seconds": [round(r["seconds"], 3) for r in replies],
                "items_per_s": sum(len(r["paths"]) for r in steady)
                / sum(r["seconds"] for r in steady),
                "exactly_once": all(sorted(r["paths"]) == sorted(data.paths)
                                    for r in replies),
                "counters": job["counters"] if job else None,
                "cache_mode": job["chunks"]["mode"] if job and job["chunks"] else None}
    shutil.rmtree(os.path.join(workdir, "cached-cache"), ignore_errors=True)
    return {"cache_bytes": cache_bytes, "epochs": size.cached_epochs, "runs": runs,
            "sub_vs_exact": runs["sub"]["items_per_s"] / runs["lru"]["items_per_s"]}


def _wait_for_full(m: MountdProcess) -> None:
    """Wait until mountd's one dataset is allotted ``full`` (the cached configuration
    measures that mode: its first epoch may run before the allotment)."""
    deadline = time.monotonic() + MODE_TIMEOUT
    while True:
        cycles = m.call({"op": "cluster"})["cycles"]
        if any(c["mode"] == "full" for c in cycles.values()):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cached dataset was not allotted full within "
                               f"{MODE_TIMEOUT:g} s: {cycles}")
        time.sleep(0.1)


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
    """Bytes the store uses for the whole dataset. Items under 32 KiB live in SQLite,
    whose rows cost more than the 120-byte digits themselves, so a cache sized from the
    dataset's bytes would hold far fewer items than that fraction."""
    with running_mountd(workdir, cache_size="1G", name="footprint") as m:
        m.call({"op": "mount", "name": "d", "digest": digest, "emulator_host": None})
        root = os.path.join(m.root, "d")
        source = MountSource(root)
        with concurrent.futures.ThreadPoolExecutor(READERS) as pool:
            sum(pool.map(source.read, source.paths()))
        used = int(m.status()["cache"]["used_bytes"])
    shutil.rmtree(os.path.join(workdir, "footprint-cache"), ignore_errors=True)
    return used


def train_digits(root: str, seed: int, epochs: int, substitutable: bool,
                 m: MountdProcess, step_s: float = ACCURACY_STEP_S) -> dict[str, Any]:
    """Train ``small_cnn`` on ``root/train`` (global shuffle, or QuiverBatchSampler);
    return the test accuracy (%) on ``root/test`` and the sampler's hit counters."""
    import torch
    import torchvision
    from torch import nn

    from quiverfs.bench.demo import small_cnn
    from quiverfs.torch import QuiverBatchSampler

    tf = torchvision.transforms.Compose([torchvision.transforms.Grayscale(),
                                         torchvision.transforms.ToTensor()])
    train = torchvision.datasets.ImageFolder(os.path.join(root, "train"), transform=tf)
    test = torchvision.datasets.ImageFolder(os.path.join(root, "test"), transform=tf)
    torch.manual_seed(seed)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = None
    if substitutable:
        sampler = QuiverBatchSampler(train.root, ACCURACY_BATCH, seed=seed, dataset=train)
        loader = torch.utils.data.DataLoader(train, batch_sampler=sampler, num_workers=2)
    else:
        loader = torch.utils.data.DataLoader(
            train, batch_size=ACCURACY_BATCH, shuffle=True, num_workers=2,
            generator=torch.Generator().manual_seed(seed))
    counters: dict[str, int] = {}
    try:
        for epoch in range(epochs):
            if sampler is not None:
                sampler.set_epoch(epoch)
            for x, y in loader:
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
                time.sleep(step_s)
        if sampler is not None:
            counters = next(j["counters"] for j in m.status()["jobs"]
                            if j["job"] == sampler.job_id)
    finally:
        if sampler is not None:
            sampler.close()
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(test, batch_size=256, num_workers=2):
            correct += int((model(x).argmax(1) == y).sum())
    return {"accuracy": 100.0 * correct / len(test),
            "hits": counters.get("hits"), "fetched": counters.get("fetched")}


def accuracy(size: Size, workdir: str) -> dict[str, Any]:
    """Test accuracy with a global shuffle and with substitutable batches, the cache at
    the summary configuration's fraction of the digits."""
    src = os.path.join(workdir, "digits")
    total = write_digits_split(src)
    digest = create_digest(src, "digits", workers=2)
    stored = stored_bytes(digest, workdir)
    cache_bytes = int(size.configs[0][0] * stored)
    runs: dict[str, list[dict[str, Any]]] = {"global": [], "sub": []}
    start = time.monotonic()
    chunk_bytes = int(CHUNK_OF_CACHE * size.configs[0][0] * total)  # in item bytes
    with running_mountd(workdir, cache_size=str(cache_bytes), name="digits",
                        extra_args=mountd_args(chunk_bytes)) as m:
        m.call({"op": "mount", "name": "digits", "digest": digest, "emulator_host": None})
        root = os.path.join(m.root, "digits")
        for seed in size.accuracy_seeds:
            for mode in runs:
                runs[mode].append({"seed": seed, **train_digits(
                    root, seed, size.accuracy_epochs, mode == "sub", m)})
    means = {mode: float(np.mean([r["accuracy"] for r in rs])) for mode, rs in runs.items()}
    return {"dataset_bytes": total, "stored_bytes": stored, "cache_bytes": cache_bytes,
            "epochs": size.accuracy_epochs, "batch_size": ACCURACY_BATCH, "runs": runs,
            "accuracy_global": means["global"], "accuracy_sub": means["sub"],
            "seconds": round(time.monotonic() - start, 1)}


# -- the benchmark ---------------------------------------------------------------------
def run(quick: bool, workdir: str, size: str | None = None) -> dict[str, Any]:
    """The benchmark; ``size`` ("full", "quick", "tiny") overrides ``quick``."""
    s = SIZES[size or ("quick" if quick else "full")]
    configs: dict[tuple[str, float, int], ConfigRun] = {}
    with running_emulator() as emulator:
        emulator.create_bucket(BUCKET)
        data = upload_synthetic(emulator.host, BUCKET, DATASET, workdir, s.items, s.classes,
                                seed=5)
        with throttled(emulator.host, BUCKET_RATE) as proxy:
            for fraction, n_jobs in s.configs:
                for mode in ("sub", "lru"):
                    configs[mode, fraction, n_jobs] = run_config(
                        mode, fraction, n_jobs, data, proxy, s, workdir)
            cached = run_cached(data, proxy, s, workdir)
    acc = accuracy(s, workdir)
    key_fraction, key_jobs = s.configs[0]
    sub, lru = (configs[mode, key_fraction, key_jobs] for mode in ("sub", "lru"))
    summary = {
        "hit_ratio_sub": round(sub.report["steady"]["hit_ratio"], 4),
        "hit_ratio_lru": round(lru.report["steady"]["hit_ratio"], 4),
        "bucket_bytes_ratio_sub": round(sub.report["steady"]["bucket_bytes_ratio"], 3),
        "bucket_bytes_ratio_lru": round(lru.report["steady"]["bucket_bytes_ratio"], 3),
        "items_per_s_sub": round(sub.report["steady"]["items_per_s"], 1),
        "items_per_s_lru": round(lru.report["steady"]["items_per_s"], 1),
        "exactly_once": (all(c.report["exactly_once"] for c in configs.values())
                         and all(r["exactly_once"] for r in cached["runs"].values())),
        "order_spearman_sub": round(order_spearman(sub.orders, data), 4),
        "order_spearman_global": round(order_spearman(lru.orders, data), 4),
        "label_hist_dev_sub": round(label_hist_dev(sub.orders, data, s.window), 4),
        "label_hist_dev_global": round(label_hist_dev(lru.orders, data, s.window), 4),
        "accuracy_global": round(acc["accuracy_global"], 2),
        "accuracy_sub": round(acc["accuracy_sub"], 2),
        "accuracy_gap": round(acc["accuracy_global"] - acc["accuracy_sub"], 2),
        "max_resident_chunks": sub.report["max_resident_chunks"],
        "sub_vs_exact_cached": round(cached["sub_vs_exact"], 3),
    }
    return {
        "dataset": {"items": len(data.paths), "bytes": data.bytes,
                    "classes": len(set(data.labels))},
        "settings": {**dataclasses.asdict(s), "bucket_rate_bytes_s": BUCKET_RATE,
                     "readers_per_job": READERS, "prefetch_batches": PREFETCH_BATCHES,
                     "chunk_of_cache": CHUNK_OF_CACHE, "probe_batches": PROBE_BATCHES,
                     "cached_cache": CACHED_CACHE,
                     "accuracy_step_s": ACCURACY_STEP_S,
                     "summary_config": {"jobs": key_jobs, "cache_fraction": key_fraction}},
        "definitions": {
            "hit_ratio": "steady state (epochs after the first), mean over jobs; sub: the "
                         "manifests' hits / items; lru: mountd's local_hits / (local_hits + "
                         "misses)",
            "read_hit_ratio": "mountd's local_hits / all reads of the jobs (what the manifests "
                              "listed as hits may have been evicted before the read)",
            "bucket_bytes_ratio": "mountd's bucket_bytes per steady-state epoch, all jobs, "
                                  "/ dataset bytes (proxy_bytes_ratio: bytes through the "
                                  "proxy, HTTP included)",
            "items_per_s": "items read by all jobs / wall seconds, steady-state epochs",
            "bucket_fetch_causes": "mountd's bucket fetches of the dataset by cause over "
                                   "the configuration's whole run: {cause: {fetches, bytes}}",
            "order_spearman": "mean |Spearman rho| of (position in epoch, digest index) over "
                              "job-epochs; global = the lru jobs' plain global shuffle",
            "label_hist_dev": f"mean total variation distance between the label histogram "
                              f"of each {s.window}-item window of an epoch and the dataset's",
            "accuracy": "mean test accuracy (%) of small_cnn on a held-out 20% of the "
                        "digits, over the seeds; gap = global - sub",
            "sub_vs_exact_cached": "items/s of a sub job over an lru job (exact reads), "
                                   "each alone with no compute, the whole dataset cached "
                                   "(allotted full), epochs after each job's first"},
        "configs": [c.report for c in configs.values()],
        "cached": cached,
        "accuracy": acc,
        "summary": summary,
    }

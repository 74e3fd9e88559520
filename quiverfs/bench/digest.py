"""``quiver bench digest``: loading an ImageNet-sized digest, and hashing throughput.

Load: a synthetic digest with ImageNet-1k-like paths (fabricated hashes and sizes; this
part measures loading, not hashing) is loaded in fresh subprocesses; each reports the
wall time of ``quiverfs.digest.load`` and its own peak RSS.

Hashing: real JPEG files (``quiverfs.bench.data.write_synthetic_tree``) are read once
to warm the page cache, then digested with one worker per CPU. The ratio compares that
throughput with single-core ``hashlib.sha256`` on in-memory data times the workers.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import subprocess
import sys
import threading
import time

from digest_tools.create import create_digest
from quiverfs import digest as digest_format
from quiverfs.bench.cpu_time import BackgroundCpu
from quiverfs.bench.data import synthetic_sizes, write_synthetic_tree

log = logging.getLogger(__name__)

ENTRIES = {False: 1_300_000, True: 100_000}  # by --quick
HASH_BYTES = {False: 1 << 30, True: 128 << 20}
CLASSES = 1000  # ImageNet-1k
LOAD_RUNS = 3
HASH_RUNS = 5
MEMORY_HASH_BYTES = 64 << 20  # in-memory buffer for the single-core baseline
SEED = 0

# Runs in a fresh interpreter so that the RSS is that of loading alone.
# VmHWM, unlike ru_maxrss, starts afresh at exec (ru_maxrss keeps the parent's).
_LOAD_CHILD = """
import json, sys, time
from quiverfs import digest
def kib(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))
before = kib("VmRSS")
started = time.perf_counter()
d = digest.load(sys.argv[1])
seconds = time.perf_counter() - started
print(json.dumps({"entries": len(d), "seconds": seconds, "rss_before_mb": before / 1024,
                  "peak_rss_mb": kib("VmHWM") / 1024}))
"""


def imagenet_like_items(n: int) -> list[digest_format.NewItem]:
    """``n`` items named like ImageNet's (``n01440764/n01440764_10026.JPEG``) in 1000 classes."""
    wnids = [f"n{1440764 + 9973 * c:08d}" for c in range(CLASSES)]
    items = []
    for i, size in enumerate(synthetic_sizes(n, SEED).tolist()):
        wnid = wnids[i % CLASSES]
        path = f"{wnid}/{wnid}_{10000 + i // CLASSES}.JPEG"
        items.append(digest_format.NewItem(path, hashlib.sha256(path.encode()).digest(), size))
    return items


def measure_load(entries: int, workdir: str) -> dict:
    """Write an ``entries``-item digest, then load it in fresh processes (warm page cache)."""
    log.info("building a %d-entry digest", entries)
    started = time.perf_counter()
    data = digest_format.encode("imagenet-like", "gs://bench/train", imagenet_like_items(entries))
    build_seconds = time.perf_counter() - started
    path = os.path.join(workdir, "imagenet-like.qd")
    digest_format.write_atomic(path, data)
    runs = []
    for _ in range(LOAD_RUNS):
        out = subprocess.run([sys.executable, "-c", _LOAD_CHILD, path], check=True,
                             capture_output=True, text=True)
        runs.append(json.loads(out.stdout))
    if any(r["entries"] != entries for r in runs):
        raise RuntimeError(f"loaded {runs[0]['entries']} entries, wrote {entries}")
    return {"entries": entries, "file_mb": round(len(data) / 2**20, 1),
            "build_seconds": round(build_seconds, 2),
            "load_seconds_runs": [round(r["seconds"], 3) for r in runs],
            "load_seconds": round(statistics.median(r["seconds"] for r in runs), 3),
            "peak_rss_mb": round(max(r["peak_rss_mb"] for r in runs), 1),
            "rss_before_load_mb": round(max(r["rss_before_mb"] for r in runs), 1),
            "page_cache": "warm (file just written)"}


def memory_sha256(threads: int) -> float:
    """Bytes/s of ``threads`` threads each hashing in-memory data at once (best of 5).

    With one thread this is the single-core baseline; with more it shows how far the
    machine's cores scale at all, before any file is read.
    """
    buf = os.urandom(MEMORY_HASH_BYTES)
    best = 0.0
    for _ in range(5):
        pool = [threading.Thread(target=hashlib.sha256, args=(buf,)) for _ in range(threads)]
        started = time.perf_counter()
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        best = max(best, threads * len(buf) / (time.perf_counter() - started))
    return best


def _read_all(root: str) -> int:
    total = 0
    for d, _, names in os.walk(root):
        for name in names:
            with open(os.path.join(d, name), "rb") as f:
                total += len(f.read())
    return total


def _time_create(root: str, workers: int) -> dict:
    runs = []
    for _ in range(HASH_RUNS):
        with BackgroundCpu() as bg:
            started = time.perf_counter()
            create_digest(root, "bench", workers)
            seconds = time.perf_counter() - started
        runs.append({"seconds": round(seconds, 3), "background_cpu_cores": round(bg.cores, 2)})
    return {"workers": workers, "runs": runs,
            "best_seconds": min(r["seconds"] for r in runs)}


def measure_hashing(total_bytes: int, workdir: str) -> dict:
    """Digest real files with one worker per CPU (and one), against in-memory hashing."""
    log.info("writing %d MiB of JPEGs", total_bytes >> 20)
    tree = write_synthetic_tree(os.path.join(workdir, "tree"), max(10, total_bytes // 110_000),
                                n_classes=100, seed=SEED)
    os.sync()  # so that writeback does not compete with the measurement
    if _read_all(tree.root) != tree.bytes:  # also warms the page cache
        raise RuntimeError("the synthetic tree changed while being read")
    workers = os.cpu_count() or 1
    single = memory_sha256(1)
    memory_parallel = memory_sha256(workers)
    parallel = _time_create(tree.root, workers)
    serial = _time_create(tree.root, 1)
    throughput = tree.bytes / parallel["best_seconds"]
    return {"files": tree.files, "bytes": tree.bytes, "mean_file_kb": round(
            tree.bytes / tree.files / 1000, 1), "page_cache": "warm (every file read once first)",
            "single_core_sha256_mb_s": round(single / 1e6), "workers": workers,
            "memory_sha256_all_workers_mb_s": round(memory_parallel / 1e6),
            "memory_scaling_ratio": round(memory_parallel / (single * workers), 3),
            "digest_mb_s": round(throughput / 1e6),
            "one_worker_mb_s": round(tree.bytes / serial["best_seconds"] / 1e6),
            "hash_throughput_ratio": round(throughput / (single * workers), 3),
            "one_worker_ratio": round(tree.bytes / serial["best_seconds"] / single, 3),
            "parallel": parallel, "one_worker": serial}


def run(quick: bool, workdir: str) -> dict:
    """The report for ``quiver bench digest``; ``summary`` holds the headline numbers."""
    load = measure_load(ENTRIES[quick], workdir)
    hashing = measure_hashing(HASH_BYTES[quick], workdir)
    return {"summary": {"entries": load["entries"], "load_seconds": load["load_seconds"],
                        "peak_rss_mb": load["peak_rss_mb"],
                        "hash_throughput_ratio": hashing["hash_throughput_ratio"]},
            "goals": {"load_seconds": "< 2 at 1.3 M entries", "peak_rss_mb": "< 300",
                      "hash_throughput_ratio": ">= 0.8"},
            "load": load, "hashing": hashing,
            "method": "load: median of fresh-process loads; hashing: best of "
                      f"{HASH_RUNS} create_digest runs (walk + hash + encode) with a warm "
                      "page cache, against the best of 5 in-memory sha256 runs; "
                      "background_cpu_cores is CPU other processes used meanwhile"}

"""``quiver bench read``: exact reads through the mount against reading the source directly.

Warm (every item already in mountd's store), three ways, each against reading the
same files from a local directory with the same number of threads:

- ``ssd`` (the headline ``warm_ratio_N``): no page cache on either side; local files and
  the store's files are dropped from it with posix_fadvise(DONTNEED) and the dataset is
  mounted afresh. Both sides read the SSD, as with a dataset larger than RAM.
- ``store``: the store's files are in the page cache, the mount's pages are not (a fresh
  mount name): what mountd's own read path costs.
- ``hot``: both sides in the page cache; the mount's pages kept by the kernel
  (``keep_cache``) from a previous pass.

Cold: an empty store, items behind the GCS emulator; the baseline reads the bucket with
the google-cloud-storage client, same number of threads.

Each warm pass also counts the FUSE requests mountd received per file, by opcode; the
headline ``fuse_requests_per_file`` is the ``hot`` pass at 16 threads (the second pass
over the same mounted files). Both report mountd's bucket fetches by cause
(``bucket_fetch_causes``: its whole run).
"""
from __future__ import annotations

import concurrent.futures
import os
import random
import shutil
import time
from collections import Counter

from digest_tools.create import create_digest
from quiverfs.backends import StorageOptions, open_backend
from quiverfs.bench.cpu_time import process_cpu_seconds
from quiverfs.bench.data import write_synthetic_tree
from quiverfs.bench.emulator import running_emulator, upload_tree
from quiverfs.bench.processes import MountdProcess, running_mountd

FULL_ITEMS, QUICK_ITEMS = 19_000, 1_500  # x 110 KB: 2.1 GB and 165 MB
COLD_FULL, COLD_QUICK = 2_000, 300  # items uploaded to the emulator (uploads are slow there)
THREADS = (4, 16)


def _read_file(path: str) -> int:
    with open(path, "rb", buffering=0) as f:
        return len(f.read())


def read_all(paths: list[str], threads: int, reader=_read_file) -> tuple[int, float]:
    """Read every path with ``threads`` threads; return (bytes, seconds)."""
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(reader, paths, chunksize=16))
    return total, time.perf_counter() - start


def _remount(m: MountdProcess, data: bytes, name: str, host: str | None = None) -> str:
    """Register ``data`` under a fresh name: new inodes, so no kernel page cache."""
    m.call({"op": "mount", "name": name, "digest": data, "emulator_host": host})
    return os.path.join(m.root, name)


def drop_page_cache(paths: list[str]) -> None:
    """Evict files' clean pages from the page cache (no privileges needed)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _files_under(directory: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]


def _requests(m: MountdProcess) -> Counter[str]:
    return Counter(m.status()["fuse_requests"])


def _compare(direct: list[str], mounted: list[str], threads: int, m: MountdProcess) -> dict:
    direct_bytes, direct_s = read_all(direct, threads)
    requests0 = _requests(m)
    cpu0 = process_cpu_seconds(m.proc.pid)
    mount_bytes, mount_s = read_all(mounted, threads)
    cpu = process_cpu_seconds(m.proc.pid) - cpu0
    if mount_bytes != direct_bytes:
        raise RuntimeError("the mount returned a different number of bytes")
    time.sleep(0.2)  # the kernel sends RELEASE after close returns
    requests = _requests(m) - requests0
    return {"direct_mb_s": round(direct_bytes / direct_s / 1e6, 1),
            "mount_mb_s": round(mount_bytes / mount_s / 1e6, 1),
            "ratio": round(direct_s / mount_s, 3), "mountd_cpu_s": round(cpu, 2),
            "cpu_s_per_gb": round(cpu / (mount_bytes / 1e9), 3),
            "fuse_requests_per_file": round(sum(requests.values()) / len(mounted), 3),
            "fuse_requests": {op: round(n / len(mounted), 3)
                              for op, n in sorted(requests.items())}}


def _warm(src: str, rels: list[str], data: bytes, size: int, workdir: str) -> dict:
    direct = [os.path.join(src, r) for r in rels]
    out: dict = {"ssd": {}, "store": {}, "hot": {}}
    with running_mountd(workdir, cache_size=str(size * 2 + (64 << 20)), name="warm") as m:
        store_dir = os.path.join(m.cache_dir, "store")
        fill = _remount(m, data, "fill")
        read_all([os.path.join(fill, r) for r in rels], 16)
        for threads in THREADS:
            drop_page_cache(direct)
            drop_page_cache(_files_under(store_dir))
            root = _remount(m, data, f"ssd{threads}")
            mounted = [os.path.join(root, r) for r in rels]
            out["ssd"][threads] = _compare(direct, mounted, threads, m)
            # the store's files are in the page cache now; a fresh name has no pages
            root = _remount(m, data, f"store{threads}")
            out["store"][threads] = _compare(direct, [os.path.join(root, r) for r in rels],
                                             threads, m)
            # the ssd pass left that mount's pages in the kernel
            out["hot"][threads] = _compare(direct, mounted, threads, m)
        out["bucket_fetch_causes"] = m.status()["bucket_fetch_causes"]
    return out


def run(quick: bool, workdir: str) -> dict:
    n_items = QUICK_ITEMS if quick else FULL_ITEMS
    src = os.path.join(workdir, "src")
    tree = write_synthetic_tree(src, n_items, n_classes=100, seed=11)
    data = create_digest(src, "syn", workers=os.cpu_count() or 1)
    rels = [os.path.relpath(os.path.join(d, f), src) for d, _, fs in os.walk(src) for f in fs]
    random.Random(0).shuffle(rels)
    report: dict = {"dataset": {"items": tree.files, "bytes": tree.bytes},
                    "warm": _warm(src, rels, data, tree.bytes, workdir)}
    shutil.rmtree(os.path.join(workdir, "warm-cache"), ignore_errors=True)

    cold_rels = rels[:COLD_QUICK if quick else COLD_FULL]
    cold_src = os.path.join(workdir, "cold-src")
    for r in cold_rels:
        os.makedirs(os.path.dirname(os.path.join(cold_src, r)), exist_ok=True)
        shutil.copyfile(os.path.join(src, r), os.path.join(cold_src, r))
    with running_emulator(concurrent=True) as emu:
        emu.create_bucket("bench")
        upload_tree(emu.host, "bench", "syn", cold_src)
        options = StorageOptions(emulator_host=emu.host)
        cold_data = create_digest("gs://bench/syn", "syn", workers=4, options=options)
        backend = open_backend("gs://bench/syn", options)
        threads = 16
        direct_bytes, direct_s = read_all(cold_rels, threads, lambda k: len(backend.read(k)))
        backend.close()
        with running_mountd(workdir, cache_size=str(tree.bytes), name="cold") as m:
            root = _remount(m, cold_data, "cold", emu.host)
            mount_bytes, mount_s = read_all([os.path.join(root, r) for r in cold_rels],
                                            threads)
            causes = m.status()["bucket_fetch_causes"]
        report["cold"] = {"items": len(cold_rels), "threads": threads,
                          "direct_mb_s": direct_bytes / direct_s / 1e6,
                          "mount_mb_s": mount_bytes / mount_s / 1e6,
                          "ratio": direct_s / mount_s, "bucket_fetch_causes": causes}
    warm = report["warm"]
    report["summary"] = {
        "warm_ratio_4": warm["ssd"][4]["ratio"],
        "warm_ratio_16": warm["ssd"][16]["ratio"],
        "cold_ratio": round(report["cold"]["ratio"], 3),
        "cpu_s_per_gb_hit": warm["store"][16]["cpu_s_per_gb"],
        "store_ratio_16": warm["store"][16]["ratio"],
        "hot_ratio_16": warm["hot"][16]["ratio"],
        # the second pass over the same mounted files: all cached, pages kept
        "fuse_requests_per_file": warm["hot"][16]["fuse_requests_per_file"],
        "fuse_requests_per_file_store": warm["store"][16]["fuse_requests_per_file"],
        "warm_mount_mb_s_16": warm["ssd"][16]["mount_mb_s"],
        "warm_direct_mb_s_16": warm["ssd"][16]["direct_mb_s"],
    }
    return report

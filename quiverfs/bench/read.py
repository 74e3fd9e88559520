"""``quiver bench read``: exact reads through the mount against reading the source directly.

Warm (every item already in mountd's store), three ways, each against reading the
same files from a local directory with the same number of threads:

- ``ssd`` (the headline ``warm_ratio_N``, N = 1, 4, 16 and 64 threads): no page cache on
  either side; local files and the store's files are written back and dropped from it
  with posix_fadvise(DONTNEED) and the dataset is mounted afresh. Both sides read the
  SSD, as with a dataset larger than RAM.
- ``store`` (16 threads): the store's files are in the page cache (read just before), the
  mount's pages are not (a fresh mount name): what mountd's own read path costs.
- ``hot`` (16 and 64 threads): both sides in the page cache; the mount's pages kept by
  the kernel (``keep_cache``) from the ``ssd`` pass just before.

Small files: a second tree of 4 KB JPEGs, its own mountd, the ``ssd`` pass at 16
threads (``warm_ratio_small_16``), where a request's cost outweighs its bytes.

Cold: an empty store, items behind the GCS emulator; the baseline reads the bucket with
the google-cloud-storage client's ``download_as_bytes`` (one client per thread, each
with the environment read once, as ``GCSBackend`` makes them), same number of threads.
The mount's pass starts once mountd's loader processes, started when the dataset is
mounted, are ready. With ``latency_ms`` both sides read it through a proxy
(``throttle_proxy``, uncapped) that holds the first byte of every response that long,
as a cloud bucket's time to first byte.

The peer: ``rclone mount --vfs-cache-mode full`` of a subset of the same files, uploaded
to the emulator (uploads are slow there); a first pass fills rclone's cache, then the
local files, rclone's cache files and the mount's pages are dropped from the page
cache and every file is read at 16 and 64 threads, against the same subset read
locally (``rclone_warm_ratio_N``). Without rclone the pass is skipped with a note.

The floor: libfuse's own minimal C server, ``passthrough_ll`` from its examples
(``quiverfs.bench.floor``), mounted over a copy of the same tree and read in the same
``ssd``, ``store`` and ``hot`` passes as mountd (its CPU counted as mountd's is):
``floor_*`` keys, and the mount's figures over the floor's (``store_vs_floor_16``,
``cpu_vs_floor``): what the kernel and libfuse cost with no cache at all. Without the
example's source the pass is skipped with a note.

Each warm pass also counts the FUSE requests mountd received per file, by opcode; the
headline ``fuse_requests_per_file`` is the ``hot`` pass at 16 threads (the second pass
over the same mounted files). Both report mountd's bucket fetches by cause
(``bucket_fetch_causes``: its whole run).

Each comparison also times every file's read (open, read, close) on both sides: the
median and p99 in ms, and ``p99_ratio``, the mount's p99 over the local files' (the
headline ``warm_p99_ratio_16`` is the ``ssd`` pass at 16 threads), and the daemon's
CPU by thread name (``daemon_cpu_s_by_thread``: mountd's data plane threads against
Python's).

``data_path`` (``native`` or ``python``) is passed to every mountd the benchmark starts as
``--data-path``; without it mountd picks its own. The report records the option given
(``data_path_option``) and the data path the warm mountd says it served with
(``warm.data_path``, from its status; the summary's ``data_path``).

``free_page_reporting_order``: where the VM gives free memory back to its host (virtio
balloon free page reporting), the smallest block it gives, else null; the benchmark
warns where it does, since a pass that allocates new pages then pays the host's faults
(docs/benchmarks.md, "#54's native data plane").
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import random
import shutil
import statistics
import time
from collections import Counter
from collections.abc import Callable

from digest_tools.create import create_digest
from quiverfs.backends import StorageOptions
from quiverfs.backends.gcs import GCSBackend
from quiverfs.bench import floor
from quiverfs.bench.compare import rclone_available, rclone_mount
from quiverfs.bench.cpu_time import process_cpu_seconds, thread_cpu_seconds
from quiverfs.bench.data import Tree, write_synthetic_tree
from quiverfs.bench.emulator import running_emulator, upload_tree
from quiverfs.bench.processes import MountdProcess, running_mountd
from quiverfs.bench.throttle_proxy import UNCAPPED, throttled

log = logging.getLogger(__name__)

FULL_ITEMS, QUICK_ITEMS = 19_000, 1_500  # x 110 KB: 2.1 GB and 165 MB
SMALL_FULL, SMALL_QUICK = 20_000, 1_000  # x 4 KB: 80 MB and 4 MB
SMALL_MEAN, SMALL_RANGE = 4_000, (1_000, 12_000)  # bytes
# subsets of the tree uploaded to the emulator (uploads are slow there)
COLD_FULL, COLD_QUICK = 2_000, 300
RCLONE_FULL, RCLONE_QUICK = 6_000, 300
SSD_THREADS = (1, 4, 16, 64)
STORE_THREADS = (16,)
HOT_THREADS = (16, 64)
SMALL_THREADS = 16
RCLONE_THREADS = (16, 64)
FILL_THREADS = 16
BUCKET = "bench"
PAGE_REPORTING = "/sys/module/page_reporting/parameters/page_reporting_order"
RCLONE_MISSING = ("rclone is not installed (Debian: apt-get install rclone): the rclone pass "
                  "and its rclone_warm_ratio_N keys are left out")


def _read_file(path: str) -> int:
    with open(path, "rb", buffering=0) as f:
        return len(f.read())


def read_all(paths: list[str], threads: int, reader=_read_file,
             times: list[float] | None = None) -> tuple[int, float]:
    """Read every path with ``threads`` threads; return (bytes, seconds). Given
    ``times``, each path's read time in seconds is appended to it."""
    if times is not None:
        reader = _timed(reader, times)
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(reader, paths, chunksize=16))
    return total, time.perf_counter() - start


def _timed(reader: Callable[[str], int], times: list[float]) -> Callable[[str], int]:
    """``reader``, appending each call's seconds to ``times``."""
    def timed(path: str) -> int:
        start = time.perf_counter()
        n = reader(path)
        times.append(time.perf_counter() - start)  # atomic under the GIL: no lock to wait on
        return n
    return timed


def mountd_args(data_path: str | None) -> tuple[str, ...]:
    """mountd's options for ``data_path``; none for mountd's default."""
    return ("--data-path", data_path) if data_path else ()


def remount(m: MountdProcess, data: bytes, name: str, host: str | None = None) -> str:
    """Register ``data`` under a fresh name: new inodes, so no kernel page cache."""
    m.call({"op": "mount", "name": name, "digest": data, "emulator_host": host})
    return os.path.join(m.root, name)


def drop_page_cache(paths: list[str]) -> None:
    """Evict files' pages from the page cache (no privileges needed); each file is
    written back first, since dirty pages (a tree or a cache just written) stay."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(directory: str) -> list[str]:
    return [os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs]


def _shuffled_files(src: str) -> list[str]:
    """Every file under ``src``, relative to it, in a fixed random order."""
    rels = [os.path.relpath(path, src) for path in files_under(src)]
    random.Random(0).shuffle(rels)
    return rels


def _copy_subset(src: str, rels: list[str], dest: str) -> str:
    """Copy ``rels`` from ``src`` to ``dest`` (the same relative paths); ``dest``."""
    for r in rels:
        os.makedirs(os.path.dirname(os.path.join(dest, r)), exist_ok=True)
        shutil.copyfile(os.path.join(src, r), os.path.join(dest, r))
    return dest


def _requests(m: MountdProcess) -> Counter[str]:
    return Counter(m.status()["fuse_requests"])


def _compare(direct: list[str], mounted: list[str], threads: int, daemon_pid: int,
             requests: Callable[[], Counter[str]] | None = None) -> dict:
    """Read ``direct`` then ``mounted`` (the same files) with ``threads`` threads; rates,
    per-file latencies, the mount's daemon's CPU and, given ``requests``, its FUSE
    requests per file."""
    direct_times: list[float] = []
    mount_times: list[float] = []
    direct_bytes, direct_s = read_all(direct, threads, times=direct_times)
    requests0 = requests() if requests else Counter()
    cpu0, threads0 = process_cpu_seconds(daemon_pid), thread_cpu_seconds(daemon_pid)
    mount_bytes, mount_s = read_all(mounted, threads, times=mount_times)
    cpu = process_cpu_seconds(daemon_pid) - cpu0
    by_thread = thread_cpu_seconds(daemon_pid)
    by_thread.subtract(threads0)
    if mount_bytes != direct_bytes:
        raise RuntimeError(f"the mount returned {mount_bytes} bytes, the local files "
                           f"{direct_bytes}")
    out = {"files": len(mounted), "direct_bytes": direct_bytes, "mount_bytes": mount_bytes,
           "direct_mb_s": round(direct_bytes / direct_s / 1e6, 1),
           "mount_mb_s": round(mount_bytes / mount_s / 1e6, 1),
           "direct_files_s": round(len(direct) / direct_s),
           "mount_files_s": round(len(mounted) / mount_s),
           "ratio": round(direct_s / mount_s, 3), "daemon_cpu_s": round(cpu, 2),
           "cpu_s_per_gb": round(cpu / (mount_bytes / 1e9), 3),
           # where the daemon's CPU went: its threads by name (over 0.01 s)
           "daemon_cpu_s_by_thread": {name: round(s, 2) for name, s in
                                      sorted(by_thread.items()) if s >= 0.01}}
    p99 = {}
    for side, times in (("direct", direct_times), ("mount", mount_times)):
        cuts = statistics.quantiles(times, n=100, method="inclusive")
        out[f"{side}_p50_ms"] = round(cuts[49] * 1000, 3)
        out[f"{side}_p99_ms"] = round(cuts[98] * 1000, 3)
        p99[side] = cuts[98]
    out["p99_ratio"] = round(p99["mount"] / p99["direct"], 3)
    if requests:
        time.sleep(0.2)  # the kernel sends RELEASE after close returns
        counted = requests() - requests0
        out["fuse_requests_per_file"] = round(sum(counted.values()) / len(mounted), 3)
        out["fuse_requests"] = {op: round(n / len(mounted), 3)
                                for op, n in sorted(counted.items())}
    return out


def _ssd_pass(m: MountdProcess, data: bytes, rels: list[str], direct: list[str],
              threads: int, name: str) -> tuple[dict, list[str]]:
    """The ``ssd`` comparison under a fresh mount ``name``; it and the mounted paths."""
    drop_page_cache(direct)
    drop_page_cache(files_under(os.path.join(m.cache_dir, "store")))
    root = remount(m, data, name)
    mounted = [os.path.join(root, r) for r in rels]
    return _compare(direct, mounted, threads, m.proc.pid, lambda: _requests(m)), mounted


def _fill(m: MountdProcess, data: bytes, rels: list[str]) -> None:
    """Read every item once through the mount, so that all are in the store."""
    root = remount(m, data, "fill")
    read_all([os.path.join(root, r) for r in rels], FILL_THREADS)


def _cache_size(tree: Tree) -> str:
    return str(tree.bytes * 2 + (64 << 20))


def _warm(src: str, rels: list[str], data: bytes, tree: Tree, workdir: str,
          data_path: str | None) -> dict:
    direct = [os.path.join(src, r) for r in rels]
    out: dict = {"ssd": {}, "store": {}, "hot": {}}
    with running_mountd(workdir, cache_size=_cache_size(tree), name="warm",
                        extra_args=mountd_args(data_path)) as m:
        _fill(m, data, rels)
        for threads in SSD_THREADS:
            out["ssd"][threads], mounted = _ssd_pass(m, data, rels, direct, threads,
                                                     f"ssd{threads}")
            if threads in STORE_THREADS:
                # the store's files into the page cache (the native data plane drops
                # what it reads from them: the mount's pages hold those bytes); a fresh
                # name has no pages
                read_all(files_under(os.path.join(m.cache_dir, "store")), threads)
                root = remount(m, data, f"store{threads}")
                out["store"][threads] = _compare(direct, [os.path.join(root, r) for r in rels],
                                                 threads, m.proc.pid, lambda: _requests(m))
            if threads in HOT_THREADS:
                # the ssd pass left that mount's pages in the kernel
                out["hot"][threads] = _compare(direct, mounted, threads, m.proc.pid,
                                               lambda: _requests(m))
        status = m.status()
    out["bucket_fetch_causes"] = status["bucket_fetch_causes"]
    # a mountd from before the native data path has no such key: it serves in Python
    out["data_path"] = status.get("data_path", "python")
    shutil.rmtree(m.cache_dir, ignore_errors=True)
    return out


def _floor(src: str, rels: list[str], workdir: str) -> dict:
    """The ``ssd``, ``store`` and ``hot`` passes over passthrough_ll mirroring a copy
    of ``src`` (its own files, so that both sides' pages can be dropped)."""
    binary = floor.build(workdir)
    if binary is None:
        log.warning("%s", floor.MISSING)
        return {"skipped": floor.MISSING}
    backing = shutil.copytree(src, os.path.join(workdir, "floor-src"))
    direct = [os.path.join(src, r) for r in rels]
    out: dict = {"ssd": {}, "store": {}, "hot": {}}
    for threads in SSD_THREADS:
        drop_page_cache(direct + files_under(backing))
        with floor.mounted(binary, backing, workdir) as (root, pid):
            mounted = [os.path.join(root, r) for r in rels]
            out["ssd"][threads] = _compare(direct, mounted, threads, pid)
            if threads in HOT_THREADS:
                out["hot"][threads] = _compare(direct, mounted, threads, pid)
        if threads in STORE_THREADS:
            read_all(files_under(backing), threads)  # the backing files' pages cached
            with floor.mounted(binary, backing, workdir) as (root, pid):
                out["store"][threads] = _compare(direct, [os.path.join(root, r) for r in rels],
                                                 threads, pid)
    shutil.rmtree(backing, ignore_errors=True)
    return out


def _small(n_items: int, workdir: str, data_path: str | None) -> dict:
    """The ``ssd`` pass over a tree of small files, in a mountd of its own."""
    src = os.path.join(workdir, "small-src")
    tree = write_synthetic_tree(src, n_items, n_classes=100, seed=12, mean_size=SMALL_MEAN,
                                size_range=SMALL_RANGE)
    data = create_digest(src, "small", workers=os.cpu_count() or 1)
    rels = _shuffled_files(src)
    with running_mountd(workdir, cache_size=_cache_size(tree), name="small",
                        extra_args=mountd_args(data_path)) as m:
        _fill(m, data, rels)
        ssd, _ = _ssd_pass(m, data, rels, [os.path.join(src, r) for r in rels],
                           SMALL_THREADS, f"ssd{SMALL_THREADS}")
    shutil.rmtree(m.cache_dir, ignore_errors=True)
    return {"dataset": {"items": tree.files, "bytes": tree.bytes},
            "ssd": {SMALL_THREADS: ssd}}


def _cold(emulator: str, src: str, rels: list[str], cache_size: str, workdir: str,
          latency_ms: float, data_path: str | None) -> dict:
    """Items fetched through mountd from the emulator against the bucket read directly,
    each response's first byte ``latency_ms`` late."""
    subset = _copy_subset(src, rels, os.path.join(workdir, "cold-src"))
    upload_tree(emulator, BUCKET, "syn", subset)
    if not latency_ms:
        return _cold_reads(emulator, rels, cache_size, workdir, data_path)
    with throttled(emulator, UNCAPPED, latency=latency_ms / 1000) as proxy:
        return _cold_reads(proxy.url, rels, cache_size, workdir, data_path)


def _cold_reads(host: str, rels: list[str], cache_size: str, workdir: str,
                data_path: str | None) -> dict:
    options = StorageOptions(emulator_host=host)
    cold_data = create_digest(f"gs://{BUCKET}/syn", "syn", workers=4, options=options)
    backend = GCSBackend(f"gs://{BUCKET}/syn", options)

    def download(key: str) -> int:  # what a user's own code does: the client's download
        blob = backend.client().bucket(BUCKET).blob(f"syn/{key}")
        return len(blob.download_as_bytes(checksum=None))

    threads = 16
    direct_bytes, direct_s = read_all(rels, threads, download)
    backend.close()
    with running_mountd(workdir, cache_size=cache_size, name="cold",
                        extra_args=mountd_args(data_path)) as m:
        root = remount(m, cold_data, "cold", host)
        m.wait_for_loaders()
        mount_bytes, mount_s = read_all([os.path.join(root, r) for r in rels], threads)
        causes = m.status()["bucket_fetch_causes"]
    if mount_bytes != direct_bytes:
        raise RuntimeError(f"the mount returned {mount_bytes} bytes, the bucket "
                           f"{direct_bytes}")
    return {"items": len(rels), "threads": threads, "direct_bytes": direct_bytes,
            "mount_bytes": mount_bytes, "direct_s": direct_s,
            "direct_mb_s": direct_bytes / direct_s / 1e6,
            "mount_mb_s": mount_bytes / mount_s / 1e6,
            "ratio": direct_s / mount_s, "bucket_fetch_causes": causes}


def _rclone(host: str, src: str, rels: list[str], workdir: str) -> dict:
    """``rclone mount --vfs-cache-mode full`` of ``rels``, its cache filled, against the
    same files read locally, at each of RCLONE_THREADS."""
    if not rclone_available():
        log.warning("%s", RCLONE_MISSING)
        return {"skipped": RCLONE_MISSING}
    subset = _copy_subset(src, rels, os.path.join(workdir, "rclone-src"))
    started = time.perf_counter()
    upload_tree(host, BUCKET, "rclone", subset)
    out: dict = {"items": len(rels), "upload_s": round(time.perf_counter() - started, 1)}
    direct = [os.path.join(src, r) for r in rels]
    size = sum(os.path.getsize(p) for p in direct)
    with rclone_mount(host, size * 2 + (64 << 20), workdir, "rclone",
                      remote=f"{BUCKET}/rclone") as target:
        mounted = [os.path.join(target.source, r) for r in rels]
        fill_bytes, fill_s = read_all(mounted, FILL_THREADS)
        if fill_bytes != size:
            raise RuntimeError(f"rclone's first pass read {fill_bytes} bytes of {size}")
        out["fill_mb_s"] = round(fill_bytes / fill_s / 1e6, 1)
        cache_files = files_under(target.cache_dir)
        for threads in RCLONE_THREADS:
            drop_page_cache(direct + cache_files + mounted)
            out[threads] = _compare(direct, mounted, threads, target.daemon_pid)
    return out


def free_page_reporting() -> int | None:
    """The smallest block (as a page order) of free memory this VM gives back to its
    host (virtio-balloon free page reporting), None where it gives none back. A page
    touched after it was given back costs a fault in the host: 20-30 times the cost
    of a backed one on the machine of docs/benchmarks.md, paid by whichever pass
    allocates new pages first."""
    try:
        with open(PAGE_REPORTING, encoding="ascii") as f:
            order = int(f.read())
    except (OSError, ValueError):
        return None
    # above the largest block there is (order 10, MAX_PAGE_ORDER on x86-64): nothing is
    return order if order <= 10 else None


def run(quick: bool, workdir: str, latency_ms: float = 0.0,
        data_path: str | None = None) -> dict:
    """The benchmark; ``latency_ms`` delays the first byte of the cold pass's bucket
    responses; ``data_path`` is mountd's ``--data-path`` (None: mountd's default)."""
    n_items = QUICK_ITEMS if quick else FULL_ITEMS
    src = os.path.join(workdir, "src")
    tree = write_synthetic_tree(src, n_items, n_classes=100, seed=11)
    data = create_digest(src, "syn", workers=os.cpu_count() or 1)
    rels = _shuffled_files(src)
    reporting = free_page_reporting()
    if reporting is not None:
        log.warning("this VM gives free memory back to its host (page_reporting_order %d): "
                    "passes that need new pages pay the host's faults; see "
                    "docs/benchmarks.md", reporting)
    report: dict = {"dataset": {"items": tree.files, "bytes": tree.bytes},
                    "free_page_reporting_order": reporting,
                    "data_path_option": data_path,
                    "warm": _warm(src, rels, data, tree, workdir, data_path),
                    "floor": _floor(src, rels, workdir),
                    "small": _small(SMALL_QUICK if quick else SMALL_FULL, workdir, data_path)}
    with running_emulator(concurrent=True) as emu:
        emu.create_bucket(BUCKET)
        report["cold"] = _cold(emu.host, src, rels[:COLD_QUICK if quick else COLD_FULL],
                               str(tree.bytes), workdir, latency_ms, data_path)
        report["cold"]["latency_ms"] = latency_ms
        report["rclone"] = _rclone(emu.host, src,
                                   rels[:RCLONE_QUICK if quick else RCLONE_FULL], workdir)
    report["summary"] = summary(report)
    return report


def summary(report: dict) -> dict:
    """The headline numbers of a report; the rclone keys only where rclone ran."""
    warm = report["warm"]
    out: dict = {"data_path": warm["data_path"]}
    out.update({f"warm_ratio_{n}": warm["ssd"][n]["ratio"] for n in SSD_THREADS})
    out.update({
        "warm_p99_ratio_16": warm["ssd"][16]["p99_ratio"],
        "warm_ratio_small_16": report["small"]["ssd"][SMALL_THREADS]["ratio"],
        "cold_ratio": round(report["cold"]["ratio"], 3),
        "cold_latency_ms": report["cold"]["latency_ms"],
        "cpu_s_per_gb_hit": warm["store"][16]["cpu_s_per_gb"],
        "store_ratio_16": warm["store"][16]["ratio"],
        "hot_ratio_16": warm["hot"][16]["ratio"],
        "hot_ratio_64": warm["hot"][64]["ratio"],
        # the second pass over the same mounted files: all cached, pages kept
        "fuse_requests_per_file": warm["hot"][16]["fuse_requests_per_file"],
        "fuse_requests_per_file_store": warm["store"][16]["fuse_requests_per_file"],
        "warm_mount_mb_s_16": warm["ssd"][16]["mount_mb_s"],
        "warm_direct_mb_s_16": warm["ssd"][16]["direct_mb_s"],
    })
    if "skipped" not in report["floor"]:
        fl = report["floor"]
        out.update({f"floor_warm_ratio_{n}": fl["ssd"][n]["ratio"] for n in SSD_THREADS})
        out.update({
            "floor_store_ratio_16": fl["store"][16]["ratio"],
            "floor_cpu_s_per_gb_hit": fl["store"][16]["cpu_s_per_gb"],
            "floor_hot_ratio_16": fl["hot"][16]["ratio"],
            "store_vs_floor_16": round(out["store_ratio_16"] / fl["store"][16]["ratio"], 3),
            "cpu_vs_floor": round(out["cpu_s_per_gb_hit"] / fl["store"][16]["cpu_s_per_gb"], 3),
        })
    if "skipped" not in report["rclone"]:
        out.update({f"rclone_warm_ratio_{n}": report["rclone"][n]["ratio"]
                    for n in RCLONE_THREADS})
    return out

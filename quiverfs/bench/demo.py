"""``make demo``: a cloud bucket, a first training through the mount, then six jobs
reading one dataset at once, four ways side by side, with a table and a chart.

Everything is real: the ``quiver`` CLI, mountd processes with FUSE mounts, a diskcache
store on disk, ``rclone mount``, torchvision's ImageFolder and DataLoaders with worker
processes. The bucket is the GCS emulator behind the throttle proxy (``throttle_proxy``):
every response's first byte waits ``ttfb_s``, and all downloads together share a cap
of ``bucket_rate`` bytes/s, as a bucket seen from one VM does (docs/getting-started.md says
why these figures).

First the digits (scikit-learn's, 1797 PNGs) are uploaded, digested with ``quiver digest
create gs://...``, mounted with ``quiver mount --prefetch`` beside a substitutable view,
and a small CNN is trained through the mount. Then, with a cache of 20% of a synthetic
JPEG dataset in the same bucket, the jobs of a sweep read it together (``compare``'s
jobs: ImageFolder, a DataLoader, a simulated training step per batch), one way after
another: ``rclone mount --vfs-cache-mode full`` with the same cache size, Quiver exact
reads, ``QuiverBatchSampler`` and a ``--view substitutable`` mount; then one job alone
with the sampler.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torchvision
from torch import nn

from quiverfs.bench import compare, figures
from quiverfs.bench.data import write_digits_tree
from quiverfs.bench.emulator import Emulator, running_emulator, upload_tree
from quiverfs.bench.processes import unmount
from quiverfs.bench.throttle_proxy import ThrottleProxy, throttled
from quiverfs.errors import ExitCode, QuietError
from quiverfs.mount_point import is_mounted
from quiverfs.sizes import human

BUCKET = compare.BUCKET  # holds the digits and the comparison's dataset
DIGITS = "digits"
DIGITS_VIEW = "digits-view"
SERVED_PATH = "user.quiver.served.path"  # on a view's open file: the item it serves
BATCH_SIZE = 64
# DataLoader workers of the first training, more than the cores: each reads one file at
# a time and spends most of it waiting for the bucket's first byte.
DIGITS_WORKERS = 4
CACHE_FRACTION = 0.2  # the comparison's cache, of the dataset's bytes
SWEEP_JOBS = 6  # a hyper-parameter sweep: six jobs reading one dataset at once
FIRST_STOP_TIMEOUT = 30.0  # seconds for the background mountd to unmount after SIGTERM
CODES = {int(code) for code in ExitCode}
# In the current directory (make demo: the checkout), not in /tmp: the demo runs as root,
# and a fixed name in a directory every user writes to is a file another user can plant.
DEFAULT_CHART = "quiver-demo.png"


@dataclasses.dataclass(frozen=True)
class Way:
    """One row of the comparison: how its jobs read, and how many there are."""

    label: str
    mode: str  # compare's: "rclone", "exact", "sub" or "view"
    jobs: int


WAYS = (Way("rclone mount", "rclone", SWEEP_JOBS),
        Way("Quiver exact reads", "exact", SWEEP_JOBS),
        Way("Quiver sampler", "sub", SWEEP_JOBS),
        Way("Quiver view", "view", SWEEP_JOBS),
        Way("sampler, 1 job alone", "sub", 1))


@dataclasses.dataclass(frozen=True)
class DemoSize:
    """How big a demo is: the bucket's time to first byte, the first training's data and
    epochs, and the comparison's size (``compare.Size``: its dataset, bucket cap,
    epochs and jobs' DataLoaders)."""

    ttfb_s: float  # every response's first byte waits this long
    digits: int | None  # digit images uploaded (None: all 1797)
    digits_epochs: int
    sweep: compare.Size


SIZES = {
    # 200 JPEGs of 50 KB on average (10 MB). The cap passes 120 of them a second; one job
    # alone wants 160 a second (a batch of 8 every 50 ms), six want 960. In 4 classes:
    # the view serves each open an item of its class, so what it must keep cached is,
    # per class, what the job furthest on has had and the one furthest behind has not.
    # Six jobs' own shuffles of 200 items in 4 classes spread over 0.58 of the cache on
    # average (a simulation); in 10 classes over 1.02, 3.6 times ImageNet's 0.28 at a
    # 10% cache (docs/getting-started.md): a class of 20 items is no real dataset's.
    "full": DemoSize(0.03, None, 3, compare.Size(200, 4, 50_000, 6e6, 3, 1, 8, 0.05, 2,
                                                 (SWEEP_JOBS,))),
    # for tests/test_getting_started.py: the same path, smaller, with a faster bucket;
    # as many items as "full", so that each of mountd's chunks (an eighth of the cache
    # on a lone node) holds several
    "tiny": DemoSize(0.005, 400, 1, compare.Size(200, 4, 20_000, 20e6, 2, 1, 8, 0.01, 1,
                                                 (SWEEP_JOBS,))),
}
DIGEST_WORKERS = 16  # objects hashed at once: each waits for the bucket's first byte


def quiver(*args: str, env: dict[str, str] | None = None) -> str:
    """Run a real ``quiver`` command, echoing it like a shell session; a failure is the
    command's own one-line error, with its exit code."""
    print(f"$ quiver {' '.join(shlex.quote(a) for a in args)}", flush=True)
    r = subprocess.run([sys.executable, "-m", "quiverfs.cli", *args], capture_output=True,
                       text=True, env={**os.environ, **env} if env else None)
    print(r.stdout, end="", flush=True)
    if r.returncode != 0:
        lines = r.stderr.strip().splitlines() or ["(no output)"]
        raise QuietError(f"'quiver {args[0]}' failed: {lines[-1]}",
                         ExitCode(r.returncode) if r.returncode in CODES else ExitCode.DAEMON)
    return r.stdout


# -- the first training ------------------------------------------------------------------
def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def grayscale() -> Any:
    return torchvision.transforms.Compose([torchvision.transforms.Grayscale(),
                                           torchvision.transforms.ToTensor()])


def train(dataset_root: str, epochs: int) -> float:
    """Train on 80% of ImageFolder(dataset_root), return test accuracy on the rest (%)."""
    # More workers than cores on purpose: they wait on the bucket, not on the CPU.
    warnings.filterwarnings("ignore", message="This DataLoader will create")
    data = torchvision.datasets.ImageFolder(dataset_root, transform=grayscale())
    gen = torch.Generator().manual_seed(0)
    train_set, test_set = torch.utils.data.random_split(data, [0.8, 0.2], generator=gen)
    loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True,
                                         num_workers=DIGITS_WORKERS, generator=gen)
    torch.manual_seed(0)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(epochs):
        start = time.monotonic()
        total, items = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            total += loss.item() * len(y)
            items += len(y)
        print(f"epoch {epoch + 1}: loss {total / items:.3f}, "
              f"{time.monotonic() - start:.2f} s", flush=True)
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(test_set, batch_size=256,
                                                num_workers=DIGITS_WORKERS):
            correct += (model(x).argmax(1) == y).sum().item()
    return 100.0 * correct / len(test_set)


def show_substitution(root: str, path: str) -> None:
    """Open ``path`` in the view and say which item it served."""
    with open(os.path.join(root, DIGITS_VIEW, path), "rb") as f:
        f.read()
        served = os.getxattr(f.fileno(), SERVED_PATH).decode()
    print(f"opening {DIGITS_VIEW}/{path} read the bytes of {served} (same label; "
          f"getxattr {SERVED_PATH})")


def digits_tree(dest: str, items: int | None) -> int:
    """The digits as an ImageFolder tree (``write_digits_tree``), thinned out evenly to
    ``items`` images if given; how many there are."""
    tree = write_digits_tree(dest)
    if items is None or items >= tree.files:
        return tree.files
    files = sorted(os.path.join(d, f) for d, _, names in os.walk(dest) for f in names)
    kept = set(np.linspace(0, len(files) - 1, items).round().astype(int).tolist())
    for i, path in enumerate(files):
        if i not in kept:
            os.remove(path)
    return len(kept)


def first_training(work: str, emulator: Emulator, proxy: ThrottleProxy,
                   size: DemoSize) -> None:
    """Upload the digits, digest them from the bucket, mount them (and a view), train a
    small CNN through the mount; mountd stopped and unmounted whatever happens."""
    src = os.path.join(work, "digits-src")
    files = digits_tree(src, size.digits)
    upload_tree(emulator.host, BUCKET, DIGITS, src, workers=DIGEST_WORKERS)
    print(f"uploaded {files} digit images to gs://{BUCKET}/{DIGITS}/ "
          f"(the quiver commands reach the bucket through STORAGE_EMULATOR_HOST)\n")
    env = {"STORAGE_EMULATOR_HOST": proxy.url}
    root, cache = os.path.join(work, "mnt"), os.path.join(work, "cache")
    os.makedirs(root)
    digest = os.path.join(work, "digits.qd")
    quiver("digest", "create", f"gs://{BUCKET}/{DIGITS}", "-o", digest, "--name", DIGITS,
           "--workers", str(DIGEST_WORKERS), "--anonymous", env=env)
    try:
        quiver("mountd", "--root", root, "--cache-dir", cache, "--cache-size", "64M")
        quiver("mount", digest, "--prefetch", "--anonymous", "--root", root, env=env)
        quiver("mount", digest, "--name", DIGITS_VIEW, "--view", "substitutable",
               "--anonymous", "--root", root, env=env)
        dataset = os.path.join(root, DIGITS)
        print(f"\ntraining a small CNN on ImageFolder({dataset!r}) "
              f"with DataLoader(num_workers={DIGITS_WORKERS})", flush=True)
        accuracy = train(dataset, size.digits_epochs)
        print(f"test accuracy: {accuracy:.1f}%\n")
        first = sorted(os.listdir(os.path.join(root, DIGITS_VIEW, "3")))[0]
        show_substitution(root, f"3/{first}")
        quiver("status", "--root", root)
    finally:
        stop_mountd(root)


def stop_mountd(root: str) -> None:
    """SIGTERM the background mountd (its pid comes from status) and wait for the unmount."""
    r = subprocess.run([sys.executable, "-m", "quiverfs.cli", "status", "--json",
                        "--root", root], capture_output=True, text=True)
    if r.returncode == 0:  # else it never started, or is gone
        os.kill(json.loads(r.stdout)["pid"], signal.SIGTERM)
        deadline = time.monotonic() + FIRST_STOP_TIMEOUT
        while is_mounted(root) and time.monotonic() < deadline:
            time.sleep(0.1)
    unmount(root)
    print(f"mountd stopped, {root} unmounted", flush=True)


# -- the sweep -----------------------------------------------------------------------------
def sweep(work: str, emulator: Emulator, proxy: ThrottleProxy, size: compare.Size,
          ways: tuple[Way, ...]) -> dict[Way, dict[str, Any]]:
    """Each way in turn, its jobs all reading the synthetic dataset at once; compare's
    record of each (epochs, steady state)."""
    data = compare.upload_dataset(emulator, proxy, size, work)
    print(f"\n{len(data.paths)} JPEGs in {size.classes} classes ({human(data.bytes)}) in "
          f"gs://{BUCKET}/{compare.DATASET}/; cache {CACHE_FRACTION:.0%} of them "
          f"({human(int(CACHE_FRACTION * data.bytes))}) each way. Each job: ImageFolder, "
          f"DataLoader(batch_size={size.batch_size}, num_workers={size.workers}), "
          f"{size.compute_s * 1000:.0f} ms of simulated training per batch.", flush=True)
    records: dict[Way, dict[str, Any]] = {}
    # the lone job is the first of the sweep's processes (torch is imported once)
    with compare.running_jobs(max(w.jobs for w in ways), work) as jobs:
        for way in ways:
            print(f"{way.label}: ", end="", flush=True)
            # mountd's default probing, as a user's sweep gets: a probe runs after 100
            # batches, more than an epoch here (compare's 5 exercise it in its benchmark)
            record = compare.run_config(way.mode, CACHE_FRACTION, jobs[:way.jobs], data,
                                        proxy, size, work, probe_batches=None)
            records[way] = {**record, "dataset_bytes": data.bytes}
            print(", ".join(f"{e['seconds']:.2f} s" for e in record["epochs"]), flush=True)
    return records


def hit_ratio(record: dict[str, Any]) -> tuple[float, bool]:
    """The steady epochs' hit ratio, and whether it is mountd's (else rclone's: 1 - bucket
    bytes / bytes read, the only one it exposes)."""
    steady = record["steady"]
    if steady["hit_ratio"] is not None:
        return steady["hit_ratio"], True
    return steady["byte_hit_ratio"], False


def speedup(record: dict[str, Any], rclone: dict[str, Any] | None) -> str:
    if rclone is None or record["jobs"] != rclone["jobs"]:
        return "-"
    return f"{record['steady']['items_per_s'] / rclone['steady']['items_per_s']:.2f}x"


def table(records: dict[Way, dict[str, Any]]) -> str:
    """Per way: each epoch's seconds, the steady epochs' hit ratio, bucket bytes per
    steady epoch (and per dataset), and the steady speedup over rclone's jobs."""
    epochs = max(len(r["epochs"]) for r in records.values())
    rclone = next((r for w, r in records.items() if w.mode == "rclone"), None)
    head = (f"{'':<22}" + "".join(f"{f'epoch {e + 1}':>9}" for e in range(epochs))
            + f"  {'hits':>5}  {'bucket/epoch':>19}  {'vs rclone':>9}")
    lines = [head]
    for way, r in records.items():
        ratio, mountd = hit_ratio(r)
        bucket = r["steady"]["bucket_bytes"] / r["steady"]["epochs"]
        cells = "".join(f"{e['seconds']:>7.2f} s" for e in r["epochs"])
        lines.append(f"{way.label:<22}{cells}  {ratio:>5.2f}{' ' if mountd else '*'} "
                     f"{human(int(bucket)):>10} ({bucket_per_epoch(r):.2f}x)  "
                     f"{speedup(r, rclone):>9}")
    return "\n".join(lines)


def plot(records: dict[Way, dict[str, Any]], size: DemoSize, out: str) -> None:
    """Bars: each way's epoch times, one bar per epoch."""
    plt = figures.pyplot()
    epochs = max(len(r["epochs"]) for r in records.values())
    width = 0.8 / epochs
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for e in range(epochs):
        xs = [i + (e - (epochs - 1) / 2) * width for i in range(len(records))]
        seconds = [r["epochs"][e]["seconds"] if e < len(r["epochs"]) else 0.0
                   for r in records.values()]
        bars = ax.bar(xs, seconds, width, color=f"C{e}",
                      label=f"epoch {e + 1}" + (" (cold cache)" if e == 0 else ""))
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(records)), [w.label.replace(" ", "\n", 1) for w in records],
                  fontsize=8)
    ax.set_ylabel("epoch time (s)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    dataset = next(iter(records.values()))["dataset_bytes"]
    ax.set_title(f"{SWEEP_JOBS} jobs reading one dataset ({size.sweep.items} items, "
                 f"{human(dataset)}) at once, cache {CACHE_FRACTION:.0%}; bucket: "
                 f"{size.ttfb_s * 1000:.0f} ms to first byte, "
                 f"{size.sweep.bucket_rate / 1e6:g} MB/s",
                 fontsize=9)
    figures.save(fig, out)


def bucket_per_epoch(record: dict[str, Any]) -> float:
    """Bytes from the bucket per steady epoch, as a multiple of the dataset's."""
    steady = record["steady"]
    return steady["bucket_bytes"] / steady["epochs"] / record["dataset_bytes"]


def summary(records: dict[Way, dict[str, Any]]) -> str:
    """What the table says, in words, from its numbers."""
    by_mode = {w.mode: r for w, r in records.items() if w.jobs == SWEEP_JOBS}
    lines = ["* rclone's hit ratio: 1 - bucket bytes / bytes read (the only one it "
             "exposes).",
             f"Exact reads: each job shuffles on its own and the cache keeps the items "
             f"read last, so\nthe {SWEEP_JOBS} jobs fetched "
             f"{bucket_per_epoch(by_mode['exact']):.2f}x the dataset from the bucket "
             f"each epoch. The sampler ({bucket_per_epoch(by_mode['sub']):.2f}x) and\n"
             f"the view ({bucket_per_epoch(by_mode['view']):.2f}x) serve each job the "
             f"cached items first and load the rest in chunks\nthat all the jobs share."]
    alone = next((r for w, r in records.items() if w.jobs == 1), None)
    if alone is not None:
        lines.append(f"A job alone shares with no one: at a {CACHE_FRACTION:.0%} cache it "
                     f"still read {bucket_per_epoch(alone):.2f}x the dataset\nfrom the "
                     f"bucket each epoch ({alone['steady']['epoch_s_per_job']:.2f} s an "
                     f"epoch), as it would whichever way it read.")
    return "\n".join(lines)


# -- the demo ------------------------------------------------------------------------------
@contextlib.contextmanager
def terminated_as_interrupt() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so every cleanup runs."""
    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run(size: DemoSize, chart: str) -> None:
    """The demo, writing its chart to ``chart``."""
    if not os.path.exists("/dev/fuse"):
        raise QuietError("no /dev/fuse: the demo mounts FUSE filesystems (modprobe fuse, "
                         "or give the container /dev/fuse)", ExitCode.MOUNT)
    folder = os.path.dirname(os.path.abspath(chart))
    if not os.path.isdir(folder):  # found now, not after two minutes
        raise QuietError(f"cannot write the chart to {chart}: no directory {folder} "
                         "(give --chart a path in an existing directory)", ExitCode.NOT_FOUND)
    ways = WAYS
    if not compare.rclone_available():
        print("rclone is not installed (apt-get install rclone): its row is left out\n")
        ways = tuple(w for w in WAYS if w.mode != "rclone")
    s = size.sweep
    with tempfile.TemporaryDirectory(prefix="quiver-demo-") as work, \
            running_emulator(concurrent=True) as emulator, \
            throttled(emulator.host, s.bucket_rate, latency=size.ttfb_s) as proxy:
        emulator.create_bucket(BUCKET)
        print(f"the bucket: gs://{BUCKET} on a local GCS emulator behind a proxy at "
              f"{proxy.url}:\n{size.ttfb_s * 1000:.0f} ms to each response's first byte, "
              f"all downloads together capped at {s.bucket_rate / 1e6:g} MB/s", flush=True)
        first_training(work, emulator, proxy, size)
        records = sweep(work, emulator, proxy, s, ways)
    print(f"\n{SWEEP_JOBS} jobs reading one dataset at once, cache {CACHE_FRACTION:.0%}; "
          f"epoch 1 starts cold; hits, bucket reads and\nspeedup over rclone are the "
          f"later epochs' (all jobs together)")
    print(table(records))
    print(summary(records))
    plot(records, size, chart)
    print(f"chart: {os.path.abspath(chart)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quiverfs.bench.demo",
                                     description="Quiver's demo (make demo).")
    parser.add_argument("--size", choices=sorted(SIZES), default="full",
                        help="tiny: the same path, smaller (for tests)")
    parser.add_argument("--chart", default=DEFAULT_CHART, metavar="OUT.png",
                        help=f"where to write the chart (default: {DEFAULT_CHART})")
    args = parser.parse_args(argv)
    # The harness's warnings are not the user's: after Ctrl-C, say, the proxy warns that
    # the emulator (interrupted with the demo) is gone while mountd still asks for items.
    logging.getLogger("quiverfs.bench").setLevel(logging.ERROR)
    start = time.monotonic()
    try:
        with terminated_as_interrupt():
            run(SIZES[args.size], args.chart)
    except QuietError as exc:
        print(f"demo: error: {exc.message}", file=sys.stderr)
        return int(exc.exitcode)
    except (RuntimeError, OSError) as exc:  # a process of the demo's failed or went away
        print(f"demo: error: {' '.join(str(exc).split())[:400]}", file=sys.stderr)
        return int(ExitCode.DAEMON)
    except KeyboardInterrupt:
        print("demo: interrupted; everything stopped and unmounted", file=sys.stderr)
        return 130
    print(f"the demo took {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

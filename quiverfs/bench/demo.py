"""``make demo``: digest the digits dataset, mount it, train a small CNN through the mount;
then, with a cache of 20% of the dataset, train again three ways and compare their reads.

Everything is real: the ``quiver`` CLI, a mountd process with a FUSE mount, a
diskcache store on disk, torchvision's ImageFolder and a multi-worker DataLoader.
The "bucket" is a local directory (file://), the embedded default.

The three ways, one after another on one mountd whose cache holds a fifth of the
dataset: exact reads (a plain ImageFolder + ``DataLoader(shuffle=True)``), the sampler
(``quiverfs.torch.QuiverBatchSampler``), and the substitutable view (the same plain
ImageFolder over a ``--view substitutable`` mount of the same digest). Per epoch, the
hit ratio and the bucket reads come from mountd's counters (``quiver status --json``).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import struct
import subprocess
import sys
import tempfile
import time
import zlib
from typing import Any

import numpy as np

import torch
import torchvision
from torch import nn

from quiverfs import control_client
from quiverfs.bench.compare import load_image
from quiverfs.bench.data import Tree, write_digits_tree
from quiverfs.bench.processes import unmount
from quiverfs.counters import ReadCounter
from quiverfs.mount_point import is_mounted
from quiverfs.sizes import human

EPOCHS = 4
# Each 8x8 digit PNG (about 120 bytes) is padded to this size with a text chunk of
# random hex that decoders skip. The store spends about 280 bytes on every item, which
# would otherwise be most of the cache, while mountd plans the sampler's and the view's
# chunks in item bytes: it would plan twice what the store holds (real items: ~100 KB).
ITEM_BYTES = 4096
BATCH_SIZE = 64
# The comparison: a cache of this fraction of what the whole dataset took in the store
# (after the first training read it all), and this many epochs per way: the first
# fills the cache, the others are steady.
CACHE_FRACTION = 0.2
COMPARE_EPOCHS = 3
# mountd probes a job's benefit by forcing this many batches of misses (default 100,
# more than the comparison's jobs run); unprobed jobs count as benefiting.
PROBE_BATCHES = 0
VIEW_NAME = "digits-view"
SERVED_PATH = "user.quiver.served.path"  # on a view's open file: the item it serves


@dataclasses.dataclass(frozen=True)
class Way:
    """One way of reading in the comparison."""

    label: str
    dataset: str  # the mount it reads
    sampler: bool  # QuiverBatchSampler, else DataLoader(shuffle=True)


WAYS = (Way("exact reads", "digits", False),
        Way("sampler", "digits", True),
        Way("view", VIEW_NAME, False))


@dataclasses.dataclass(frozen=True)
class EpochReads:
    """What mountd counted in one epoch of one way."""

    hits: int  # reads served from the store (or from pages mountd pushed)
    reads: int  # reads that reached mountd
    bucket_fetches: int  # items fetched from the bucket (chunk loads included)
    bucket_bytes: int

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.reads if self.reads else 0.0


def padded_digits(dest: str) -> Tree:
    """The digits as an ImageFolder tree (``write_digits_tree``), each PNG padded to
    ITEM_BYTES with a ``tEXt`` chunk before its ``IEND``."""
    tree = write_digits_tree(dest)
    rng = np.random.default_rng(0)
    total = 0
    for dirpath, dirs, names in os.walk(tree.root):
        dirs.sort()
        for name in sorted(names):
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                png = f.read()
            # 20 bytes: the chunk's length, type and CRC, and the keyword
            pad = max(0, ITEM_BYTES - len(png) - 20) // 2
            text = b"padding\0" + rng.bytes(pad).hex().encode()
            chunk = b"tEXt" + text
            iend = png.rindex(b"IEND") - 4  # its length field
            png = (png[:iend] + struct.pack(">I", len(text)) + chunk
                   + struct.pack(">I", zlib.crc32(chunk)) + png[iend:])
            with open(path, "wb") as f:
                f.write(png)
            total += len(png)
    return dataclasses.replace(tree, bytes=total)


def quiver(*args: str) -> str:
    """Run a real ``quiver`` command, echoing it like a shell session."""
    print(f"$ quiver {' '.join(shlex.quote(a) for a in args)}", flush=True)
    out = subprocess.run([sys.executable, "-m", "quiverfs.cli", *args], check=True,
                         capture_output=True, text=True).stdout
    print(out, end="", flush=True)
    return out


def small_cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))


def grayscale() -> Any:
    return torchvision.transforms.Compose([torchvision.transforms.Grayscale(),
                                           torchvision.transforms.ToTensor()])


def fit_epoch(model: nn.Module, opt: torch.optim.Optimizer, loader: Any) -> tuple[float, int]:
    """One epoch of training; the summed loss and the number of items."""
    total, items = 0.0, 0
    for x, y in loader:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        total += loss.item() * len(y)
        items += len(y)
    return total, items


def train(dataset_root: str) -> float:
    """Train on 80% of ImageFolder(dataset_root), return test accuracy on the rest (%)."""
    data = torchvision.datasets.ImageFolder(dataset_root, transform=grayscale())
    gen = torch.Generator().manual_seed(0)
    train_set, test_set = torch.utils.data.random_split(data, [0.8, 0.2], generator=gen)
    loader = torch.utils.data.DataLoader(train_set, batch_size=BATCH_SIZE, shuffle=True,
                                         num_workers=2, generator=gen)
    torch.manual_seed(0)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    for epoch in range(EPOCHS):
        start = time.monotonic()
        total, items = fit_epoch(model, opt, loader)
        print(f"epoch {epoch + 1}: loss {total / items:.3f}, "
              f"{time.monotonic() - start:.2f} s", flush=True)
    correct = 0
    with torch.no_grad():
        for x, y in torch.utils.data.DataLoader(test_set, batch_size=256, num_workers=2):
            correct += (model(x).argmax(1) == y).sum().item()
    return 100.0 * correct / len(test_set)


# -- the comparison --------------------------------------------------------------------
def status(root: str) -> dict[str, Any]:
    """mountd's status: what ``quiver status --json`` prints."""
    return control_client.call(control_client.default_socket(root), {"op": "status"},
                               root=root)


def reads_since(before: dict[str, Any], after: dict[str, Any], dataset: str) -> EpochReads:
    """What mountd counted of ``dataset`` between two statuses; bucket reads node-wide,
    since a mount and its view share one store."""
    def counted(reply: dict[str, Any]) -> tuple[int, int]:
        c = next(ds["counters"] for ds in reply["datasets"] if ds["name"] == dataset)
        hits = c.get(ReadCounter.LOCAL_HITS, 0)
        return hits, hits + sum(c.get(k, 0) for k in (
            ReadCounter.MISSES, ReadCounter.STAGED_HITS, ReadCounter.PROBE_MISSES,
            ReadCounter.PEER_HITS))

    (h0, r0), (h1, r1) = counted(before), counted(after)
    b0, b1 = before["counters"], after["counters"]
    return EpochReads(h1 - h0, r1 - r0,
                      b1.get(ReadCounter.BUCKET_FETCHES, 0) - b0.get(ReadCounter.BUCKET_FETCHES, 0),
                      b1.get(ReadCounter.BUCKET_BYTES, 0) - b0.get(ReadCounter.BUCKET_BYTES, 0))


def train_counted(root: str, way: Way) -> list[EpochReads]:
    """Train a fresh small CNN for COMPARE_EPOCHS epochs on ImageFolder(root/dataset) read
    ``way``; mountd's counts per epoch."""
    from quiverfs.torch import QuiverBatchSampler

    # Each file's pages are dropped after it is read (load_image): a dataset five times
    # the cache would not sit in the kernel's page cache either.
    data = torchvision.datasets.ImageFolder(os.path.join(root, way.dataset),
                                            transform=grayscale(), loader=load_image)
    torch.manual_seed(0)
    model = small_cnn()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sampler = None
    if way.sampler:
        sampler = QuiverBatchSampler(data.root, BATCH_SIZE, seed=0, dataset=data)
        loader = torch.utils.data.DataLoader(data, batch_sampler=sampler, num_workers=2)
    else:
        loader = torch.utils.data.DataLoader(data, batch_size=BATCH_SIZE, shuffle=True,
                                             num_workers=2,
                                             generator=torch.Generator().manual_seed(0))
    epochs = []
    try:
        for epoch in range(COMPARE_EPOCHS):
            if sampler is not None:
                sampler.set_epoch(epoch)
            before = status(root)
            start = time.monotonic()
            total, items = fit_epoch(model, opt, loader)
            reads = reads_since(before, status(root), way.dataset)
            epochs.append(reads)
            print(f"{way.label}, epoch {epoch + 1}: loss {total / items:.3f}, "
                  f"{time.monotonic() - start:.2f} s, hit ratio {reads.hit_ratio:.2f}, "
                  f"{reads.bucket_fetches} bucket fetches", flush=True)
    finally:
        if sampler is not None:
            sampler.close()
    return epochs


def table(rows: dict[str, list[EpochReads]]) -> str:
    """The comparison, one row per way: per epoch, hit ratio and bucket reads."""
    width = 24
    lines = [f"{'':<13}" + "".join(f"{f'epoch {e + 1}':<{width}}"
                                   for e in range(COMPARE_EPOCHS)).rstrip(),
             f"{'':<13}" + (f"{'hits  bucket reads':<{width}}" * COMPARE_EPOCHS).rstrip()]
    for label, epochs in rows.items():
        cells = [f"{r.hit_ratio:.2f}  {r.bucket_fetches:>4} ({human(r.bucket_bytes)})"
                 for r in epochs]
        lines.append((f"{label:<13}" + "".join(f"{c:<{width}}" for c in cells)).rstrip())
    return "\n".join(lines)


def show_substitution(root: str, path: str) -> None:
    """Open ``path`` in the view and say which item it served."""
    with open(os.path.join(root, VIEW_NAME, path), "rb") as f:
        f.read()
        served = os.getxattr(f.fileno(), SERVED_PATH).decode()
    print(f"opening {VIEW_NAME}/{path} read the bytes of {served} (same label; "
          f"getxattr {SERVED_PATH})")


def compare(work: str, digest: str, root: str, footprint: int) -> None:
    """Restart mountd with a cache of CACHE_FRACTION of ``footprint`` (what the whole
    dataset took in the store), mount the digest exactly and as a view, and train
    through each way in turn."""
    cache_bytes = int(CACHE_FRACTION * footprint)
    print(f"\nnow a cache of {CACHE_FRACTION:.0%} of the dataset ({human(cache_bytes)} of "
          f"the {human(footprint)} it took in the store), and the same training three ways")
    try:
        quiver("mountd", "--root", root, "--cache-dir", os.path.join(work, "cache-small"),
               "--cache-size", str(cache_bytes), "--probe-batches", str(PROBE_BATCHES))
        quiver("mount", digest, "--root", root)
        quiver("mount", digest, "--name", VIEW_NAME, "--view", "substitutable",
               "--root", root)
        rows = {}
        for way in WAYS:
            how = ("QuiverBatchSampler" if way.sampler else "DataLoader(shuffle=True)")
            print(f"\n{way.label}: ImageFolder({os.path.join(root, way.dataset)!r}) with "
                  f"{how}", flush=True)
            rows[way.label] = train_counted(root, way)
        print(f"\ncache {CACHE_FRACTION:.0%} of the dataset; per epoch, the hit ratio (reads "
              "mountd served from its cache)\nand the bucket reads (items and bytes fetched)")
        print(table(rows))
        print("Exact reads: the cache keeps the items read last, which the next shuffle "
              "asks for\nlate, so nearly every read waits on the bucket. The sampler and "
              "the view load chunks\nahead and serve whichever cached item is due, so "
              "most reads are hits. One job still\nfetches the dataset or more each "
              "epoch; jobs reading a dataset together share it.")
        first = sorted(os.listdir(os.path.join(root, VIEW_NAME, "3")))[0]
        show_substitution(root, f"3/{first}")
        print(flush=True)
    finally:
        stop_mountd(root)


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="quiver-demo-") as work:
        src, root, cache = (os.path.join(work, d) for d in ("bucket", "mnt", "cache"))
        os.makedirs(root)
        tree = padded_digits(os.path.join(src, "digits"))
        print(f"the 'bucket' is {src} (a local directory); {tree.files} digit images\n")
        digest = os.path.join(work, "digits.qd")
        quiver("digest", "create", tree.root, "-o", digest, "--name", "digits")
        try:
            quiver("mountd", "--root", root, "--cache-dir", cache, "--cache-size", "64M")
            quiver("mount", digest, "--root", root)
            dataset = os.path.join(root, "digits")
            print(f"\ntraining a small CNN on ImageFolder({dataset!r}) "
                  f"with DataLoader(num_workers=2)")
            accuracy = train(dataset)
            print(f"test accuracy: {accuracy:.1f}%\n")
            quiver("status", "--root", root)
            footprint = int(status(root)["cache"]["used_bytes"])  # the whole dataset
            quiver("umount", "digits", "--root", root)
        finally:
            stop_mountd(root)
        compare(work, digest, root, footprint)
    return 0


def stop_mountd(root: str) -> None:
    """SIGTERM the background mountd (its pid comes from status) and wait for the unmount."""
    try:
        pid = json.loads(subprocess.run(
            [sys.executable, "-m", "quiverfs.cli", "status", "--json", "--root", root],
            check=True, capture_output=True, text=True).stdout)["pid"]
    except subprocess.CalledProcessError:
        pid = None  # it never started
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while is_mounted(root) and time.monotonic() < deadline:
            time.sleep(0.1)
    unmount(root)
    print(f"mountd stopped, {root} unmounted")


if __name__ == "__main__":
    sys.exit(main())

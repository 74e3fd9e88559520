"""``QuiverBatchSampler``: substitutable mini-batches for an unchanged ImageFolder.

    dataset = torchvision.datasets.ImageFolder("/mnt/quiver/imagenet/train", transform=tf)
    sampler = QuiverBatchSampler(dataset.root, batch_size=256, seed=0, dataset=dataset)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader: ...

Each epoch yields every item of this rank's shard exactly once, in batches mountd
fills with whatever is cached (paper §4.7). Batches are read as manifests from
``ROOT/.quiver/jobs/JOB/eE-bI``; the time between batches is reported back to mountd.
Where the dataset is cached in full, one manifest hands out a segment of several
batches (``mountd.batch_planner``): they are yielded without asking mountd again, and
their times are reported together when the next manifest is read.
"""
from __future__ import annotations

import errno
import json
import math
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

CONTROL = os.path.join(".quiver", "jobs")


def find_mount(path: str) -> tuple[str, str, str]:
    """(mount root, dataset name, prefix inside the dataset) for a path under a mount."""
    path = os.path.abspath(path)
    parts = path.strip("/").split("/")
    for i in range(len(parts) - 1, -1, -1):
        root = "/" + "/".join(parts[:i])
        if os.path.isdir(os.path.join(root, CONTROL)) and i < len(parts):
            return root, parts[i], "/".join(parts[i + 1:])
    raise ValueError(f"{path} is not inside a Quiver mount (no {CONTROL} above it)")


def image_folder_samples(root: str) -> list[tuple[str, int]]:
    """What ImageFolder(root) lists, without opening any image."""
    from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset

    _, class_to_idx = find_classes(root)
    return make_dataset(root, class_to_idx, extensions=IMG_EXTENSIONS)


class QuiverBatchSampler(Sampler[list[int]]):
    """A batch sampler whose batches come from mountd's substitutable sampling."""

    def __init__(self, root: str, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, dataset: Any = None, job_id: str | None = None,
                 scan_factor: int = 10, gpus: int = 1) -> None:
        from torchvision.datasets.folder import IMG_EXTENSIONS

        self.root = os.path.abspath(root)
        self.mount_root, self.dataset_name, self.prefix = find_mount(self.root)
        samples: Sequence[tuple[str, int]] = (dataset.samples if dataset is not None
                                              else image_folder_samples(self.root))
        self._index = {os.path.relpath(path, self.root): i for i, (path, _) in
                       enumerate(samples)}
        self.job_id = job_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}-r{rank}"
        self.job_dir = os.path.join(self.mount_root, CONTROL, self.job_id)
        self.epoch = 0
        config = {"dataset": self.dataset_name, "prefix": self.prefix,
                  "batch_size": batch_size, "seed": seed, "rank": rank,
                  "world_size": world_size, "scan_factor": scan_factor, "gpus": gpus,
                  "extensions": list(IMG_EXTENSIONS)}
        os.mkdir(self.job_dir)
        try:
            self._write("config", json.dumps(config).encode())
            with open(os.path.join(self.job_dir, "config"), encoding="utf-8") as f:
                self.config = json.load(f)
            if self.config["universe"] != len(self._index):
                raise ValueError(f"mountd sees {self.config['universe']} images under "
                                 f"{self.root}, ImageFolder {len(self._index)}: remount?")
            self._report = os.open(os.path.join(self.job_dir, "report"), os.O_WRONLY)
        except BaseException:
            self.close()
            raise
        self._last: float | None = None
        self._reports: list[str] = []  # "EPOCH BATCH SECONDS" lines not yet written

    def _error(self) -> str:
        with open(os.path.join(self.job_dir, "error"), encoding="utf-8") as f:
            return f.read().strip()

    def _write(self, name: str, data: bytes) -> None:
        fd = os.open(os.path.join(self.job_dir, name), os.O_WRONLY)
        try:
            os.write(fd, data)
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise ValueError(f"quiver: {self._error()}") from None
            raise
        finally:
            os.close(fd)

    def set_epoch(self, epoch: int) -> None:
        """Like DistributedSampler.set_epoch: each epoch is a new permutation."""
        self.epoch = epoch

    def __len__(self) -> int:
        return int(self.config["batches_per_epoch"])

    def manifest(self, batch: int) -> dict[str, Any]:
        """The manifest (paths, labels, hashes, hits) of one batch of this epoch."""
        path = os.path.join(self.job_dir, f"e{self.epoch}-b{batch}")
        try:
            with open(path, "rb") as f:
                return json.loads(f.read())
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise RuntimeError(f"quiver: {self._error()}") from None
            raise

    def _indices(self, paths: list[str]) -> list[int]:
        try:
            return [self._index[p] for p in paths]
        except KeyError as exc:
            raise RuntimeError(f"quiver sent {exc.args[0]!r}, which ImageFolder does not "
                               "list: the dataset changed under the mount?") from None

    def _flush_reports(self) -> None:
        if self._reports:
            os.write(self._report, "".join(self._reports).encode())
            self._reports = []

    def __iter__(self) -> Iterator[list[int]]:
        self._last = None
        batch = 0
        while batch < len(self):
            m = self.manifest(batch)
            for i, paths in enumerate([m["paths"], *m.get("segment", ())]):
                indices = self._indices(paths)
                now = time.monotonic()  # the loader asked for this batch then (code after
                if self._last is not None:  # the yield runs only when it asks for the next)
                    self._reports.append(f"{self.epoch} {batch} {now - self._last:.6f}\n")
                self._last = now
                if i == 0:
                    self._flush_reports()
                batch += 1
                yield indices
        self._flush_reports()

    def close(self) -> None:
        """Unregister the job (also done when the sampler is garbage collected)."""
        report = getattr(self, "_report", None)
        if report is not None:
            os.close(report)
            self._report = None
        try:
            os.rmdir(self.job_dir)
        except FileNotFoundError:
            pass

    def __del__(self) -> None:
        if hasattr(self, "job_dir"):
            try:
                self.close()
            except OSError:
                pass


def batches_per_epoch(items: int, batch_size: int, rank: int, world_size: int) -> int:
    """How many batches a rank gets: its shard size divided by the batch size, rounded up."""
    shard = items // world_size + (rank < items % world_size)
    return math.ceil(shard / batch_size)

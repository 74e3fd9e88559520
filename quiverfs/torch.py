"""``QuiverBatchSampler``: substitutable mini-batches for an unchanged file dataset.

    dataset = torchvision.datasets.ImageFolder("/mnt/quiver/imagenet/train", transform=tf)
    sampler = QuiverBatchSampler(dataset.root, batch_size=256, seed=0, dataset=dataset)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=8)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for images, labels in loader: ...

Any map-style dataset of files under the root works: a ``DatasetFolder`` of any
extensions, one with ``samples`` (a list of (path, label)), or any other given
``paths=`` (index i reads paths[i]). mountd learns the dataset's selection: a stock
DatasetFolder's extensions (its own rule), else the list of files, written to
``JOB/paths`` (``mountd.fs.job_files``); a file the mounted digest does not hold is a
ValueError. Each epoch yields every item of this rank's shard exactly once, in batches
mountd fills with whatever is cached (paper §4.7). Batches are read as manifests through
``ROOT/.quiver/jobs/JOB/next`` (one open file: a write asks for batch I of epoch E, the
reads return its manifest, the one ``JOB/eE-bI`` holds); the time between batches is
reported back to mountd.
Where the dataset is cached in full, one manifest hands out a segment of several
batches (``mountd.jobs.planner``): they are yielded without asking mountd again, their
times are reported together when the next manifest is read, and the reports and the
next segment's manifest are written and read by a thread while this one's batches are
yielded (mountd plans it ahead anyway), so the loader does not wait for them. That
starts halfway through the segment, not as it starts: an epoch's first batches are
read while the loader refills, and mountd's planning of the next segment (and the
pushes of its items) would hold up those reads. Where a segment runs to the end of the
epoch and the job moved on by one epoch last time, the next epoch's first manifest is
read ahead the same way (mountd then starts that epoch, and since the job is not
waiting for it, hands out as long a first segment as any; a job that runs another epoch
instead has it started afresh), unless the epoch is the last of the ``epochs`` the job
said it runs. A single batch's manifest
(items still being cached, or a probe timing the job) is read when the batch is asked
for.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import json
import math
import os
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from typing import Any

from torch.utils.data import Sampler

from quiverfs.job_protocol import (CONTROL_NAME, DEFAULT_SCAN_FACTOR, JOBS_NAME, Manifest,
                                   ManifestError, ask_line, batch_name, decode_manifest,
                                   report_line)

CONTROL = os.path.join(CONTROL_NAME, JOBS_NAME)
MANIFEST_READ = 4 << 20  # bytes asked per read of a manifest (mountd's files are direct_io)


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


def folder_extensions(dataset: Any, root: str) -> tuple[str, ...] | None:
    """The extensions a DatasetFolder over ``root`` selected its files by, where mountd
    can apply the same rule: torchvision's own listing, not one a subclass overrides or
    an ``is_valid_file`` chose (then ``extensions`` is None)."""
    from torchvision.datasets import DatasetFolder

    extensions = getattr(dataset, "extensions", None)
    if (not isinstance(dataset, DatasetFolder) or not extensions
            or os.path.abspath(os.fspath(dataset.root)) != root):
        return None
    cls = type(dataset)
    if (cls.find_classes is not DatasetFolder.find_classes
            or cls.make_dataset is not DatasetFolder.make_dataset):
        return None
    return (extensions,) if isinstance(extensions, str) else tuple(extensions)


def dataset_files(root: str, dataset: Any, paths: Sequence[Any] | None
                  ) -> tuple[list[Any], tuple[str, ...] | None]:
    """The file of each index of the dataset, and the extensions that select them
    (None: mountd gets the list)."""
    from torchvision.datasets.folder import IMG_EXTENSIONS

    if paths is not None:
        return list(paths), None
    if dataset is None:
        return [path for path, _ in image_folder_samples(root)], tuple(IMG_EXTENSIONS)
    samples = getattr(dataset, "samples", None)
    if samples is None:
        raise ValueError(f"quiver: {type(dataset).__name__} has no samples (a list of "
                         "(path, label)): pass paths=[...], the file of each index")
    files = [s if isinstance(s, (str, os.PathLike)) else s[0] for s in samples]
    return files, folder_extensions(dataset, root)


def relative_index(root: str, files: Sequence[Any]) -> dict[str, int]:
    """Path relative to ``root`` -> dataset index, for files each listed once under root."""
    index: dict[str, int] = {}
    for i, path in enumerate(files):
        rel = os.path.relpath(os.path.join(root, os.fspath(path)), root)
        if rel == ".." or rel.startswith("../") or rel == ".":
            raise ValueError(f"quiver: {os.fspath(path)!r} (index {i}) is not a file under "
                             f"{root}: the sampler's root must hold every file of the "
                             "dataset")
        if "\n" in rel:
            raise ValueError(f"quiver: {rel!r} (index {i}) has a newline in its name, "
                             "which a list of paths cannot carry: rename it")
        if index.setdefault(rel, i) != i:
            raise ValueError(f"quiver: the dataset lists {rel!r} twice (indices "
                             f"{index[rel]} and {i}); the sampler yields each file once "
                             "an epoch: list each once")
    if not index:
        raise ValueError(f"quiver: the dataset lists no files under {root}")
    return index


class QuiverBatchSampler(Sampler[list[int]]):
    """A batch sampler whose batches come from mountd's substitutable sampling."""

    def __init__(self, root: str, batch_size: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, dataset: Any = None, paths: Sequence[Any] | None = None,
                 job_id: str | None = None, scan_factor: int = DEFAULT_SCAN_FACTOR,
                 gpus: int = 1, epochs: int | None = None) -> None:
        """``dataset``'s files are its ``samples``, or ``paths`` (the file of each index,
        absolute or relative to ``root``); with neither, ImageFolder(root)'s. ``epochs``:
        how many the job runs (0 to epochs - 1), where known: the last one's end then
        reads no next epoch's first manifest ahead, which mountd would plan for no one."""
        self.root = os.path.abspath(root)
        self.mount_root, self.dataset_name, self.prefix = find_mount(self.root)
        files, extensions = dataset_files(self.root, dataset, paths)
        self._index = relative_index(self.root, files)
        self.job_id = job_id or f"{os.getpid()}-{uuid.uuid4().hex[:8]}-r{rank}"
        self.job_dir = os.path.join(self.mount_root, CONTROL, self.job_id)
        self.epoch = 0
        config = {"dataset": self.dataset_name, "prefix": self.prefix,
                  "batch_size": batch_size, "seed": seed, "rank": rank,
                  "world_size": world_size, "scan_factor": scan_factor, "gpus": gpus}
        if epochs is not None:
            config["epochs"] = epochs
        if extensions is not None:
            config["extensions"] = list(extensions)
        else:
            config["paths"] = len(self._index)
        os.mkdir(self.job_dir)
        try:
            if extensions is None:
                self._write("paths", "".join(f"{p}\n" for p in self._index).encode())
            self._write("config", json.dumps(config).encode())
            with open(os.path.join(self.job_dir, "config"), encoding="utf-8") as f:
                self.config = json.load(f)
            if self.config["universe"] != len(self._index):
                selection = (f"ending in {' '.join(extensions)}" if extensions
                             else "listed")
                raise ValueError(
                    f"quiver: mountd sees {self.config['universe']} files {selection} "
                    f"under {self.root}, the dataset lists {len(self._index)}: if it "
                    "selects its files otherwise, pass paths=[the file of each index]; "
                    "else remount?")
            self._report = os.open(os.path.join(self.job_dir, "report"), os.O_WRONLY)
            self._next = os.open(os.path.join(self.job_dir, "next"), os.O_RDWR)
        except BaseException:
            self.close()
            raise
        self._last: float | None = None
        self._asking = threading.Lock()  # one question and its answer at a time on _next
        self._reports: list[str] = []  # "EPOCH BATCH SECONDS" lines not yet written
        self._ahead: concurrent.futures.ThreadPoolExecutor | None = None  # reads ahead
        self._previous_epoch: int | None = None  # the epoch iterated last
        # (epoch, its first manifest) read ahead
        self._next_epoch: tuple[int, concurrent.futures.Future[Manifest]] | None = None
        # the write of an epoch's last reports, by the thread
        self._reports_sent: concurrent.futures.Future[None] | None = None

    def _error(self) -> str:
        with open(os.path.join(self.job_dir, "error"), encoding="utf-8") as f:
            return f.read().strip()

    def _write(self, name: str, data: bytes) -> None:
        fd = os.open(os.path.join(self.job_dir, name), os.O_WRONLY)
        try:
            view = memoryview(data)
            while view:  # a large write may be taken in part
                view = view[os.write(fd, view):]
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

    def manifest(self, batch: int, epoch: int | None = None) -> Manifest:
        """The manifest (paths, labels, hashes, hits) of one batch of this epoch (or of
        ``epoch``)."""
        epoch = self.epoch if epoch is None else epoch
        with self._refusal_raised():
            fd = os.open(os.path.join(self.job_dir, batch_name(epoch, batch)), os.O_RDONLY)
            try:
                return _decoded(_read_whole(fd), epoch, batch)
            finally:
                os.close(fd)

    @contextlib.contextmanager
    def _refusal_raised(self) -> Iterator[None]:
        """mountd's refusal of a manifest (EINVAL) as a RuntimeError with its reason."""
        try:
            yield
        except OSError as exc:
            if exc.errno == errno.EINVAL:
                raise RuntimeError(f"quiver: {self._error()}") from None
            raise

    def _ask(self, reports: bytes, batch: int, epoch: int, ahead: bool = False) -> Manifest:
        """Write ``reports`` and ask for batch ``batch`` of ``epoch`` in one write to
        JOB/next, and read its manifest (what ``manifest`` reads from JOB/eE-bI);
        ``ahead``: by the thread, while the loader still takes the batches before it
        (mountd then plans an epoch's first segment as long as any)."""
        with self._asking, self._refusal_raised():
            os.pwrite(self._next, reports + ask_line(epoch, batch, ahead), 0)
            return _decoded(_read_whole(self._next), epoch, batch)

    def _indices(self, paths: list[str]) -> list[int]:
        try:
            return [self._index[p] for p in paths]
        except KeyError as exc:
            raise RuntimeError(f"quiver sent {exc.args[0]!r}, which the dataset does not "
                               "list: the dataset changed under the mount?") from None

    def _flush_reports(self) -> None:
        self._write_reports(self._take_reports())

    def _take_reports(self) -> bytes:
        reports, self._reports = "".join(self._reports).encode(), []
        return reports

    def _write_reports(self, reports: bytes) -> None:
        if reports:
            os.write(self._report, reports)

    def _first_manifest(self) -> Manifest:
        """Batch 0's manifest of this epoch: the one read ahead, where it was this one's."""
        ahead, self._next_epoch = self._next_epoch, None
        if ahead is not None and ahead[0] == self.epoch:
            return ahead[1].result()
        if ahead is not None:  # another epoch was set: mountd starts this one afresh
            concurrent.futures.wait([ahead[1]])
        return self._ask(b"", 0, self.epoch)

    def __iter__(self) -> Iterator[list[int]]:
        sent, self._reports_sent = self._reports_sent, None
        if sent is not None:
            sent.result()
        self._last = None
        batch = 0
        if self._ahead is None:
            self._ahead = concurrent.futures.ThreadPoolExecutor(1, "quiver-manifest")
        ahead = self._ahead
        # an epoch's first manifest is read ahead only for a job that moves on by one,
        # and that runs another epoch (as far as it says)
        last = self.config.get("epochs")
        successive = (self._previous_epoch == self.epoch - 1
                      and (last is None or self.epoch + 1 < last))
        self._previous_epoch = self.epoch
        next_manifest: concurrent.futures.Future[Manifest] | None = None
        while batch < len(self):
            m = self._first_manifest() if batch == 0 else (
                self._ask(b"", batch, self.epoch) if next_manifest is None
                else next_manifest.result())
            batches = [m.paths, *m.segment]
            after = batch + len(batches)
            ask_at = len(batches) // 2 if len(batches) > 1 else -1  # halfway: ahead
            for i, paths in enumerate(batches):
                indices = self._indices(paths)
                now = time.monotonic()  # the loader asked for this batch then (code
                if self._last is not None:  # after the yield runs when it asks again)
                    self._reports.append(report_line(self.epoch, batch, now - self._last))
                self._last = now
                if ask_at < 0:  # a single batch: its times go now
                    next_manifest = None
                    self._flush_reports()
                elif i == ask_at and after < len(self):
                    # the reports so far, then the next manifest, in the thread
                    next_manifest = ahead.submit(self._ask, self._take_reports(), after,
                                                 self.epoch, ahead=True)
                elif i == ask_at and successive:
                    # the rest of the epoch: the next one's first manifest, in the thread
                    next_manifest = None
                    self._next_epoch = (self.epoch + 1, ahead.submit(
                        self._ask, self._take_reports(), 0, self.epoch + 1, ahead=True))
                batch += 1
                yield indices
        # the last batches' times: by the thread, after what it reads ahead, so that the
        # loader's next epoch does not wait for the write (the next one's start and close
        # do; the next start raises what it met)
        self._reports_sent = ahead.submit(self._write_reports, self._take_reports())

    def close(self) -> None:
        """Unregister the job (also done when the sampler is garbage collected)."""
        ahead = getattr(self, "_ahead", None)
        if ahead is not None:  # a read ahead finished
            ahead.shutdown()
            self._ahead = None
        for name in ("_report", "_next"):
            fd = getattr(self, name, None)
            if fd is not None:
                os.close(fd)
                setattr(self, name, None)
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


def _decoded(data: bytes, epoch: int, batch: int) -> Manifest:
    """The manifest of batch ``batch`` of ``epoch`` in ``data``, as mountd returned it."""
    try:
        manifest = decode_manifest(data)
    except ManifestError as exc:
        raise RuntimeError(f"quiver: mountd returned {exc} for batch {batch} of epoch "
                           f"{epoch}: is mountd the version of this sampler?") from None
    if (manifest.epoch, manifest.batch) != (epoch, batch):
        raise RuntimeError(f"quiver: mountd returned the manifest of batch {manifest.batch} "
                           f"of epoch {manifest.epoch} when asked for batch {batch} of "
                           f"epoch {epoch}")
    return manifest


def _read_whole(fd: int) -> bytes:
    """A job file's content from offset 0. It is read past its end on the first short
    read: no read (a request to mountd) just to see EOF."""
    chunks = [os.pread(fd, MANIFEST_READ, 0)]
    while len(chunks[-1]) == MANIFEST_READ:
        chunks.append(os.pread(fd, MANIFEST_READ, MANIFEST_READ * len(chunks)))
    return b"".join(chunks)


def batches_per_epoch(items: int, batch_size: int, rank: int, world_size: int) -> int:
    """How many batches a rank gets: its shard size divided by the batch size, rounded up."""
    shard = items // world_size + (rank < items % world_size)
    return math.ceil(shard / batch_size)

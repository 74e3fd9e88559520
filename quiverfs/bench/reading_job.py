"""A benchmark's training job, on its side of the pipe: where it reads, how it plans its
batches, and the reader threads that load them ahead of its (simulated) compute.

Run as ``python -m quiverfs.bench.reading_job SPEC`` this module is one job that runs
an epoch for each ``go`` line on its stdin (the substitution and cluster benchmarks).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import queue
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import TracebackType
from typing import Any

import numpy as np

from quiverfs.bench.emulator import gcs_client
from quiverfs.counters import SamplerJobCounter

READERS = 4  # reader threads per job, like DataLoader workers
PREFETCH_BATCHES = 2  # batches a job's readers may run ahead of its compute
# On an open file of a substitutable view: the item served (hex SHA-256, digest path).
SERVED_HASH = "user.quiver.served.sha256"
SERVED_PATH = "user.quiver.served.path"


def read_dropping_pages(path: str) -> bytes:
    """A file's bytes, its pages then dropped: the kernel's page cache must not stand in
    for the cache under test (a real dataset would not fit in RAM)."""
    with open(path, "rb", buffering=0) as f:
        data = f.read()
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    return data


class MountSource:
    """The dataset's files in a mount."""

    def __init__(self, root: str) -> None:
        self.root = root

    def paths(self) -> list[str]:
        return sorted(os.path.relpath(os.path.join(d, f), self.root)
                      for d, _, fs in os.walk(self.root) for f in fs)

    def read(self, path: str) -> int:
        return len(read_dropping_pages(os.path.join(self.root, path)))

    def close(self) -> None:
        pass


@dataclasses.dataclass(frozen=True)
class Served:
    """What a view served for one open: the item's SHA-256 and digest path (from the
    open file's xattrs) and whether the bytes read hash to that SHA-256."""

    sha256: str
    path: str
    intact: bool


class ViewSource(MountSource):
    """The dataset's files in a substitutable view: while ``checked``, each read also
    records what the view served for it (``take_served``); else it only reads, as a
    training job would. The view's files are direct_io: no pages to drop."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.checked = True
        self._lock = threading.Lock()
        self._served: dict[str, Served] = {}

    def read(self, path: str) -> int:
        with open(os.path.join(self.root, path), "rb", buffering=0) as f:
            data = f.read()
            if not self.checked:
                return len(data)
            # asked by the thread that opened: the view answers for that open
            sha = os.getxattr(f.fileno(), SERVED_HASH).decode()
            served = Served(sha, os.getxattr(f.fileno(), SERVED_PATH).decode(),
                            hashlib.sha256(data).hexdigest() == sha)
        with self._lock:
            self._served[path] = served
        return len(data)

    def take_served(self, paths: list[str]) -> list[Served]:
        """What was served for each of ``paths`` (read since the last call), in order."""
        with self._lock:
            served, self._served = self._served, {}
        return [served[p] for p in paths]


def bucket_address(endpoint: str, bucket: str, prefix: str) -> str:
    """A job's source for reading ``gs://bucket/prefix/`` at ``endpoint`` (BucketSource)."""
    return f"{endpoint} {bucket} {prefix}"


class BucketSource:
    """The dataset's objects, read with the GCS client (one client per reader thread)."""

    def __init__(self, address: str) -> None:
        self.endpoint, self.bucket, prefix = address.split(" ")
        self.prefix = prefix.strip("/") + "/"
        self._local = threading.local()
        self._lock = threading.Lock()
        self._clients: list[Any] = []

    def _client(self) -> Any:
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._local.client = gcs_client(self.endpoint)
            with self._lock:
                self._clients.append(client)
        return client

    def paths(self) -> list[str]:
        blobs = self._client().list_blobs(self.bucket, prefix=self.prefix)
        return sorted(b.name[len(self.prefix):] for b in blobs)

    def read(self, path: str) -> int:
        blob = self._client().bucket(self.bucket).blob(self.prefix + path)
        return len(blob.download_as_bytes(checksum=None))

    def close(self) -> None:
        with self._lock:
            clients, self._clients = self._clients, []
        for client in clients:
            client.close()


class SamplerPlans:
    """Batches from ``QuiverBatchSampler``, iterated as a DataLoader does (so mountd gets
    the time between batches, which its probes measure); hits from the job's ``stats``."""

    def __init__(self, root: str, batch_size: int, seed: int) -> None:
        from quiverfs.torch import QuiverBatchSampler, image_folder_samples

        self.paths = [os.path.relpath(p, root) for p, _ in image_folder_samples(root)]
        self.sampler = QuiverBatchSampler(root, batch_size, seed=seed)
        self.job_id: str | None = self.sampler.job_id
        self.wait_s = 0.0  # time spent waiting for the sampler's batches
        self._hits = 0

    def epoch(self, epoch: int) -> Iterator[list[str]]:
        self.sampler.set_epoch(epoch)
        batches = iter(self.sampler)
        while True:
            asked = time.monotonic()
            indices = next(batches, None)
            self.wait_s += time.monotonic() - asked
            if indices is None:
                return
            yield [self.paths[i] for i in indices]

    def hits(self) -> int | None:
        """Items the manifests listed as hits since the last call."""
        with open(os.path.join(self.sampler.job_dir, "stats"), encoding="utf-8") as f:
            total = int(json.load(f)["counters"].get(SamplerJobCounter.HITS, 0))
        new, self._hits = total - self._hits, total
        return new

    def close(self) -> None:
        self.sampler.close()


class ShufflePlans:
    """Batches of a seeded permutation of every path (exact reads; no hit count)."""

    job_id: str | None = None  # no sampler: mountd knows no job
    wait_s = 0.0  # batches are planned locally

    def __init__(self, paths: list[str], batch_size: int, seed: int) -> None:
        self.paths = paths
        self.batch_size = batch_size
        self.seed = seed

    def epoch(self, epoch: int) -> Iterator[list[str]]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.paths))
        for start in range(0, len(order), self.batch_size):
            yield [self.paths[i] for i in order[start:start + self.batch_size]]

    def hits(self) -> int | None:
        return None

    def close(self) -> None:
        pass


class JobInput:
    """A job's source (a mount's directory, a substitutable view's, or a
    ``bucket_address``), its reader threads, and its batch plans (the sampler's, or a
    shuffle of the source's paths)."""

    def __init__(self, source: str, from_bucket: bool, sampler: bool, batch_size: int,
                 seed: int, view: bool = False) -> None:
        self.source: MountSource | ViewSource | BucketSource = (
            BucketSource(source) if from_bucket else ViewSource(source) if view
            else MountSource(source))
        self.pool = concurrent.futures.ThreadPoolExecutor(READERS)
        try:
            self.plans: SamplerPlans | ShufflePlans = (
                SamplerPlans(source, batch_size, seed) if sampler
                else ShufflePlans(self.source.paths(), batch_size, seed))
        except BaseException:
            self.pool.shutdown()
            self.source.close()
            raise

    def __enter__(self) -> JobInput:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        self.pool.shutdown()
        self.plans.close()
        self.source.close()


def loaded_batches(read: Callable[[str], int], pool: concurrent.futures.Executor,
                   plans: Iterator[list[str]]) -> Iterator[tuple[list[str], int]]:
    """(paths, bytes read) per planned batch, read by ``pool`` up to PREFETCH_BATCHES
    batches ahead of the consumer."""
    ready: queue.Queue[tuple[list[str], int] | BaseException | None] = queue.Queue(
        PREFETCH_BATCHES)

    def produce() -> None:
        try:
            for paths in plans:
                ready.put((paths, sum(pool.map(read, paths))))
            ready.put(None)
        except BaseException as exc:  # handed to the consumer, which raises it
            ready.put(exc)

    producer = threading.Thread(target=produce, name="loader", daemon=True)
    producer.start()
    while (item := ready.get()) is not None:
        if isinstance(item, BaseException):
            raise item
        yield item
    producer.join()


@dataclasses.dataclass(frozen=True)
class JobSpec:
    """What one epoch-by-epoch job does; sent to it as JSON on its command line."""

    # "sub" (the sampler), "lru" (a shuffle, exact reads), "view" (a shuffle read through
    # a substitutable view) or "direct" (a shuffle read from the bucket)
    mode: str
    source: str  # the dataset's directory in a mount; for "direct" a bucket_address
    seed: int
    batch_size: int
    compute_s: float  # simulated compute per batch (seconds)
    epochs: int


# The lines that start an epoch: in a view, ``go`` records what each open served (two
# xattr requests and a hash an item), ``go unchecked`` only reads.
EPOCH_COMMANDS = ("go", "go unchecked")


def job_main(argv: list[str]) -> int:
    """One job: announce readiness (and mountd's job id), then run an epoch for each
    EPOCH_COMMANDS line on stdin, answering with a JSON line (paths in order, manifest
    hits or null, bytes, seconds, the seconds spent waiting for the sampler's batches,
    and in a view, after ``go``, what was served for each path: [sha256, path, intact])."""
    spec = JobSpec(**json.loads(argv[0]))
    with JobInput(spec.source, spec.mode == "direct", spec.mode == "sub", spec.batch_size,
                  spec.seed, view=spec.mode == "view") as job:
        plans = job.plans
        print(json.dumps({"ready": True, "job": plans.job_id}), flush=True)
        for epoch in range(spec.epochs):
            command = sys.stdin.readline().strip()
            if command not in EPOCH_COMMANDS:
                return 1
            checked = isinstance(job.source, ViewSource) and command == "go"
            if isinstance(job.source, ViewSource):
                job.source.checked = checked
            start = time.monotonic()
            paths: list[str] = []
            nbytes = 0
            for batch, batch_bytes in loaded_batches(job.source.read, job.pool,
                                                     plans.epoch(epoch)):
                time.sleep(spec.compute_s)  # the simulated training step
                paths += batch
                nbytes += batch_bytes
            seconds = time.monotonic() - start
            served = ([dataclasses.astuple(x) for x in job.source.take_served(paths)]
                      if checked else None)
            print(json.dumps({"epoch": epoch, "seconds": seconds, "paths": paths,
                              "hits": plans.hits(), "bytes": nbytes,
                              "manifest_s": plans.wait_s, "served": served}), flush=True)
            plans.wait_s = 0.0
        sys.stdin.readline()  # the parent reads mountd's status before we unregister
    return 0


if __name__ == "__main__":
    sys.exit(job_main(sys.argv[1:]))

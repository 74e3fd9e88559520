"""Hash many objects of a backend in parallel, streaming, with bounded memory.

Local files are hashed in batches (one task per ~16 MiB of files) so that the
per-task cost of the thread pool does not eat into hashing, which runs outside the
GIL (``hashlib`` and ``readinto`` release it); remote objects are one task each,
since their time goes into waiting on the network.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator

from quiverfs.backends import Backend, ObjectInfo
from quiverfs.backends.local import LocalBackend, os_error
from quiverfs.errors import QuietError

log = logging.getLogger(__name__)

BLOCK = 1 << 20  # read size: whole typical items in one call, bounded memory per worker
BATCH_BYTES = 16 << 20  # local files per task, by size ...
BATCH_ITEMS = 256  # ... and by count (many tiny files)
IN_FLIGHT_PER_WORKER = 2  # queued tasks per worker: keeps workers busy, memory bounded

Result = tuple[bytes | QuietError, int]  # (sha256 or the error reading it, bytes read)


def _hash_local(path: str, buf: bytearray) -> tuple[bytes, int]:
    h = hashlib.sha256()
    view = memoryview(buf)
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            while n := f.readinto(buf):
                h.update(view[:n])
                size += n
    except OSError as exc:
        raise os_error(exc, path) from None
    return h.digest(), size


class _HashSink:
    def __init__(self) -> None:
        self.h = hashlib.sha256()

    def write(self, data: bytes) -> int:
        self.h.update(data)
        return len(data)


def hash_object(backend: Backend, key: str, buf: bytearray | None = None) -> tuple[bytes, int]:
    """SHA-256 and size of one object, read in pieces (local files through ``buf``)."""
    if isinstance(backend, LocalBackend):
        return _hash_local(os.path.join(backend.root, key), buf or bytearray(BLOCK))
    sink = _HashSink()
    size = backend.stream_into(key, sink)
    return sink.h.digest(), size


def _hash_batch(backend: Backend, batch: list[ObjectInfo]) -> list[Result]:
    buf = bytearray(BLOCK) if isinstance(backend, LocalBackend) else None
    results: list[Result] = []
    for obj in batch:
        try:
            results.append(hash_object(backend, obj.key, buf))
        except QuietError as exc:
            results.append((exc, 0))
    return results


def _batches(objects: Iterable[ObjectInfo], max_bytes: int,
             max_items: int) -> Iterator[list[ObjectInfo]]:
    batch: list[ObjectInfo] = []
    size = 0
    for obj in objects:
        batch.append(obj)
        size += obj.size
        if size >= max_bytes or len(batch) >= max_items:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def hash_many(backend: Backend, objects: Iterable[ObjectInfo], workers: int,
              on_done: Callable[[int], None] | None = None
              ) -> Iterator[tuple[ObjectInfo, bytes | QuietError, int]]:
    """Yield (object, sha256 or the error reading it, bytes read), in completion order.

    At most ``IN_FLIGHT_PER_WORKER * workers`` batches are queued, so memory stays
    bounded however many objects there are.
    """
    if isinstance(backend, LocalBackend):
        batches = _batches(objects, BATCH_BYTES, BATCH_ITEMS)
    else:
        batches = _batches(objects, 0, 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                               thread_name_prefix="hash") as pool:
        pending: dict[concurrent.futures.Future, list[ObjectInfo]] = {}
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < IN_FLIGHT_PER_WORKER * workers:
                batch = next(batches, None)
                if batch is None:
                    exhausted = True
                else:
                    pending[pool.submit(_hash_batch, backend, batch)] = batch
            if not pending:
                break
            done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
            for fut in done:
                for obj, (result, size) in zip(pending.pop(fut), fut.result()):
                    if on_done and not isinstance(result, QuietError):
                        on_done(size)
                    yield obj, result, size


def progress(total_bytes: int, desc: str) -> Callable[[int], None] | None:
    """A byte-progress callback drawing a bar on a terminal; None when stderr is not one."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, leave=False)
    return bar.update


def default_workers() -> int:
    """One hashing worker per CPU, at most 32."""
    return max(1, min(32, (os.cpu_count() or 1)))


__all__ = ["hash_many", "hash_object", "progress", "default_workers"]

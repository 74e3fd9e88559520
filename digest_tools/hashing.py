"""Hash many objects of a backend in parallel, streaming, with bounded memory."""
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

BLOCK = 1 << 20


def _hash_local(path: str) -> tuple[bytes, int]:
    h = hashlib.sha256()
    size = 0
    try:
        with open(path, "rb", buffering=0) as f:
            buf = bytearray(BLOCK)
            view = memoryview(buf)
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


def hash_object(backend: Backend, key: str) -> tuple[bytes, int]:
    """SHA-256 and size of one object, read in pieces."""
    if isinstance(backend, LocalBackend):
        return _hash_local(os.path.join(backend.root, key))
    sink = _HashSink()
    size = backend.stream_into(key, sink)
    return sink.h.digest(), size


def hash_many(backend: Backend, objects: Iterable[ObjectInfo], workers: int,
              on_done: Callable[[int], None] | None = None
              ) -> Iterator[tuple[ObjectInfo, bytes | QuietError, int]]:
    """Yield (object, sha256 or the error reading it, bytes read), in completion order.

    At most ``4 * workers`` hashes are in flight, so memory stays bounded however
    many objects there are.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers,
                                               thread_name_prefix="hash") as pool:
        pending: dict[concurrent.futures.Future, ObjectInfo] = {}
        it = iter(objects)
        exhausted = False
        while pending or not exhausted:
            while not exhausted and len(pending) < 4 * workers:
                try:
                    obj = next(it)
                except StopIteration:
                    exhausted = True
                    break
                pending[pool.submit(hash_object, backend, obj.key)] = obj
            if not pending:
                break
            done, _ = concurrent.futures.wait(pending, return_when="FIRST_COMPLETED")
            for fut in done:
                obj = pending.pop(fut)
                try:
                    digest, size = fut.result()
                except QuietError as exc:
                    yield obj, exc, 0
                    continue
                if on_done:
                    on_done(size)
                yield obj, digest, size


def progress(total_bytes: int, desc: str) -> Callable[[int], None] | None:
    """A byte-progress callback drawing a bar on a terminal; None when stderr is not one."""
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    bar = tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, leave=False)
    return bar.update


def default_workers() -> int:
    return max(1, min(32, (os.cpu_count() or 1)))


__all__ = ["hash_many", "hash_object", "progress", "default_workers"]

"""``quiver digest create``: walk a source, hash every item, write a digest."""
from __future__ import annotations

import logging

from digest_tools.hashing import hash_many, progress
from quiverfs import digest as digest_format
from quiverfs.backends import Backend, StorageOptions, open_backend
from quiverfs.dataset_name import check_name
from quiverfs.errors import ExitCode, QuietError

log = logging.getLogger(__name__)


def create_digest(src: str, name: str | None, workers: int, label_level: int = 1,
                  options: StorageOptions | None = None) -> bytes:
    """Return the digest file bytes for every object under ``src``."""
    backend = open_backend(src, options)
    try:
        return _create(backend, _dataset_name(backend, name), workers, label_level)
    finally:
        backend.close()


def _dataset_name(backend: Backend, name: str | None) -> str:
    """``name``, or the last component of the source; checked now, before hours of
    hashing, by the rule 'quiver mount' applies."""
    if name is not None:
        return check_name(name)
    default = backend.uri.rstrip("/").rsplit("/", 1)[-1] or "dataset"
    try:
        return check_name(default)
    except QuietError as exc:
        raise QuietError(f"{exc.message}; it is the last component of {backend.uri}: "
                         "pass --name NAME", exc.exitcode) from None


def _create(backend: Backend, name: str, workers: int, label_level: int) -> bytes:
    objects = sorted(backend.list(), key=lambda o: o.key)
    if not objects:
        raise QuietError(f"{backend.uri} holds no files: nothing to digest", ExitCode.BAD_INPUT)
    total = sum(o.size for o in objects)
    log.info("hashing %d items (%d bytes) from %s with %d workers",
             len(objects), total, backend.uri, workers)
    items: list[digest_format.NewItem] = []
    for obj, result, size in hash_many(backend, objects, workers,
                                       progress(total, "hashing")):
        if isinstance(result, QuietError):
            raise result
        if size != obj.size:
            raise QuietError(f"{backend.object_uri(obj.key)} changed size while being read "
                             f"({obj.size} -> {size}): digest a stable copy", ExitCode.BAD_INPUT)
        items.append(digest_format.NewItem(obj.key, result, size))
    return digest_format.encode(name, backend.uri, items, label_level)

"""``quiver digest verify``: re-read a digest's sources and compare hashes and sizes."""
from __future__ import annotations

import dataclasses

from digest_tools.hashing import hash_many, progress
from quiverfs.backends import ObjectInfo, StorageOptions, open_backend
from quiverfs.digest import Digest
from quiverfs.errors import ExitCode, QuietError


@dataclasses.dataclass
class Problem:
    """One item that no longer matches its digest entry."""

    path: str
    kind: str  # "missing", "unreadable", "mismatch"
    detail: str


def verify_digest(digest: Digest, workers: int,
                  options: StorageOptions | None = None) -> list[Problem]:
    """Return every item whose source is missing, unreadable or has other content."""
    if digest.loc_offsets is not None:
        raise QuietError("verify does not support items packed at offsets yet",
                         ExitCode.BAD_DIGEST)
    backend = open_backend(digest.source, options)
    by_key = {digest.key(i): i for i in range(len(digest))}
    objects = [ObjectInfo(key, digest.sizes[i]) for key, i in by_key.items()]
    problems: list[Problem] = []
    try:
        for obj, result, size in hash_many(backend, objects, workers,
                                           progress(digest.total_bytes, "verifying")):
            i = by_key[obj.key]
            if isinstance(result, QuietError):
                kind = "missing" if result.exitcode == ExitCode.NOT_FOUND else "unreadable"
                if result.exitcode not in (ExitCode.NOT_FOUND, ExitCode.PERMISSION):
                    raise result
                problems.append(Problem(digest.path(i), kind, result.message))
            elif result != digest.hash(i) or size != digest.sizes[i]:
                problems.append(Problem(digest.path(i), "mismatch",
                                        f"sha256 {result.hex()} size {size}, digest says "
                                        f"{digest.hash(i).hex()} size {digest.sizes[i]}"))
    finally:
        backend.close()
    return sorted(problems, key=lambda p: p.path)

"""A synthetic dataset in the GCS emulator's bucket, as the benchmarks' parents know it."""
from __future__ import annotations

import dataclasses
import os
import shutil

from digest_tools.create import create_digest
from quiverfs import digest as digest_format
from quiverfs.backends import StorageOptions
from quiverfs.bench.data import write_synthetic_tree
from quiverfs.bench.emulator import upload_tree

DIGEST_WORKERS = 4  # threads hashing the bucket's objects


@dataclasses.dataclass(frozen=True)
class Dataset:
    """A dataset in the bucket: its digest, paths (digest order), labels and bytes."""

    digest: bytes
    paths: list[str]
    labels: list[str]
    bytes: int

    @classmethod
    def from_digest(cls, data: bytes) -> Dataset:
        d = digest_format.decode(data)
        return cls(data, [d.path(i) for i in range(len(d))],
                   [d.label(i) for i in range(len(d))], d.total_bytes)


def upload_synthetic(emulator_host: str, bucket: str, prefix: str, workdir: str, items: int,
                     classes: int, seed: int, mean_size: int = 110_000,
                     upload_host: str | None = None) -> Dataset:
    """Write a synthetic tree under ``workdir``, upload it to ``gs://bucket/prefix/``
    (through ``upload_host`` if given, else to the emulator) and digest it from the
    emulator; the local copy is removed."""
    src = os.path.join(workdir, "src", prefix)
    write_synthetic_tree(src, items, classes, seed=seed, mean_size=mean_size)
    upload_tree(upload_host or emulator_host, bucket, prefix, src)
    shutil.rmtree(os.path.join(workdir, "src"))
    return Dataset.from_digest(create_digest(
        f"gs://{bucket}/{prefix}", prefix, workers=DIGEST_WORKERS,
        options=StorageOptions(emulator_host=emulator_host)))

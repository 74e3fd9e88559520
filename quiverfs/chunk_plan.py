"""Chunks of a dataset: striped partitions over a seeded permutation (paper §5.1).

The items are permuted with a seed derived from the digest (so every node and job
computes the same plan), optionally stably sorted by a key such as item length, and
cut into K contiguous partitions. Each partition is cut into K stripe units; chunk j
is unit j of every partition. Without a sort key every chunk is a uniform sample of
the dataset (ImageFolder digests are sorted by class, so contiguous chunks would not
be); with one, each stripe unit holds items of similar key while every chunk still
spans the whole range of keys.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from quiverfs.digest import Digest

DEFAULT_FRACTION = 0.10  # of the dataset's bytes
DEFAULT_MAX_CHUNK = 15 << 30  # bytes
# A lone node's chunks are at most this fraction of its cache, so that the budget holds
# several of them (a deep pipeline: up to 6 resident, with the allocation's headroom).
CACHE_CHUNKS = 8
SORT_KEYS = ("size",)


@dataclasses.dataclass(frozen=True)
class ChunkPlan:
    """Which chunk each item belongs to, and each chunk's items in stripe order."""

    chunk_of: np.ndarray  # int32 per item
    members: tuple[np.ndarray, ...]  # item indices per chunk
    chunk_bytes: tuple[int, ...]

    @property
    def n_chunks(self) -> int:
        return len(self.members)


def default_chunk_bytes(total_bytes: int) -> float:
    """10% of the dataset or 15 GiB, whichever is smaller (as in the paper)."""
    return max(1.0, min(total_bytes * DEFAULT_FRACTION, DEFAULT_MAX_CHUNK))


def plan_seed(digest: Digest) -> int:
    return int(digest.identity[:16], 16) if digest.identity else 0


def make_plan(digest: Digest, chunk_bytes: int | None = None,
              sort_key: str | None = None) -> ChunkPlan:
    """The chunk plan of ``digest``; the same digest and settings give the same plan."""
    n = len(digest)
    sizes = np.frombuffer(digest.sizes, dtype="<u8") if n else np.zeros(0, dtype=np.uint64)
    total = int(sizes.sum())
    target = chunk_bytes or default_chunk_bytes(total)
    k = max(1, min(n, math.ceil(total / target - 1e-9))) if n else 1
    order = np.random.default_rng(plan_seed(digest)).permutation(n)
    if sort_key == "size":
        order = order[np.argsort(sizes[order], kind="stable")]
    elif sort_key is not None:
        raise ValueError(f"unknown sort key {sort_key!r} (known: {', '.join(SORT_KEYS)})")
    units: list[list[np.ndarray]] = [[] for _ in range(k)]
    for p, partition in enumerate(np.array_split(order, k)):
        # The leftover items of each partition go to different units in turn, so chunk
        # sizes differ by at most one item.
        base, extra = divmod(len(partition), k)
        counts = [base + ((j - p) % k < extra) for j in range(k)]
        for j, unit in enumerate(np.split(partition, np.cumsum(counts)[:-1])):
            units[j].append(unit)
    members = tuple(np.concatenate(u).astype(np.int64) for u in units)
    chunk_of = np.empty(n, dtype=np.int32)
    for j, items in enumerate(members):
        chunk_of[items] = j
    return ChunkPlan(chunk_of, members, tuple(int(sizes[m].sum()) for m in members))

"""Chunks of a dataset: partitions over a seeded permutation (paper §5.1).

The items are permuted with a seed derived from the digest, so every node and job
computes the same plan. Without a sort key the chunks are stratified by label: each
label's items are spread evenly over the ring of chunks, so that any c consecutive
chunks hold c/K of every label, to one item. A substitutable view serves each label
from the chunks at hand, and a run of chunks short of a label would make its readers
miss that label until the cycle came round to it (ImageFolder digests are sorted by
class, so contiguous chunks would be the worst case). With a sort key such as item
length, the permutation is stably sorted by it and cut into K contiguous partitions,
each cut into K stripe units; chunk j is unit j of every partition, so each unit holds
items of similar key while every chunk spans the whole range of keys. Either way each
chunk is a uniform sample of the dataset, and lists its items in the permutation's
order, the order they are loaded in.
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
    if sort_key is None:
        return _by_label(digest, order, k, sizes)
    if sort_key == "size":
        order = order[np.argsort(sizes[order], kind="stable")]
    else:
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


def _by_label(digest: Digest, order: np.ndarray, k: int, sizes: np.ndarray) -> ChunkPlan:
    """K chunks of equal item counts (to one) with every label spread evenly over the
    ring: each item is placed at its position among its label's items (taken in
    ``order``) as a fraction of them; items sorted by place (ties in ``order``) are cut
    into K pieces."""
    n = len(order)
    labels = np.asarray(digest.label_index, dtype=np.int64)
    by_label = order[np.argsort(labels[order], kind="stable")]
    counts = np.bincount(labels, minlength=1)
    first = np.repeat(np.cumsum(counts) - counts, counts)  # where each label starts
    place = np.empty(n)
    place[by_label] = (np.arange(n) - first + 0.5) / counts[labels[by_label]]
    chunk_of = np.empty(n, dtype=np.int32)
    chunk_of[order[np.argsort(place[order], kind="stable")]] = np.arange(n) * k // max(n, 1)
    in_order = order[np.argsort(chunk_of[order], kind="stable")].astype(np.int64)
    members = tuple(np.split(in_order, np.cumsum(np.bincount(chunk_of, minlength=k))[:-1]))
    return ChunkPlan(chunk_of, members, tuple(int(sizes[m].sum()) for m in members))

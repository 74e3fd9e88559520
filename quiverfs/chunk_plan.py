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

The stratified chunks are then evened out in bytes: item sizes vary, so chunks of
equal counts do not hold equal bytes (the fewer items a chunk, the further its largest
is above the mean), and the coordinator sizes a dataset's resident chunks by its
largest, which leaves the rest of the budget unused. A chunk
swaps items of one label with the chunks that follow it until its bytes are nearest its
share of what is left. Every chunk keeps its count of every label.
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
# Evening out a chunk's bytes: it swaps items with the next SWAP_WINDOW chunks, at most
# MAX_SWAPS times (small chunks need one or two; large ones differ little in bytes).
SWAP_WINDOW = 4
MAX_SWAPS = 16
SWAP_CANDIDATES = 2048  # items of a chunk (and of each chunk in its window) considered


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
    _even_bytes(chunk_of, sizes.astype(np.int64), labels, k)
    in_order = order[np.argsort(chunk_of[order], kind="stable")].astype(np.int64)
    members = tuple(np.split(in_order, np.cumsum(np.bincount(chunk_of, minlength=k))[:-1]))
    return ChunkPlan(chunk_of, members, tuple(int(sizes[m].sum()) for m in members))


def _even_bytes(chunk_of: np.ndarray, sizes: np.ndarray, labels: np.ndarray, k: int) -> None:
    """Swap items of one label between chunk j and the next SWAP_WINDOW chunks, for j in
    ring order, until chunk j's bytes are nearest its share of the bytes left (in place).
    Each swap is the one (of an item of chunk j and the nearest-sized fit of its label)
    that brings the chunk nearest its share; no item moves twice for one chunk. Large
    chunks offer an even sample of SWAP_CANDIDATES of their items (index order is
    label order in an ImageFolder digest, so a stride samples every label)."""
    if len(sizes) == 0:
        return
    scale = int(sizes.max()) + 1  # keys label * scale + size sort by label, then size
    left = int(sizes.sum())
    for j in range(k - 1):
        members = np.flatnonzero(chunk_of == j)
        own_bytes = int(sizes[members].sum())
        own = members[::-(-len(members) // SWAP_CANDIDATES)]
        pool = np.flatnonzero((chunk_of > j) & (chunk_of <= j + SWAP_WINDOW))
        pool = pool[::-(-len(pool) // (SWAP_CANDIDATES * SWAP_WINDOW))]
        keys = labels[pool] * scale + sizes[pool]
        by_key = np.argsort(keys, kind="stable")
        pool, keys = pool[by_key], keys[by_key]
        own_free = np.ones(len(own), dtype=bool)
        pool_free = np.ones(len(pool), dtype=bool)
        for _ in range(MAX_SWAPS):
            excess = own_bytes - left / (k - j)
            # the pool item of the same label whose size is nearest size - excess
            want = labels[own] * scale + np.clip(sizes[own] - excess, 0, scale - 1)
            at = np.searchsorted(keys, want)
            best, swap = abs(excess), None
            for fit in (np.clip(at - 1, 0, len(keys) - 1), np.clip(at, 0, len(keys) - 1)):
                after = np.abs(excess - (sizes[own] - sizes[pool[fit]]))
                ok = own_free & pool_free[fit] & (keys[fit] // scale == labels[own])
                i = int(np.argmin(np.where(ok, after, np.inf)))
                if ok[i] and after[i] < best:
                    best, swap = after[i], (i, int(fit[i]))
            if swap is None:
                break
            i, f = swap
            chunk_of[own[i]], chunk_of[pool[f]] = chunk_of[pool[f]], j
            own_bytes -= int(sizes[own[i]]) - int(sizes[pool[f]])
            own_free[i] = pool_free[f] = False
        left -= own_bytes

"""A view's pools: the items of a digest that may stand in for one another (the same
directory and lower-case extension, so the same label). Shared by every registration
of the digest (mountd.datasets.shared_digests), so read-only."""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Sequence

import numpy as np

from quiverfs.digest import Digest
from quiverfs.digest_checks import HASH_LEN


@dataclasses.dataclass(frozen=True, eq=False)
class PoolMembers(Sequence[np.ndarray]):
    """The item indices of each pool, ascending: views of one array, so that a digest
    of many small pools costs no array object per pool."""

    order: np.ndarray  # item indices, pool by pool
    bounds: np.ndarray  # pool p's items are order[bounds[p]:bounds[p + 1]]

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def __getitem__(self, pool: int) -> np.ndarray:  # type: ignore[override]
        return self.order[self.bounds[pool]:self.bounds[pool + 1]]

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self[p] for p in range(len(self)))


@dataclasses.dataclass(frozen=True)
class ViewPools:
    """The pools of a view's digest: items that may stand in for one another. Shared by
    every registration of the digest (mountd.datasets.shared_digests), so read-only."""

    pool_of: np.ndarray  # int32 per item
    members: PoolMembers  # item indices per pool
    shared: np.ndarray  # bool per item: its pool has others (it may be substituted)
    # the items by their hash's first 8 bytes (as uint64), and those keys in that order:
    # which items a hash the store evicted stands for (``items_with``)
    by_hash: np.ndarray
    hash_keys: np.ndarray

    @classmethod
    def of(cls, digest: Digest) -> ViewPools:
        """Pools by (directory, lower-case extension) of labelled items; an unlabelled
        item is a pool of its own."""
        keys: dict[tuple[str, str], int] = {}
        pool_of = np.empty(len(digest), dtype=np.int32)
        for i in range(len(digest)):
            path = digest.path(i)
            if not digest.label(i):
                key = (path, "")  # a path is never also a directory: no clash
            else:
                dirname, _, name = path.rpartition("/")
                key = (dirname, os.path.splitext(name)[1].lower())
            pool_of[i] = keys.setdefault(key, len(keys))
        order = np.argsort(pool_of, kind="stable").astype(np.int64, copy=False)
        bounds = np.searchsorted(pool_of[order], np.arange(len(keys) + 1))
        shared = np.diff(bounds)[pool_of] > 1
        keys = _hash_words(digest.hashes)[:, 0]
        by_hash = np.argsort(keys, kind="stable")
        hash_keys = keys[by_hash]
        for array in (pool_of, order, bounds, shared, by_hash, hash_keys):
            array.flags.writeable = False
        return cls(pool_of, PoolMembers(order, bounds), shared, by_hash, hash_keys)

    def items_with(self, digest: Digest, hashes: Sequence[bytes]) -> np.ndarray:
        """The items of ``digest`` (these pools') whose content hashes to one of
        ``hashes``: every copy where the digest lists one content twice."""
        hashes = [h for h in hashes if len(h) == HASH_LEN]
        wanted = _hash_words(b"".join(hashes))
        low = np.searchsorted(self.hash_keys, wanted[:, 0], "left")
        counts = np.searchsorted(self.hash_keys, wanted[:, 0], "right") - low
        # each wanted hash against every item whose first 8 bytes match it (one, nearly
        # always), all 32 bytes compared
        which = np.repeat(np.arange(len(wanted)), counts)
        starts = np.repeat(low - (np.cumsum(counts) - counts), counts)
        items = self.by_hash[starts + np.arange(len(which))]
        same = (_hash_words(digest.hashes)[items] == wanted[which]).all(axis=1)
        return items[same].astype(np.int64, copy=False)


def _hash_words(hashes: bytes | memoryview) -> np.ndarray:
    """The 32-byte hashes laid end to end, as rows of four uint64 (no copy)."""
    return np.frombuffer(hashes, dtype=np.uint64).reshape(-1, HASH_LEN // 8)


def has_labels(digest: Digest) -> bool:
    return any(digest.labels)

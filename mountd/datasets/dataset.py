"""A mounted dataset: its registration, digest, tree, backend and counters."""
from __future__ import annotations

import dataclasses
from collections import Counter

import trio

from mountd.datasets.memory_budget import DigestCost
from mountd.datasets.pools import ViewPools
from mountd.datasets.registry import Registration
from mountd.datasets.tree import DatasetTree
from quiverfs.backends import Backend
from quiverfs.counters import ReadCounter
from quiverfs.digest import Digest
from quiverfs.heartbeat import CacheMode


@dataclasses.dataclass
class PrefetchProgress:
    """How far a dataset's prefetch has got."""

    total_items: int
    total_bytes: int
    done_items: int = 0
    done_bytes: int = 0
    failed: int = 0
    finished: bool = False


@dataclasses.dataclass(eq=False)
class MountedDataset:
    """Everything mountd holds for one ROOT/NAME."""

    reg: Registration
    digest: Digest
    tree: DatasetTree
    backend: Backend
    inode_base: int
    cost: DigestCost  # the estimated bytes of its digest, tree and pools (shared copies)
    counters: Counter[ReadCounter] = dataclasses.field(default_factory=Counter)
    prefetch: PrefetchProgress | None = None
    cache_mode: CacheMode = CacheMode.COOP  # the coordinator's allocation
    pools: ViewPools | None = None  # a substitutable view's pools; None: an exact view
    fetch_depth: int = 1  # fetches from its storage in flight at once (ItemReader.fetch_depth)
    fetch_slots: trio.Semaphore = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.fetch_slots = trio.Semaphore(self.fetch_depth)

    @property
    def name(self) -> str:
        return self.reg.name

    @property
    def mean_item_bytes(self) -> int:
        return self.digest.total_bytes // max(1, len(self.digest))

    def entry_inode(self, index: int) -> int:
        """The inode of digest entry ``index``'s file."""
        return self.inode_base + self.tree.n_dirs + index

    def owns_inode(self, inode: int) -> bool:
        return self.inode_base <= inode < self.inode_base + self.tree.n_nodes

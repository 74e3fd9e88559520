"""Which datasets are mounted, and which inode belongs to which dataset node."""
from __future__ import annotations

import bisect
from typing import Protocol

import pyfuse3

from mountd.datasets.dataset import MountedDataset

FIRST_DATASET_INODE = 1000  # inodes below are the root and mountd's own files


class TableWatcher(Protocol):
    """Who keeps a copy of the mounted datasets' trees (mountd's native data plane)."""

    def mounted(self, ds: MountedDataset) -> None: ...

    def unmounted(self, ds: MountedDataset) -> None: ...

    async def settle(self, ds: MountedDataset) -> None:
        """Return once ``ds``, just mounted, is taken in."""


class MountTable:
    """Datasets by name and by inode range; ranges are never reused while running."""

    def __init__(self) -> None:
        self.watchers: list[TableWatcher] = []
        self.by_name: dict[str, MountedDataset] = {}
        self._bases: list[int] = []
        self._by_base: list[MountedDataset] = []
        self._next_base = FIRST_DATASET_INODE

    def allocate_base(self, n_nodes: int) -> int:
        base = self._next_base
        self._next_base += n_nodes
        return base

    def add(self, ds: MountedDataset) -> None:
        self.by_name[ds.name] = ds
        pos = bisect.bisect(self._bases, ds.inode_base)
        self._bases.insert(pos, ds.inode_base)
        self._by_base.insert(pos, ds)
        for watcher in self.watchers:
            watcher.mounted(ds)

    async def settle(self, ds: MountedDataset) -> None:
        """Return once every watcher has taken ``ds`` in (a mount's reply waits for it:
        its files are then served as fast as they will be)."""
        for watcher in self.watchers:
            await watcher.settle(ds)

    def remove(self, name: str) -> MountedDataset:
        ds = self.by_name.pop(name)
        pos = self._bases.index(ds.inode_base)
        del self._bases[pos]
        del self._by_base[pos]
        for watcher in self.watchers:
            watcher.unmounted(ds)
        return ds

    def resolve(self, inode: int) -> tuple[MountedDataset, int] | None:
        """(dataset, local node) for a dataset inode, or None."""
        pos = bisect.bisect(self._bases, inode) - 1
        if pos < 0:
            return None
        ds = self._by_base[pos]
        if not ds.owns_inode(inode):
            return None
        return ds, inode - ds.inode_base

    def visible_to(self, uid: int) -> list[MountedDataset]:
        """Datasets a user may see in the root listing: their own (root sees all)."""
        return sorted((ds for ds in self.by_name.values() if uid == 0 or ds.reg.uid == uid),
                      key=lambda ds: ds.name)

    def inodes_naming(self, digest: bytes) -> list[int]:
        """The inodes of the mounted datasets' files whose content is ``digest`` (a
        view's files name no one item: none of them). Safe in a worker thread: the
        datasets are listed in one step (atomic under the GIL) and a dataset's digest
        never changes. A scan of every entry: for a rare event (a corrupt entry)."""
        inodes = []
        for ds in list(self.by_name.values()):
            if ds.pools is None:
                d = ds.digest
                inodes.extend(ds.entry_inode(i) for i in range(len(d)) if d.hash(i) == digest)
        return inodes

    @staticmethod
    def is_root(inode: int) -> bool:
        return inode == pyfuse3.ROOT_INODE

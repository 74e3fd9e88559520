"""The jobs of one dataset on this node, its chunk plan, and its chunk cycle as the
coordinator last described it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import trio

from mountd.dataset import MountedDataset
from quiverfs import ownership
from quiverfs.chunk_cycle import EpochRef
from quiverfs.chunk_plan import default_chunk_bytes, make_plan
from quiverfs.heartbeat import CacheMode, CycleView, DatasetReport, LoadedShare

if TYPE_CHECKING:
    from mountd.job_registry import Job


class DatasetJobs:
    """The jobs of one dataset on this node, its chunk plan, and the cycle as last heard."""

    def __init__(self, ds: MountedDataset, chunk_bytes: float | None,
                 max_chunk_bytes: float | None) -> None:
        self.ds = ds
        if chunk_bytes is None and max_chunk_bytes is not None:
            chunk_bytes = min(default_chunk_bytes(ds.digest.total_bytes), max_chunk_bytes)
        self.plan = make_plan(ds.digest, chunk_bytes)
        self.jobs: dict[str, Job] = {}
        self.view: CycleView | None = None  # the cycle, as the coordinator last said
        self.loaded: list[LoadedShare] = []  # shares this node finished loading
        self.busy: set[str] = set()  # load tasks running, by key
        self.version = -1  # membership version of the last refill
        self.changed = trio.Event()  # set (and replaced) when the cycle moves
        # ((loading chunk, loaders), mask over items of this node's share, its fraction)
        self._share: tuple[tuple[Any, ...], np.ndarray, float] | None = None

    def cycle_key(self) -> tuple[Any, ...] | None:
        return None if self.view is None else self.view.key()

    def usable(self, ref: EpochRef) -> list[int]:
        if self.view is None:
            return []
        if self.mode is not CacheMode.COOP:  # whatever is cached may be used
            return list(range(self.plan.n_chunks))
        return self.view.usable(ref)

    def oldest_usable(self, ref: EpochRef) -> int | None:
        """The oldest resident chunk the job-epoch has items left in (marked, else
        active), whose hits it should take first, in coop mode."""
        if self.view is None or self.mode is not CacheMode.COOP:
            return None
        usable = self.usable(ref)
        for chunk in (self.view.marked, self.view.active):
            if chunk is not None and chunk in usable and ref.remaining_chunks[chunk] > 0:
                return int(chunk)
        return None

    def loader_share(self, me: str) -> tuple[np.ndarray, float] | None:
        """The items of the loading chunk that this node loads (a mask over all items,
        by rendezvous among the loaders) and their share of the chunk; None when no chunk
        loads or this node loads all of it. Another node's share is left to it: a job
        here fetching it too would read it from the bucket twice."""
        view = self.view
        if view is None or view.loading is None or view.loaders == (me,):
            return None
        key = (view.loading, view.loaders)
        if self._share is None or self._share[0] != key:
            members = self.plan.members[view.loading]
            digest = self.ds.digest
            mine = np.array([ownership.owner(digest.hash(int(i)), list(view.loaders)) == me
                             for i in members], dtype=bool)
            mask = np.zeros(len(self.plan.chunk_of), dtype=bool)
            mask[members[mine]] = True
            self._share = (key, mask, float(mine.mean()) if len(mine) else 1.0)
        return self._share[1], self._share[2]

    def upcoming(self) -> int | None:
        """The chunk that starts loading once the marked one is evicted, if none loads."""
        view = self.view
        if view is None or view.loading is not None or self.mode is not CacheMode.COOP:
            return None
        return view.next

    @property
    def mode(self) -> CacheMode:
        """The coordinator's allocation for the dataset."""
        return self.view.mode if self.view is not None else CacheMode.COOP

    def report(self) -> DatasetReport:
        return DatasetReport(
            name=self.ds.name, chunks=self.plan.n_chunks, size=self.ds.digest.total_bytes,
            chunk_bytes=int(max(self.plan.chunk_bytes)), loaded=tuple(self.loaded),
            jobs=tuple(j.report() for j in self.jobs.values()
                       if j.ref is not None and j.config is not None))

"""The jobs of one dataset on this node, its chunk plan, and its chunk cycle as the
coordinator last described it."""
from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import trio

from mountd.datasets.dataset import MountedDataset
from mountd.jobs.cached_items import CachedItems
from quiverfs import ownership
from quiverfs.chunk_cycle import ChunkState, EpochRef
from quiverfs.chunk_plan import default_chunk_bytes, make_plan
from quiverfs.heartbeat import CacheMode, CycleView, DatasetReport, JobReport, LoadedShare

PROBE_AHEAD = 2  # chunks that load next where a probe takes its misses



class DatasetJob(Protocol):
    """What a dataset's jobs share, whether a sampler's (mountd.jobs.registry.Job) or a
    view's (mountd.view.view_jobs.ViewJob): callers that need more narrow with ``isinstance``."""

    id: str

    def kept_for(self, items: np.ndarray) -> np.ndarray: ...

    def report(self) -> JobReport | None: ...


class DatasetJobs:
    """The jobs of one dataset on this node, its chunk plan, and the cycle as last heard."""

    def __init__(self, ds: MountedDataset, chunk_bytes: float | None,
                 max_chunk_bytes: float | None) -> None:
        self.ds = ds
        if chunk_bytes is None and max_chunk_bytes is not None:
            chunk_bytes = min(default_chunk_bytes(ds.digest.total_bytes), max_chunk_bytes)
        self.plan = make_plan(ds.digest, chunk_bytes)
        self.jobs: dict[str, DatasetJob] = {}  # sampler jobs and view jobs, by id
        self.view: CycleView | None = None  # the cycle, as the coordinator last said
        self.loaded: list[LoadedShare] = []  # shares this node finished loading
        self.busy: set[str] = set()  # load tasks running, by key
        self.version = -1  # membership version of the last refill
        self.changed = trio.Event()  # set (and replaced) by ``poke``
        self.sizes = np.asarray(ds.digest.sizes, dtype=np.int64)
        self.cached = CachedItems(self.sizes)
        # (the loads it was computed for, others_loading's mask)
        self._others: tuple[tuple[LoadedShare, ...], np.ndarray] | None = None

    def poke(self) -> None:
        """What jobs here wait on changed (the cycle moved, a job came or went, a probe
        ended): wake every waiter to look again."""
        self.changed.set()
        self.changed = trio.Event()

    def add(self, job: DatasetJob) -> None:
        self.jobs[job.id] = job
        self.poke()

    def discard(self, job_id: str) -> None:
        if self.jobs.pop(job_id, None) is not None:
            self.poke()

    def cycle_key(self) -> tuple[Any, ...]:
        return () if self.view is None else self.view.key()

    def usable(self, ref: EpochRef) -> list[int]:
        if self.view is None:
            return []
        if self.mode is not CacheMode.COOP:  # whatever is cached may be used
            return list(range(self.plan.n_chunks))
        return self.view.usable(ref)

    def oldest_usable(self, ref: EpochRef) -> int | None:
        """The oldest loaded chunk the job-epoch may use and has items left in, whose
        hits it should take first, in coop mode: finishing chunks oldest first lets them
        be released, evicted and replaced while the newer ones serve."""
        if self.view is None or self.mode is not CacheMode.COOP:
            return None
        usable = set(self.usable(ref))
        for chunk in self.view.resident:
            if (chunk in usable and self.view.states[chunk] is not ChunkState.LOADING
                    and ref.remaining_chunks[chunk] > 0):
                return int(chunk)
        return None

    def take(self, ref: EpochRef, items: list[int]) -> bool:
        """Take items placed for a job-epoch off its per-chunk counts; whether that
        released a marked chunk (then the heartbeat should tell the coordinator)."""
        marked = list(self.view.marked) if self.view is not None else []
        held = ref.remaining_chunks[marked] > 0
        np.subtract.at(ref.remaining_chunks, self.plan.chunk_of[items], 1)
        return bool((held & (ref.remaining_chunks[marked] == 0)).any())

    def in_order(self, items: np.ndarray, pass_number: int) -> np.ndarray:
        """``items`` in the order every view job takes a pool's items in, in its pass
        ``pass_number``: the resident chunks' first, then the others' as the cycle's
        ring brings them; within a chunk, shuffled anew for each pass, alike for all
        jobs (without a cycle, all shuffled so)."""
        shuffled = _mixed(items, pass_number)
        view = self.view
        if view is None or self.mode is not CacheMode.COOP:
            return items[np.argsort(shuffled)]
        n = self.plan.n_chunks
        ahead = (np.arange(n) - view.next) % n + 1
        ahead[list(view.resident)] = 0
        return items[np.lexsort((shuffled, ahead[self.plan.chunk_of[items]]))]

    def allotment(self) -> int:
        """Bytes the coordinator allots the dataset: its K chunks in coop mode."""
        mode = self.mode
        if self.view is None or mode is CacheMode.NONE:
            return 0
        if mode is CacheMode.FULL:
            return self.ds.digest.total_bytes
        return self.view.capacity * int(max(self.plan.chunk_bytes))

    def kept_at_eviction(self, items: np.ndarray) -> np.ndarray:
        """Which of an evicted chunk's ``items`` a job here wants kept: those a view job
        is yet to be served."""
        kept = np.zeros(len(items), dtype=bool)
        for job in self.jobs.values():
            kept |= job.kept_for(items)
        return kept

    def others_loading_known(self, me: str) -> bool:
        """Whether ``others_loading`` answers at once (nothing to build: no chunk loads
        elsewhere, or its mask is that of the loads now); an event loop may call it."""
        view = self.view
        return (view is None or _loaded_here_alone(view, me)
                or self._others is not None and self._others[0] == view.loads)

    def others_loading(self, me: str) -> np.ndarray | None:
        """A mask over all items: those of the loading chunks that other nodes load (by
        rendezvous among each chunk's loaders); None when every loading chunk is loaded
        here alone, or none loads. A job here fetching those too would read them from
        the bucket twice."""
        view = self.view
        if view is None or _loaded_here_alone(view, me):
            return None
        if self._others is None or self._others[0] != view.loads:
            digest = self.ds.digest
            mask = np.zeros(len(self.plan.chunk_of), dtype=bool)
            for load in view.loads:
                members = self.plan.members[load.chunk]
                mask[members] = [ownership.owner(digest.hash(int(i)), list(load.loaders)) != me
                                 for i in members]
            self._others = (view.loads, mask)
        return self._others[1]

    def upcoming(self) -> int | None:
        """The chunk that loads next, once there is room for it."""
        view = self.view
        if (view is None or self.mode is not CacheMode.COOP
                or view.states[view.next] is not ChunkState.EVICTED):
            return None
        return view.next

    def probe_ahead(self) -> list[int]:
        """Where a probe takes its misses (items the cycle reads anyway): the chunks
        that load next, in ring order, two of them, so that chunks smaller than a batch
        still give a probe batch its misses."""
        view = self.view
        if view is None or self.mode is not CacheMode.COOP:
            return []
        ring = ((view.next + k) % view.chunks for k in range(view.chunks))
        return [c for c in ring if view.states[c] is ChunkState.EVICTED][:PROBE_AHEAD]

    def alone(self, me: str) -> DatasetJob | None:
        """The dataset's one job in the cluster, where that is a job here (node ``me``)."""
        view = self.view
        if view is None or view.users != (me,) or len(self.jobs) != 1:
            return None
        return next(iter(self.jobs.values()))

    @property
    def mode(self) -> CacheMode:
        """The coordinator's allocation for the dataset."""
        return self.view.mode if self.view is not None else CacheMode.COOP

    def report(self) -> DatasetReport:
        return DatasetReport(
            name=self.ds.name, chunks=self.plan.n_chunks, size=self.ds.digest.total_bytes,
            chunk_bytes=int(max(self.plan.chunk_bytes)), loaded=tuple(self.loaded),
            jobs=tuple(r for r in (j.report() for j in self.jobs.values()) if r is not None))


def _mixed(items: np.ndarray, salt: int) -> np.ndarray:
    """A pseudo-random uint64 per item for ``salt`` (splitmix64's finaliser)."""
    z = items.astype(np.uint64) + np.uint64((salt + 1) * 0x9E3779B97F4A7C15 % 2**64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _loaded_here_alone(view: CycleView, me: str) -> bool:
    """Whether every chunk loading is loaded by node ``me`` alone (or none loads)."""
    return all(load.loaders == (me,) for load in view.loads)

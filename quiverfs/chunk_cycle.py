"""Coordinated chunks of one dataset (paper §5.1): a K-deep pipeline with two-step
eviction.

A dataset keeps up to ``capacity`` chunks resident (K, as many as its allotment holds)
and loads the next ones in ring order, up to ``MAX_LOADING`` at once, whenever there is
room. Once the cycle is full and at least two chunks are loaded, the oldest loaded chunk
is marked for eviction: from then on it is usable only by job-epochs that started
before the mark. A marked chunk is evicted once no such job-epoch has items left in it,
or by force ``force_after`` seconds after the first of them finished it; that frees
room for the next load. Double buffering is the case K = 2.

Where a job's batch spans more than a chunk (small caches, large batches), as many
chunks are marked at once as a batch spans, up to as many as may load at once (while one
loaded chunk stays unmarked): one round of releases then makes room for a batch of every
job. With one marked at a time, a chunk left each time every job had planned a batch
after its mark, and the jobs read the rest of their batches as misses (make demo's
sweep: 5 items a chunk, 8 a batch, hits 5/8, a release round of 80 ms setting the
epoch's pace). Where chunks are larger than batches, one at a time keeps the most
chunks usable to job-epochs that begin after a mark.

The cycle follows what the job-epochs still need: it loads next the first chunk in
ring order that one of them has items left in, and it stops (marks nothing) while none
of them needs a chunk that is not resident: a chunk loaded then would be evicted
unread. It goes on when an epoch starts, with the resident chunks in place.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import numpy as np

FORCE_EVICT_AFTER = 120.0  # seconds a marked chunk may outlive its first release
MAX_LOADING = 2  # chunks of one dataset loading at once
MIN_RESIDENT = 2  # chunks a cooperative dataset holds at least (double buffering)


class ChunkState(str, enum.Enum):
    EVICTED = "evicted"
    LOADING = "loading"
    ACTIVE = "active"
    MARKED = "marked"


@dataclasses.dataclass
class EpochRef:
    """What the cycle needs to know of a job-epoch: when it began, what it has left."""

    started_generation: int
    remaining_chunks: np.ndarray  # per chunk: items of the rank's epoch not yet placed


class ChunkCycle:
    """The residency state machine of one dataset's chunks."""

    def __init__(self, n_chunks: int, force_after: float = FORCE_EVICT_AFTER,
                 capacity: int = MIN_RESIDENT, max_loading: int = MAX_LOADING) -> None:
        self.n_chunks = n_chunks
        self.force_after = force_after
        self.capacity = capacity  # K: chunks that may be resident at once
        self.max_loading = max_loading
        self.states = [ChunkState.EVICTED] * n_chunks
        self.resident: list[int] = []  # resident chunks, oldest load first
        # the marked chunks, in the order marked: the generation each was marked in
        self.marks: dict[int, int] = {}
        self.generation = 0  # bumped at every mark
        self._first_release: dict[int, float] = {}  # by marked chunk, once released
        self.next = 0  # the chunk that loads next
        self.timeline: list[tuple[float, int, str]] = []
        self.max_resident = 0

    @property
    def loading(self) -> list[int]:
        return [c for c in self.resident if self.states[c] is ChunkState.LOADING]

    @property
    def marked(self) -> list[int]:
        """The marked chunks, in the order marked."""
        return list(self.marks)

    @property
    def active(self) -> list[int]:
        """Loaded chunks that are not marked, oldest first."""
        return [c for c in self.resident if self.states[c] is ChunkState.ACTIVE]

    def _set(self, chunk: int, state: ChunkState) -> None:
        self.states[chunk] = state
        self.timeline.append((time.time(), chunk, state.value))
        self.max_resident = max(self.max_resident, len(self.resident))

    def resident_count(self) -> int:
        return len(self.resident)

    def _needed(self, refs: list[EpochRef]) -> list[int]:
        """The chunks not resident that some job-epoch has items left in, in ring order
        from the next one."""
        import numpy as np  # here: the command line imports this module, and numpy is slow

        if not refs:
            return []
        left = np.sum([r.remaining_chunks for r in refs], axis=0)
        ring = [(self.next + k) % self.n_chunks for k in range(self.n_chunks)]
        return [c for c in ring if left[c] and self.states[c] is ChunkState.EVICTED]

    def start_loading(self, refs: list[EpochRef]) -> list[int]:
        """Begin loading the next chunks while there is room; the chunks started. Chunks
        no job-epoch of ``refs`` needs are passed over while others are needed (with no
        job-epoch, or none needing any, the ring order)."""
        started = []
        while (len(self.resident) < min(self.capacity, self.n_chunks)
               and len(self.loading) < self.max_loading
               and self.states[self.next] is ChunkState.EVICTED):
            if refs:
                needed = self._needed(refs)
                if needed:
                    self.next = needed[0]
            chunk = self.next
            self.next = (self.next + 1) % self.n_chunks
            self.resident.append(chunk)
            self._set(chunk, ChunkState.LOADING)
            started.append(chunk)
        return started

    def loaded(self, chunk: int) -> None:
        """A loading chunk is in: it becomes active."""
        if self.states[chunk] is ChunkState.LOADING:
            self._set(chunk, ChunkState.ACTIVE)

    def mark(self, refs: list[EpochRef], at_once: int = 1) -> int | None:
        """Mark the oldest loaded chunk for eviction when the cycle is full (or over its
        capacity) and fewer than ``at_once`` are marked (``max_loading`` at most); the
        chunk marked, if any. The cycle keeps one loaded chunk unmarked, and never marks
        when the whole dataset fits, nor while the job-epochs of ``refs`` (if any) need
        no chunk that is not resident."""
        active = self.active
        full = len(self.resident) >= min(self.capacity, self.n_chunks)
        if (len(self.marks) >= min(at_once, self.max_loading) or len(active) < 2 or not full
                or self.n_chunks <= self.capacity):
            return None
        if refs and not self._needed(refs):
            return None
        chunk = active[0]
        self.generation += 1
        self.marks[chunk] = self.generation
        self._set(chunk, ChunkState.MARKED)
        return chunk

    def evictable(self, refs: list[EpochRef], now: float | None = None) -> int | None:
        """The first marked chunk released by every job-epoch that may use it, or
        ``force_after`` seconds after the first one released it."""
        now = time.time() if now is None else now
        for chunk, generation in self.marks.items():
            holders = [r for r in refs if r.started_generation < generation
                       and r.remaining_chunks[chunk] > 0]
            released_some = len(holders) < len(refs) or not refs
            if released_some:
                self._first_release.setdefault(chunk, now)
            if not holders:
                return chunk
            first = self._first_release.get(chunk)
            if first is not None and now - first >= self.force_after:
                return chunk
        return None

    def evict_all(self) -> list[int]:
        """Drop every resident chunk (the dataset lost its cache allocation)."""
        chunks = list(self.resident)
        self.resident = []
        self.marks.clear()
        self._first_release.clear()
        for c in chunks:
            self._set(c, ChunkState.EVICTED)
        return chunks

    def evicted(self, chunk: int) -> None:
        self.marks.pop(chunk, None)
        self._first_release.pop(chunk, None)
        if chunk in self.resident:
            self.resident.remove(chunk)
        self._set(chunk, ChunkState.EVICTED)

    def snapshot(self) -> dict[str, Any]:
        """The whole state, as the coordinator persists it (``restore`` takes it back)."""
        return {"chunks": self.n_chunks, "capacity": self.capacity,
                "resident": list(self.resident), "marked": self.marked,
                "generation": self.generation,
                "marked_generations": list(self.marks.values()),
                "first_release": [self._first_release.get(c) for c in self.marks],
                "next": self.next,
                "max_resident": self.max_resident,
                "states": [s.value for s in self.states]}

    @classmethod
    def restore(cls, snap: dict[str, Any], force_after: float) -> ChunkCycle:
        cycle = cls(int(snap["chunks"]), force_after, int(snap.get("capacity", MIN_RESIDENT)))
        cycle.states = [ChunkState(s) for s in snap["states"]]
        if "resident" in snap:
            cycle.resident = [int(c) for c in snap["resident"]]
        else:  # written by a two-chunk cycle
            cycle.resident = [int(snap[k]) for k in ("marked", "active", "loading")
                              if snap[k] is not None]
        if (len(cycle.states) != cycle.n_chunks
                or sorted(cycle.resident) != [c for c, s in enumerate(cycle.states)
                                              if s is not ChunkState.EVICTED]):
            raise ValueError("resident chunks do not match the chunk states")
        marked, generations, released = (snap["marked"], snap.get("marked_generations"),
                                         snap["first_release"])
        if not isinstance(marked, list):  # written by a cycle with one marked chunk
            marked = [] if marked is None else [marked]
            generations, released = [snap["marked_generation"]] * len(marked), [released]
        if not len(marked) == len(generations) == len(released):
            raise ValueError("the marked chunks do not match their generations")
        cycle.marks = {int(c): int(g) for c, g in zip(marked, generations)}
        cycle._first_release = {int(c): float(t) for c, t in zip(marked, released)
                                if t is not None}
        if sorted(cycle.marks) != [c for c, s in enumerate(cycle.states)
                                   if s is ChunkState.MARKED]:
            raise ValueError("the marked chunks do not match the chunk states")
        cycle.generation = int(snap["generation"])
        cycle.next = int(snap["next"])
        cycle.max_resident = int(snap["max_resident"])
        return cycle

"""Coordinated chunks of one dataset (paper §5.1): double buffering, two-step eviction.

At most two chunks are resident. While jobs consume the active chunk the next one
loads; when it is loaded the active chunk is marked for eviction and becomes usable
only by job-epochs that started before the mark. A marked chunk is evicted once no
such job-epoch has items left in it, or by force ``force_after`` seconds after the
first of them finished it. Then the next chunk starts loading.
"""
from __future__ import annotations

import dataclasses
import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np

FORCE_EVICT_AFTER = 120.0  # seconds a marked chunk may outlive its first release


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

    def __init__(self, n_chunks: int, force_after: float = FORCE_EVICT_AFTER) -> None:
        self.n_chunks = n_chunks
        self.force_after = force_after
        self.states = [ChunkState.EVICTED] * n_chunks
        self.loading: int | None = None
        self.active: int | None = None
        self.marked: int | None = None
        self.generation = 0  # bumped at every mark
        self.marked_generation = 0  # the generation the marked chunk was marked in
        self._first_release: float | None = None
        self.next = 0  # the chunk that loads next
        self.timeline: list[tuple[float, int, str]] = []
        self.max_resident = 0

    def _set(self, chunk: int, state: ChunkState) -> None:
        self.states[chunk] = state
        self.timeline.append((time.time(), chunk, state.value))
        self.max_resident = max(self.max_resident, self.resident_count())

    def resident_count(self) -> int:
        return sum(s is not ChunkState.EVICTED for s in self.states)

    def start_loading(self) -> int | None:
        """Begin loading the next chunk if fewer than two are resident."""
        if self.loading is not None or self.resident_count() >= 2:
            return None
        if self.n_chunks == 1 and self.active is not None:
            return None
        chunk = self.next
        self.next = (self.next + 1) % self.n_chunks
        self.loading = chunk
        self._set(chunk, ChunkState.LOADING)
        return chunk

    def loaded(self) -> int | None:
        """The loading chunk is in: it becomes active; the old active one is marked.
        Returns the chunk that was marked, if any."""
        if self.loading is None:
            return None
        old = self.active
        self.active, self.loading = self.loading, None
        self._set(self.active, ChunkState.ACTIVE)
        if old is None:
            return None
        self.marked = old
        self.generation += 1
        self.marked_generation = self.generation
        self._first_release = None
        self._set(old, ChunkState.MARKED)
        return old

    def evictable(self, refs: list[EpochRef], now: float | None = None) -> int | None:
        """The marked chunk, once released by every job-epoch that may use it, or once
        ``force_after`` seconds passed since the first one released it."""
        if self.marked is None:
            return None
        now = time.time() if now is None else now
        holders = [r for r in refs if r.started_generation < self.marked_generation
                   and r.remaining_chunks[self.marked] > 0]
        released_some = len(holders) < len(refs) or not refs
        if released_some and self._first_release is None:
            self._first_release = now
        if not holders:
            return self.marked
        if self._first_release is not None and now - self._first_release >= self.force_after:
            return self.marked
        return None

    def evict_all(self) -> list[int]:
        """Drop every resident chunk (the dataset lost its cache allocation)."""
        chunks = [c for c, s in enumerate(self.states) if s is not ChunkState.EVICTED]
        self.loading = self.active = self.marked = None
        for c in chunks:
            self._set(c, ChunkState.EVICTED)
        return chunks

    def evicted(self, chunk: int) -> None:
        if chunk == self.marked:
            self.marked = None
        self._set(chunk, ChunkState.EVICTED)

    def snapshot(self) -> dict:
        """The whole state, as the coordinator persists it (``restore`` takes it back)."""
        return {"chunks": self.n_chunks, "loading": self.loading,
                "active": self.active, "marked": self.marked,
                "generation": self.generation, "marked_generation": self.marked_generation,
                "first_release": self._first_release, "next": self.next,
                "max_resident": self.max_resident,
                "states": [s.value for s in self.states]}

    @classmethod
    def restore(cls, snap: dict, force_after: float) -> ChunkCycle:
        cycle = cls(int(snap["chunks"]), force_after)
        cycle.states = [ChunkState(s) for s in snap["states"]]
        cycle.loading, cycle.active, cycle.marked = snap["loading"], snap["active"], snap["marked"]
        cycle.generation = int(snap["generation"])
        cycle.marked_generation = int(snap["marked_generation"])
        cycle._first_release = snap["first_release"]
        cycle.next = int(snap["next"])
        cycle.max_resident = int(snap["max_resident"])
        return cycle


"""The node-coordinator protocol: what a node reports in each heartbeat, and what the
coordinator answers, as typed records both sides import from here.

A node sends a ``Heartbeat`` every fraction of a second (over RPC, or as a function
call to the coordinator embedded in a lone mountd); the answer is a ``HeartbeatReply``:
the live members and, for each dataset the node reported, a ``CycleView`` of its chunk
cycle. On the wire each record is msgpack of its plain form (``to_wire``); the
receiver rebuilds it with every field's type checked (``from_wire``), so a malformed
message is refused as a whole, never half-read.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any, TypeVar

import msgspec

from quiverfs.chunk_cycle import ChunkState, EpochRef

T = TypeVar("T")

PROBE_BATCHES = 100  # mini-batches a probe of a job runs without cache hits, by default


class CacheMode(enum.StrEnum):
    """The coordinator's cache allocation for a dataset."""

    COOP = "coop"  # chunks cycle through the cache; jobs take whatever is resident
    FULL = "full"  # the whole dataset may stay cached
    NONE = "none"  # nothing is cached: reads go to storage


@dataclasses.dataclass(frozen=True)
class JobReport:
    """One job on a node: where its epoch stands, and what probing measured of it."""

    id: str
    gen: int  # the cycle's generation when the job's epoch began
    gpus: int
    remaining: tuple[int, ...]  # per chunk: items of its epoch not yet placed
    probe_seq: int  # the last probe the node began for it
    t_miss: float | None = None  # seconds per batch without cache hits, as last probed
    t_hit: float | None = None  # seconds per batch with them
    probing: bool = False
    probeable: bool = True  # False: the coordinator never asks to probe it (a view's job)

    @property
    def benefit(self) -> float | None:
        """b = t_miss / t_hit, once both are measured."""
        return self.t_miss / self.t_hit if self.t_miss and self.t_hit else None

    def epoch_ref(self) -> EpochRef:
        import numpy as np  # here: the command line imports this module, and numpy is slow

        return EpochRef(self.gen, np.asarray(self.remaining, dtype=np.int64))


@dataclasses.dataclass(frozen=True)
class LoadedShare:
    """A node finished its share of loading ``chunk`` among ``loaders``."""

    chunk: int
    loaders: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class DatasetReport:
    """A dataset with jobs on the reporting node, by digest identity in a Heartbeat."""

    name: str
    chunks: int
    size: int  # bytes
    chunk_bytes: int  # the largest chunk's bytes
    loaded: tuple[LoadedShare, ...] = ()
    jobs: tuple[JobReport, ...] = ()


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """What a node sends: who it is, and its datasets with jobs."""

    node: str
    peer: str  # HOST:PORT of its peer server ("local" for a lone node)
    capacity: int  # bytes of cache
    datasets: dict[str, DatasetReport] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Member:
    """A live member of the cluster."""

    id: str
    peer: str
    capacity: int


@dataclasses.dataclass(frozen=True)
class CycleView:
    """One dataset's chunk cycle as a node acts on it (computed by the coordinator at
    each heartbeat; the node keeps the last one until the next)."""

    chunks: int
    states: tuple[ChunkState, ...]
    resident: tuple[int, ...]  # resident chunks, oldest load first
    marked: int | None
    generation: int  # bumped at every mark
    marked_generation: int  # the generation the marked chunk was marked in
    next: int  # the chunk that loads next
    capacity: int  # K: chunks the dataset's allotment holds
    max_resident: int
    loads: tuple[LoadedShare, ...]  # the loading chunks, each with the nodes loading it
    users: tuple[str, ...]  # the nodes with jobs on the dataset
    mode: CacheMode
    probe_batches: int  # how long a probe of one of the node's jobs runs
    probes: dict[str, int]  # job -> the probe it should be in

    @property
    def loading(self) -> tuple[int, ...]:
        return tuple(load.chunk for load in self.loads)

    @property
    def active(self) -> tuple[int, ...]:
        """Loaded, unmarked chunks, oldest first."""
        return tuple(c for c in self.resident if self.states[c] is ChunkState.ACTIVE)

    def usable(self, ref: EpochRef) -> list[int]:
        """Chunks a job-epoch may take hits from, oldest first: the loaded and loading
        ones, and the marked one while the epoch began before the mark."""
        return [c for c in self.resident if c != self.marked
                or ref.started_generation < self.marked_generation]

    def key(self) -> tuple[Any, ...]:
        """What a change of the cycle that jobs wait on is judged by."""
        return self.resident, self.loading, self.marked, self.generation, self.mode


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
    """The coordinator's answer: membership, and the cycles of the node's datasets."""

    version: int  # of the membership
    nodes: tuple[Member, ...]
    cycles: dict[str, CycleView] = dataclasses.field(default_factory=dict)


def to_wire(record: Any) -> Any:
    """A record as plain maps, lists, strings and numbers (for msgpack or JSON)."""
    return msgspec.to_builtins(record)


def from_wire(data: Any, kind: type[T]) -> T:
    """Rebuild a record of type ``kind`` from its plain form, checking every field;
    ValueError names the first bad one."""
    try:
        return msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed {kind.__name__}: {exc}") from None

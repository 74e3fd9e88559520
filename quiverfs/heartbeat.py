"""The node-coordinator protocol: what a node reports in each heartbeat, and what the
coordinator answers, as typed records both sides import from here.

A node sends a ``Heartbeat`` every fraction of a second (over RPC, or as a function
call to the coordinator embedded in a lone mountd); the answer is a ``HeartbeatReply``:
the live members and, for each dataset the node reported, a ``CycleView`` of its chunk
cycle; or, from a standby coordinator (one of several, not the leader), a
``NotLeader`` naming the one that leads. On the wire each record is msgpack of its
plain form (``to_wire``); the receiver rebuilds it with every field's type and range
checked, and the fields that must agree compared (``from_wire``), so a malformed
message is refused as a whole, never half-read. A node checks its reports the same way before sending them
(``refusal``), so one dataset out of range cannot get its whole heartbeat refused.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from typing import Annotated, Any, TypeVar

import msgspec

from quiverfs.chunk_cycle import ChunkState, EpochRef

T = TypeVar("T")

PROBE_BATCHES = 100  # mini-batches a probe of a job runs without cache hits, by default

# The ranges a heartbeat's fields must be in. They bound what one message can make the
# coordinator keep (a cycle holds a state per chunk) and keep numbers finite.
MAX_INT = (1 << 63) - 1  # counts, bytes, generations
MAX_CHUNKS = 1 << 20  # chunks of one dataset
MAX_ENTRIES = 1 << 16  # datasets in a heartbeat, jobs of a dataset, nodes in a list
MAX_BATCH_SECONDS = 1e6  # a measured time per mini-batch
MAX_NAME = 255  # characters of a dataset name (a file name)
MAX_TEXT = 1024  # characters of a job id or a dataset identity
MAX_PEER = 300  # characters of a peer address, HOST:PORT
# A node id is a host name's characters, matched in full; no "/", which separates the
# node from the job in the coordinator's probe keys.
NODE_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,252}")

Count = Annotated[int, msgspec.Meta(ge=0, le=MAX_INT)]
NodeId = Annotated[str, msgspec.Meta(pattern=rf"^{NODE_ID.pattern}\Z")]
Text = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT)]
Seconds = Annotated[float, msgspec.Meta(ge=0.0, le=MAX_BATCH_SECONDS)]  # no NaN, no inf
MAX_BANDWIDTH = 1e15  # bytes per second a node may say its bucket fetches get


class CacheMode(enum.StrEnum):
    """The coordinator's cache allocation for a dataset."""

    COOP = "coop"  # chunks cycle through the cache; jobs take whatever is resident
    FULL = "full"  # the whole dataset may stay cached
    NONE = "none"  # nothing is cached: reads go to storage


@dataclasses.dataclass(frozen=True)
class JobReport:
    """One job on a node: where its epoch stands, and what probing measured of it."""

    id: Text
    gen: Count  # the cycle's generation when the job's epoch began
    gpus: Annotated[int, msgspec.Meta(ge=1, le=MAX_INT)]
    # per chunk: items of its epoch not yet placed
    remaining: Annotated[tuple[Count, ...], msgspec.Meta(max_length=MAX_CHUNKS)]
    probe_seq: Count  # the last probe the node began for it
    t_miss: Seconds | None = None  # seconds per batch without cache hits, as last probed
    t_hit: Seconds | None = None  # seconds per batch with them
    probing: bool = False
    probeable: bool = True  # False: the coordinator never asks to probe it (a view's job)
    batch_bytes: Count = 0  # bytes of a batch (its items' mean size); 0: not known

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

    chunk: Annotated[int, msgspec.Meta(ge=0, lt=MAX_CHUNKS)]
    loaders: Annotated[tuple[NodeId, ...], msgspec.Meta(max_length=MAX_ENTRIES)]


@dataclasses.dataclass(frozen=True)
class DatasetReport:
    """A dataset with jobs on the reporting node, by digest identity in a Heartbeat."""

    name: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_NAME)]
    chunks: Annotated[int, msgspec.Meta(ge=1, le=MAX_CHUNKS)]
    size: Count  # bytes
    chunk_bytes: Count  # the largest chunk's bytes
    loaded: Annotated[tuple[LoadedShare, ...], msgspec.Meta(max_length=MAX_CHUNKS)] = ()
    jobs: Annotated[tuple[JobReport, ...], msgspec.Meta(max_length=MAX_ENTRIES)] = ()

    def disagreement(self) -> str | None:
        """Which fields disagree with the chunk count, if any."""
        for job in self.jobs:
            if len(job.remaining) != self.chunks:
                return (f"job {job.id!r} reports {len(job.remaining)} chunks of a "
                        f"dataset of {self.chunks}")
        for share in self.loaded:
            if share.chunk >= self.chunks:
                return f"loaded chunk {share.chunk} of a dataset of {self.chunks} chunks"
        return None


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """What a node sends: who it is, and its datasets with jobs."""

    node: NodeId
    # HOST:PORT of its peer server ("local" for a lone node); the coordinator checks it
    peer: Annotated[str, msgspec.Meta(max_length=MAX_PEER)]
    capacity: Count  # bytes of cache
    datasets: Annotated[dict[Text, DatasetReport], msgspec.Meta(max_length=MAX_ENTRIES)] = (
        dataclasses.field(default_factory=dict))
    # bytes per second the node's bucket fetches get (read_stats.BucketMeter); None: not
    # measured yet
    bucket_bps: Annotated[float, msgspec.Meta(gt=0.0, le=MAX_BANDWIDTH)] | None = None

    def disagreement(self) -> str | None:
        """The first dataset whose fields disagree, and how; None if none does."""
        for identity, report in self.datasets.items():
            why = report.disagreement()
            if why is not None:
                return f"dataset {identity}: {why}"
        return None


@dataclasses.dataclass(frozen=True)
class Member:
    """A live member of the cluster."""

    id: NodeId
    peer: Annotated[str, msgspec.Meta(max_length=MAX_PEER)]
    capacity: Count


@dataclasses.dataclass(frozen=True)
class CycleView:
    """One dataset's chunk cycle as a node acts on it (computed by the coordinator at
    each heartbeat; the node keeps the last one until the next)."""

    chunks: int
    states: tuple[ChunkState, ...]
    resident: tuple[int, ...]  # resident chunks, oldest load first
    marked: dict[int, int]  # the marked chunks, in the order marked: the generation of each
    generation: int  # bumped at every mark
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
        ones, and each marked one while the epoch began before its mark."""
        marked = self.marked
        return [c for c in self.resident if c not in marked
                or ref.started_generation < marked[c]]

    def key(self) -> tuple[Any, ...]:
        """What a change of the cycle that jobs wait on is judged by."""
        return self.resident, self.loading, tuple(self.marked), self.generation, self.mode


@dataclasses.dataclass(frozen=True)
class HeartbeatReply:
    """The coordinator's answer: membership, and the cycles of the node's datasets."""

    version: int  # of the membership
    nodes: tuple[Member, ...]
    cycles: dict[str, CycleView] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Leader:
    """The coordinator a standby knows to lead: HOST:PORT, or None when it knows none."""

    leader: Annotated[str, msgspec.Meta(min_length=3, max_length=MAX_PEER)] | None


@dataclasses.dataclass(frozen=True)
class NotLeader:
    """A standby coordinator's answer to a heartbeat, instead of a HeartbeatReply; on
    the wire exactly ``{"not_leader": {"leader": "HOST:PORT" | None}}``."""

    not_leader: Leader

    def disagreement(self) -> str | None:
        """Why the leader named is no HOST:PORT a node could dial, if it is not."""
        leader = self.not_leader.leader
        if leader is None:
            return None
        host, sep, port = leader.rpartition(":")
        if not (sep and host and port.isascii() and port.isdigit() and len(port) <= 5
                and 0 < int(port) < 65536 and host.isprintable() and " " not in host):
            return f"leader {leader[:64]!r} is not HOST:PORT"
        return None


def heartbeat_answer(data: Any) -> HeartbeatReply | NotLeader:
    """A coordinator's answer to a heartbeat: the leader's HeartbeatReply, or a
    standby's NotLeader, with nothing else in it; ValueError if it is neither."""
    if isinstance(data, dict) and "not_leader" in data:
        inner = data["not_leader"]
        if len(data) != 1 or not isinstance(inner, dict) or set(inner) != {"leader"}:
            raise ValueError("malformed NotLeader: not {'not_leader': {'leader': ...}}")
        return from_wire(data, NotLeader)
    return from_wire(data, HeartbeatReply)


def to_wire(record: Any) -> Any:
    """A record as plain maps, lists, strings and numbers (for msgpack or JSON)."""
    return msgspec.to_builtins(record)


def from_wire(data: Any, kind: type[T]) -> T:
    """Rebuild a record of type ``kind`` from its plain form, checking every field's
    type and range and that its fields agree; ValueError names the first bad one."""
    try:
        record = msgspec.convert(data, kind)
    except msgspec.ValidationError as exc:
        raise ValueError(f"malformed {kind.__name__}: {exc}") from None
    check = getattr(record, "disagreement", None)
    why = check() if check is not None else None
    if why is not None:
        raise ValueError(f"malformed {kind.__name__}: {why}")
    return record


def refusal(record: Any) -> str | None:
    """Why a receiver would refuse ``record`` (``from_wire`` of it), or None."""
    try:
        from_wire(to_wire(record), type(record))
    except ValueError as exc:
        return str(exc)
    return None

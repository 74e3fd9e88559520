"""The fields of mountd's control replies that ``quiver mount|prefetch|status`` read, as
typed records: a reply missing one, or holding one of the wrong type, is one error line
naming it (``control_client.typed``), never a KeyError or TypeError in the printing.

mountd sends more than these; what the client does not read is not checked.
"""
from __future__ import annotations

import msgspec

from quiverfs.chunk_cycle import ChunkState

Counters = dict[str, int | float]  # name -> count (a few are seconds)


class MountReply(msgspec.Struct):
    """A registered dataset: where it appears and what it holds."""

    path: str
    items: int
    bytes: int
    view: str = "exact"


class PrefetchReply(msgspec.Struct):
    """A prefetch started (or already running)."""

    name: str
    items: int


class CacheStatus(msgspec.Struct):
    """The local store: its use, and why it cannot write when it cannot."""

    used_bytes: int
    size_limit: int
    items: int
    writable: bool = True
    write_error: str | None = None
    write_error_since: float | None = None  # Unix time of the first failed write
    write_failures: int = 0
    scrub_failures: int = 0  # entries the scrubber found changed on disk, and dropped


class CauseStatus(msgspec.Struct):
    """Bucket fetches of one cause and their bytes."""

    fetches: int
    bytes: int


class PrefetchStatus(msgspec.Struct):
    """How far a dataset's prefetch has got."""

    finished: bool
    done_items: int
    total_items: int
    failed: int


class DatasetStatus(msgspec.Struct):
    """One mounted dataset the caller may see."""

    name: str
    items: int
    bytes: int
    source: str
    counters: Counters
    prefetch: PrefetchStatus | None = None


class MemoryStatus(msgspec.Struct):
    """The memory registrations take (mountd.datasets.memory_budget), the caller's and
    everyone's."""

    uid: int
    uid_in_use: int
    per_uid_limit: int | None  # None for root, who has none
    in_use: int
    total_limit: int


class CoordinatorsStatus(msgspec.Struct):
    """The coordinators of --coordinator (mountd.cluster.coordinators)."""

    addresses: list[str]
    in_use: str | None  # whose answers the node follows; None before the first
    switches: int  # heartbeats answered by another one than the one before
    last_switch: float | None  # Unix time of the last switch


class MembershipStatus(msgspec.Struct):
    """``status``'s cluster part: the coordinator as the last heartbeat found it."""

    coordinator_ok: bool
    coordinators: CoordinatorsStatus | None = None  # None: the coordinator is embedded


class StatusReply(msgspec.Struct):
    """``status``: the cache, the read counters and the datasets."""

    root: str
    pid: int
    data_path: str  # how cached dataset files are served: native, passthrough or python
    cache: CacheStatus
    memory: MemoryStatus
    counters: Counters
    bucket_fetch_causes: dict[str, CauseStatus]
    datasets: list[DatasetStatus]
    cluster: MembershipStatus | None = None


class NodeStatus(msgspec.Struct):
    """A member of the cluster as this node sees it."""

    id: str
    peer: str
    live: bool
    share: float  # of this node's datasets' keys, 0 to 1


class CycleStatus(msgspec.Struct):
    """A dataset's chunk cycle."""

    states: list[ChunkState]
    capacity: int
    max_resident: int


class JobStatus(msgspec.Struct):
    """A training job reading through this node."""

    job: str
    epoch: int
    batches_planned: int
    batches_per_epoch: int
    counters: Counters


class ClusterReply(msgspec.Struct):
    """``cluster``: the members, the chunk cycles and the jobs."""

    node: str
    coordinator_ok: bool
    version: int
    nodes: list[NodeStatus]
    cycles: dict[str, CycleStatus]  # by digest identity
    jobs: list[JobStatus]
    coordinators: CoordinatorsStatus | None = None  # None: the coordinator is embedded

"""The records the coordinator's state is made of: a member node, and one dataset's chunk
cycle with what the nodes report on it. ``coordinator.state`` decides with them and
``coordinator.state_store`` saves them."""
from __future__ import annotations

import dataclasses

from quiverfs.chunk_cycle import ChunkCycle
from quiverfs.heartbeat import CacheMode, DatasetReport


@dataclasses.dataclass
class Node:
    """A member: where its peer server listens, how much it caches."""

    id: str
    peer: str
    capacity: int
    last_seen: float = 0.0  # its last heartbeat, on the coordinator's RunClock


@dataclasses.dataclass
class DatasetState:
    """One dataset's cycle, its loaders, and what every node last reported."""

    identity: str
    name: str
    cycle: ChunkCycle
    loaders: dict[int, list[str]] = dataclasses.field(default_factory=dict)  # per loading chunk
    done: dict[int, set[str]] = dataclasses.field(default_factory=dict)  # its loaders done
    reports: dict[str, DatasetReport] = dataclasses.field(default_factory=dict)  # by node
    mode: CacheMode = CacheMode.COOP
    gain: float = 0.0  # G, the GPU shares its jobs save with the cache
    probes: dict[str, int] = dataclasses.field(default_factory=dict)  # job -> probe number
    probed_at: dict[str, float] = dataclasses.field(default_factory=dict)
    last_reported: float = 0.0  # its last report by any node, on the RunClock

    def leave(self, node: str) -> bool:
        """Take ``node`` out: its report, and its shares of loading chunks, which the
        others split anew, as when one dies; True if it had shares."""
        self.reports.pop(node, None)
        shared = False
        for chunk, loaders in self.loaders.items():
            if node in loaders:
                self.loaders[chunk] = [n for n in loaders if n != node]
                self.done[chunk] = set()
                shared = True
        return shared

"""This node's place in the cluster: members, key ownership, and coordinator heartbeats.

Without ``--coordinator`` the coordinator's logic runs embedded, for one node, so the
same chunk cycle drives a single VM. With one (or several, of which the node follows
the leader: ``coordinators``), a coordinator outage does not stop reads: the node
keeps its last view and retries.
"""
from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from mountd.cluster.coordinators import RemoteCoordinators
from quiverfs import ownership
from quiverfs.failure_runs import FailureRuns
from quiverfs.heartbeat import (MAX_BANDWIDTH, CycleView, DatasetReport, Heartbeat,
                                HeartbeatReply, refusal)
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)


class CoordinatorLink(Protocol):
    """How a node reaches its coordinator: over RPC, or embedded in the same process."""

    interval: float  # seconds between heartbeats

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Its own tasks, until cancelled: the RPC clients of remote coordinators, the
        state file's writes of an embedded one."""

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply: ...


# Makes the coordinator a node without --coordinator runs in-process, from its state
# directory, force-evict seconds, probe batches and the blocking-work limiter. Handed in
# by the command line, so that mountd does not import the coordinator.
EmbeddedFactory = Callable[[str, float, int, trio.CapacityLimiter], CoordinatorLink]


class Cluster:
    """Membership as the coordinator last reported it, minus peers seen failing."""

    def __init__(self, node_id: str, peer_address: str, capacity: int,
                 link: CoordinatorLink, peers: Any) -> None:
        self.me = node_id
        self.peer_address = peer_address
        self.capacity = capacity
        self.link = link
        # the coordinators' addresses and the one in use, for status; None when embedded
        self.remote = link if isinstance(link, RemoteCoordinators) else None
        self.peers = peers  # PeerSet, or None for a single node
        self.members: dict[str, str] = {node_id: peer_address}
        self.version = -1
        self.cycles: dict[str, CycleView] = {}
        self.coordinator_ok = False
        self.synced = trio.Event()  # set after the first answer
        self._wake = trio.Event()  # set by poke(): send the next heartbeat now
        self._left_out: set[str] = set()  # datasets not reported, out of the protocol's range

    def live(self) -> list[str]:
        return sorted(n for n in self.members
                      if n == self.me or self.peers is None or not self.peers.is_down(n))

    def owner(self, digest: bytes) -> str:
        live = self.live()
        return live[0] if len(live) == 1 else ownership.owner(digest, live)

    def other_owner(self, digest: bytes) -> str | None:
        """The node that should hold ``digest``; None when that is this node."""
        node = self.owner(digest)
        return None if node == self.me else node

    def poke(self) -> None:
        """Something the coordinator acts on happened (a chunk share loaded, a marked
        chunk released): heartbeat now rather than at the next interval."""
        self._wake.set()

    async def run(self, report: Callable[[], dict[str, DatasetReport]],
                  apply: Callable[[dict[str, CycleView], int], Awaitable[None]],
                  bandwidth: Callable[[], float | None]) -> None:
        """Heartbeat forever: send ``report()`` and the bucket's ``bandwidth()`` as this
        node's fetches get it, hand the answer to ``apply``. A beat that fails on a bug
        below (an exception other than the coordinator being unavailable) is logged and
        the next one tried: it must not end the heartbeat, and with it mountd."""
        beats = FailureRuns(log)  # a beat comes every interval
        while True:
            self._wake = trio.Event()
            try:
                await self._beat(report, apply, bandwidth)
            except Exception:
                beats.failed("a heartbeat failed; the next one is tried as usual")
            else:
                if beats.succeeded():
                    log.info("heartbeats work again")
            with trio.move_on_after(self.link.interval):
                await self._wake.wait()

    async def _beat(self, report: Callable[[], dict[str, DatasetReport]],
                    apply: Callable[[dict[str, CycleView], int], Awaitable[None]],
                    bandwidth: Callable[[], float | None]) -> None:
        beat = Heartbeat(self.me, self.peer_address, self.capacity,
                         self._reportable(report()), _bandwidth(bandwidth()))
        try:
            reply = await self.link.heartbeat(beat)
        except Unavailable as exc:
            if self.coordinator_ok:
                log.warning("coordinator unreachable (%s): reads go on, chunk "
                            "transitions wait", exc)
            self.coordinator_ok = False
            return
        if not self.coordinator_ok and self.version >= 0:
            log.info("coordinator reachable again")
        self.coordinator_ok = True
        self._apply_membership(reply)
        self.cycles = reply.cycles
        await apply(self.cycles, self.version)
        self.synced.set()

    def _reportable(self, reports: dict[str, DatasetReport]) -> dict[str, DatasetReport]:
        """The reports the coordinator takes. One out of the protocol's range (say, a
        crafted digest planned into too many chunks) is left out, and logged once, so
        that it cannot get the node's whole heartbeat refused."""
        self._left_out &= set(reports)
        out = {}
        for identity, report in reports.items():
            why = refusal(report)
            if why is None:
                out[identity] = report
                self._left_out.discard(identity)
            elif identity not in self._left_out:
                self._left_out.add(identity)
                log.warning("dataset %s is not reported to the coordinator, so its chunks "
                            "do not cycle: %s", report.name, why)
        return out

    def _apply_membership(self, reply: HeartbeatReply) -> None:
        members = {n.id: n.peer for n in reply.nodes}
        members[self.me] = self.peer_address
        if reply.version != self.version or members != self.members:
            if self.version >= 0:
                log.info("membership %d: %s", reply.version, ", ".join(sorted(members)))
            self.members = members
            self.version = reply.version
            if self.peers is not None:
                self.peers.update({n: p for n, p in members.items() if n != self.me})

    def status(self) -> dict[str, Any]:
        return {"node": self.me, "peer": self.peer_address, "version": self.version,
                "members": sorted(self.members), "live": self.live(),
                **self.coordinator_status()}

    def coordinator_status(self) -> dict[str, Any]:
        """Whether the last heartbeat was answered and, with --coordinator, the
        coordinators (``RemoteCoordinators.status``)."""
        return {"coordinator_ok": self.coordinator_ok,
                "coordinators": None if self.remote is None else self.remote.status()}


def _bandwidth(rate: float | None) -> float | None:
    """A measured rate as the protocol takes it (positive, in range), else None."""
    return rate if rate is not None and 0 < rate <= MAX_BANDWIDTH else None

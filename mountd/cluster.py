"""This node's place in the cluster: members, key ownership, and coordinator heartbeats.

Without ``--coordinator`` the coordinator's logic runs embedded, for one node, so the
same chunk cycle drives a single VM. With one, a coordinator outage does not stop
reads: the node keeps its last view and retries.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Protocol

import trio

from coordinator.state import CoordinatorState, StateCorrupted
from quiverfs import ownership
from quiverfs.rpc import RpcClient, RpcError, Unavailable

log = logging.getLogger(__name__)

HEARTBEAT = 0.5  # seconds between heartbeats to a remote coordinator
EMBEDDED_HEARTBEAT = 0.2  # the embedded one is a function call


class CoordinatorLink(Protocol):
    async def heartbeat(self, args: dict[str, Any]) -> dict[str, Any]: ...


class EmbeddedCoordinator:
    """The coordinator's state machine inside mountd (single node)."""

    interval = EMBEDDED_HEARTBEAT

    def __init__(self, state_dir: str, force_after: float, probe_batches: int) -> None:
        def load() -> CoordinatorState:
            return CoordinatorState(state_dir, heartbeat_timeout=3600.0,
                                    force_after=force_after, probe_batches=probe_batches)

        try:
            self.state = load()
        except StateCorrupted as exc:
            # Only chunk cycles live there, rebuilt from the next heartbeat: a damaged
            # file must not keep mountd from starting.
            aside = f"{exc.path}.corrupted"
            os.replace(exc.path, aside)
            log.warning("%s: moved it to %s and started the chunk cycles afresh",
                        exc.message, aside)
            self.state = load()

    async def heartbeat(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.state.heartbeat(args["node"], args["peer"], args["capacity"],
                                    args["datasets"])


class RemoteCoordinator:
    """``quiver coordinator`` over RPC."""

    interval = HEARTBEAT

    def __init__(self, client: RpcClient) -> None:
        self.client = client

    async def heartbeat(self, args: dict[str, Any]) -> dict[str, Any]:
        try:
            return await self.client.call("heartbeat", args, timeout=5.0)
        except RpcError as exc:
            raise Unavailable(str(exc)) from None


class Cluster:
    """Membership as the coordinator last reported it, minus peers seen failing."""

    def __init__(self, node_id: str, peer_address: str, capacity: int,
                 link: EmbeddedCoordinator | RemoteCoordinator, peers: Any) -> None:
        self.me = node_id
        self.peer_address = peer_address
        self.capacity = capacity
        self.link = link
        self.peers = peers  # PeerSet, or None for a single node
        self.members: dict[str, str] = {node_id: peer_address}
        self.version = -1
        self.cycles: dict[str, dict[str, Any]] = {}
        self.coordinator_ok = False
        self.synced = trio.Event()  # set after the first answer
        self._wake = trio.Event()  # set by poke(): send the next heartbeat now

    def live(self) -> list[str]:
        return sorted(n for n in self.members
                      if n == self.me or self.peers is None or not self.peers.is_down(n))

    def owner(self, digest: bytes) -> str:
        live = self.live()
        return live[0] if len(live) == 1 else ownership.owner(digest, live)

    def poke(self) -> None:
        """Something the coordinator acts on happened (a chunk share loaded, a marked
        chunk released): heartbeat now rather than at the next interval."""
        self._wake.set()

    async def run(self, report: Any, apply: Any) -> None:
        """Heartbeat forever: send ``report()``, hand the answer to ``apply``."""
        while True:
            self._wake = trio.Event()
            args = {"node": self.me, "peer": self.peer_address, "capacity": self.capacity,
                    "datasets": report()}
            try:
                reply = await self.link.heartbeat(args)
            except Unavailable as exc:
                if self.coordinator_ok:
                    log.warning("coordinator unreachable (%s): reads go on, chunk "
                                "transitions wait", exc)
                self.coordinator_ok = False
            else:
                if not self.coordinator_ok and self.version >= 0:
                    log.info("coordinator reachable again")
                self.coordinator_ok = True
                self._apply_membership(reply)
                self.cycles = reply.get("cycles", {})
                await apply(self.cycles, self.version)
                self.synced.set()
            with trio.move_on_after(self.link.interval):
                await self._wake.wait()

    def _apply_membership(self, reply: dict[str, Any]) -> None:
        members = {n["id"]: n["peer"] for n in reply["nodes"]}
        members[self.me] = self.peer_address
        if reply["version"] != self.version or members != self.members:
            if self.version >= 0:
                log.info("membership %d: %s", reply["version"], ", ".join(sorted(members)))
            self.members = members
            self.version = reply["version"]
            if self.peers is not None:
                self.peers.update({n: p for n, p in members.items() if n != self.me})

    def status(self) -> dict[str, Any]:
        return {"node": self.me, "peer": self.peer_address, "version": self.version,
                "members": sorted(self.members), "live": self.live(),
                "coordinator_ok": self.coordinator_ok}

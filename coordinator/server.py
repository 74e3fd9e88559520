"""``quiver coordinator``: the coordinator state served over authenticated msgpack RPC."""
from __future__ import annotations

import logging
import signal
from typing import Any

import trio

from coordinator.etcd_client import EtcdUnavailable
from coordinator.leadership import Leadership, NotLeader
from coordinator.state import CoordinatorState
from quiverfs import heartbeat, sd_notify
from quiverfs.heartbeat import Heartbeat, from_wire, to_wire
from quiverfs.metrics_server import MetricsServer
from quiverfs.peer_network import Networks, peer_refusal
from quiverfs.rpc import RpcServer

log = logging.getLogger(__name__)

LOGGED_REFUSALS = 1024  # refused (node, peer) pairs logged, once each


class CoordinatorServer:
    """RPC ops: heartbeat (a node joins with its first), status. With ``networks``
    (--peer-network), nodes whose peer address is outside them are refused. With a
    ``leadership`` (--etcd), it answers heartbeats only while it leads."""

    def __init__(self, state: CoordinatorState, secret: bytes, address: tuple[str, int],
                 metrics: MetricsServer | None = None, networks: Networks = ()) -> None:
        self.state = state
        self.metrics = metrics
        self.networks = networks
        self.leadership: Leadership | None = None  # set by the owner before ``serve``
        self.rpc = RpcServer(secret, {"heartbeat": self.heartbeat, "status": self.status})
        self.address = self.rpc.bind(*address, "--listen")  # a taken port fails now
        self._saves = trio.CapacityLimiter(1)  # one state write at a time, in order
        self._refused: set[tuple[str, str]] = set()  # (node, peer) refusals logged
        self.admit()

    def admit(self) -> None:
        """Drop the nodes of a state just loaded that were admitted before the peer
        networks changed."""
        for node in list(self.state.nodes.values()):
            why = peer_refusal(node.peer, self.networks)
            if why is not None:
                self.state.drop(node.id, why)

    async def heartbeat(self, args: dict[str, Any]) -> dict[str, Any]:
        """A node's heartbeat; a malformed one, or one from outside the peer networks,
        gets an error reply and changes nothing."""
        beat = from_wire(args, Heartbeat)
        why = peer_refusal(beat.peer, self.networks)
        if why is not None:
            if (beat.node, beat.peer) not in self._refused and (
                    len(self._refused) < LOGGED_REFUSALS):
                self._refused.add((beat.node, beat.peer))
                log.warning("refused node %s: %s", beat.node, why)
            raise ValueError(why)
        if self.leadership is not None and not self.leadership.leading():
            return self._not_leader()
        reply = self.state.heartbeat(beat)
        try:
            await self._save_changes()
        except NotLeader:
            return self._not_leader()
        return to_wire(reply)

    def _not_leader(self) -> dict[str, Any]:
        """A standby's answer to a heartbeat: who leads (None where it knows of none)."""
        leader = self.leadership.known_leader() if self.leadership is not None else None
        return to_wire(heartbeat.NotLeader(heartbeat.Leader(leader)))

    async def _tick(self) -> None:
        """Read the state's clock every ``tick`` seconds, so that a longer gap is time
        the coordinator did not run (``run_clock``), and forget what is due also while
        no heartbeat arrives (a heartbeat forgets too)."""
        while True:
            await trio.sleep(self.state.tick)
            if self.leadership is not None and not self.leadership.leading():
                self.state.now()  # a takeover must not find a gap it did not run
                continue
            self.state.forget()
            try:
                await self._save_changes()
            except (NotLeader, ValueError):
                pass  # logged by the leadership; the next heartbeat answers for it

    async def _save_changes(self) -> None:
        """Save what changed before answering from it: in etcd, or in the state file."""
        if self.leadership is not None:
            try:
                await self.leadership.persist()
            except EtcdUnavailable as exc:  # the node's heartbeat fails, and it beats again
                raise ValueError(f"the coordinator cannot save its state: {exc}") from None
            return
        data = self.state.changes()
        if data is not None:
            await trio.to_thread.run_sync(self.state.write, data, limiter=self._saves)

    async def status(self, args: dict[str, Any]) -> dict[str, Any]:
        """The state, with this coordinator's role; a standby's, its role alone."""
        if self.leadership is None:
            return {**self.state.status(), "coordinator": {
                "role": "leader", "leader": self.address, "advertise": self.address,
                "lease_ttl": None, "takeovers": 0, "last_takeover": None}}
        role = self.leadership.status()
        if not self.leadership.leading():
            return {"coordinator": role}
        return {**self.state.status(), "coordinator": role}

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.rpc.serve)
            log.info("coordinator listening on %s", self.address)
            if self.metrics is not None:
                await nursery.start(self.metrics.serve)
            nursery.start_soon(self._tick)
            if self.leadership is not None:
                await nursery.start(self.leadership.run)
            sd_notify.notify("READY=1")
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    await self._final_save()
                    nursery.cancel_scope.cancel()
                    return

    async def _final_save(self) -> None:
        """At a clean stop: the whole state to its file; or what changed to etcd, and
        the lease revoked, so that a standby takes over at once."""
        if self.leadership is None:
            await trio.to_thread.run_sync(self.state.write, self.state.snapshot(),
                                          limiter=self._saves)
            return
        try:
            await self.leadership.persist()
        except (NotLeader, EtcdUnavailable):
            pass  # a standby has nothing to save; an unreachable etcd was logged
        await self.leadership.resign()

"""``quiver coordinator``: the coordinator state served over authenticated msgpack RPC."""
from __future__ import annotations

import logging
import signal
from typing import Any

import trio

from coordinator.state import CoordinatorState
from quiverfs import sd_notify
from quiverfs.heartbeat import Heartbeat, from_wire, to_wire
from quiverfs.metrics_server import MetricsServer
from quiverfs.peer_network import Networks, peer_refusal
from quiverfs.rpc import RpcServer

log = logging.getLogger(__name__)

LOGGED_REFUSALS = 1024  # refused (node, peer) pairs logged, once each


class CoordinatorServer:
    """RPC ops: heartbeat (a node joins with its first), status. With ``networks``
    (--peer-network), nodes whose peer address is outside them are refused."""

    def __init__(self, state: CoordinatorState, secret: bytes, address: tuple[str, int],
                 metrics: MetricsServer | None = None, networks: Networks = ()) -> None:
        self.state = state
        self.metrics = metrics
        self.networks = networks
        self.rpc = RpcServer(secret, {"heartbeat": self.heartbeat, "status": self.status})
        self.address = self.rpc.bind(*address, "--listen")  # a taken port fails now
        self._saves = trio.CapacityLimiter(1)  # one state write at a time, in order
        self._refused: set[tuple[str, str]] = set()  # (node, peer) refusals logged
        for node in list(state.nodes.values()):  # admitted before the networks changed
            why = peer_refusal(node.peer, networks)
            if why is not None:
                state.drop(node.id, why)

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
        reply = self.state.heartbeat(beat)
        await self._save_changes()
        return to_wire(reply)

    async def _tick(self) -> None:
        """Read the state's clock every ``tick`` seconds, so that a longer gap is time
        the coordinator did not run (``run_clock``), and forget what is due also while
        no heartbeat arrives (a heartbeat forgets too)."""
        while True:
            await trio.sleep(self.state.tick)
            self.state.forget()
            await self._save_changes()

    async def _save_changes(self) -> None:
        data = self.state.changes()
        if data is not None:
            await trio.to_thread.run_sync(self.state.write, data, limiter=self._saves)

    async def status(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.state.status()

    async def serve(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.rpc.serve)
            log.info("coordinator listening on %s", self.address)
            if self.metrics is not None:
                await nursery.start(self.metrics.serve)
            nursery.start_soon(self._tick)
            sd_notify.notify("READY=1")
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    await trio.to_thread.run_sync(self.state.write, self.state.snapshot(),
                                                  limiter=self._saves)
                    nursery.cancel_scope.cancel()
                    return

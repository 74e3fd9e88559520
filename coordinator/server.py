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
from quiverfs.rpc import RpcServer

log = logging.getLogger(__name__)


class CoordinatorServer:
    """RPC ops: heartbeat (a node joins with its first), status."""

    def __init__(self, state: CoordinatorState, secret: bytes, address: tuple[str, int],
                 metrics: MetricsServer | None = None) -> None:
        self.state = state
        self.metrics = metrics
        self.rpc = RpcServer(secret, {"heartbeat": self.heartbeat, "status": self.status})
        self.address = self.rpc.bind(*address, "--listen")  # a taken port fails now
        self._saves = trio.CapacityLimiter(1)  # one state write at a time, in order

    async def heartbeat(self, args: dict[str, Any]) -> dict[str, Any]:
        reply = self.state.heartbeat(from_wire(args, Heartbeat))
        await self._save_changes()
        return to_wire(reply)

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
            sd_notify.notify("READY=1")
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    await trio.to_thread.run_sync(self.state.write, self.state.snapshot(),
                                                  limiter=self._saves)
                    nursery.cancel_scope.cancel()
                    return

"""``quiver coordinator``: the coordinator state served over authenticated msgpack RPC."""
from __future__ import annotations

import logging
import signal
from typing import Any

import trio

from coordinator.state import CoordinatorState
from quiverfs import sd_notify
from quiverfs.option_types import listen_error
from quiverfs.rpc import RpcServer

log = logging.getLogger(__name__)


class CoordinatorServer:
    """RPC ops: join, heartbeat, status."""

    def __init__(self, state: CoordinatorState, secret: bytes, metrics: Any = None) -> None:
        self.state = state
        self.metrics = metrics  # a mountd.metrics.MetricsEndpoint, or None
        self.rpc = RpcServer(secret, {"join": self.join, "heartbeat": self.heartbeat,
                                      "status": self.status})

    async def join(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.state.join(str(args["node"]), str(args["peer"]), int(args["capacity"]))

    async def heartbeat(self, args: dict[str, Any]) -> dict[str, Any]:
        datasets = args.get("datasets", {})
        if not isinstance(datasets, dict):
            raise TypeError("datasets must be a map")
        return self.state.heartbeat(str(args["node"]), str(args["peer"]),
                                    int(args["capacity"]), datasets)

    async def status(self, args: dict[str, Any]) -> dict[str, Any]:
        return self.state.status()

    async def serve(self, host: str, port: int) -> None:
        async with trio.open_nursery() as nursery:
            try:
                bound = await nursery.start(self.rpc.serve, host, port)
            except OSError as exc:  # the port is taken, or the host is not ours
                raise listen_error("--listen", host, port, exc) from None
            log.info("coordinator listening on %s:%d", host, bound)
            if self.metrics is not None:
                await nursery.start(self.metrics.serve)
            sd_notify.notify("READY=1")
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for signum in signals:
                    log.info("%s: stopping", signal.Signals(signum).name)
                    self.state.persist()
                    nursery.cancel_scope.cancel()
                    return

"""The coordinator's state machine inside mountd, for a single node without
``--coordinator``: the same chunk cycles drive one VM, with no network in between."""
from __future__ import annotations

import logging
import os
import trio

from coordinator.state import CoordinatorState
from coordinator.state_store import StateCorrupted
from quiverfs.errors import ExitCode, QuietError
from quiverfs.heartbeat import Heartbeat, HeartbeatReply

log = logging.getLogger(__name__)


class EmbeddedCoordinator:
    """The coordinator's state machine inside mountd (single node)."""

    interval = 0.2  # seconds between heartbeats: each is a function call
    # seconds between writes of the state file: a crash loses at most that much of the
    # cycles' last moves, which the next heartbeats make again
    write_every = 1.0

    def __init__(self, state_dir: str, force_after: float, probe_batches: int,
                 limiter: trio.CapacityLimiter) -> None:
        self.limiter = limiter

        def load() -> CoordinatorState:
            return CoordinatorState(state_dir, heartbeat_timeout=3600.0,
                                    force_after=force_after, probe_batches=probe_batches)

        try:
            self.state = load()
        except StateCorrupted as exc:
            # Only chunk cycles live there, rebuilt from the next heartbeat: a damaged
            # file must not keep mountd from starting.
            aside = f"{exc.path}.corrupted"
            try:
                os.replace(exc.path, aside)
            except OSError as err:
                raise QuietError(f"{exc.message}; mountd cannot do it: {err.strerror}",
                                 ExitCode.PERMISSION) from None
            log.warning("%s: moved it to %s and started the chunk cycles afresh",
                        exc.message, aside)
            self.state = load()
        self._beaten = trio.Event()

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        reply = self.state.heartbeat(beat)
        self._beaten.set()
        return reply

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Write the state file after the heartbeats that changed it, at most every
        ``write_every`` seconds, and once more as mountd stops. Off the heartbeats' path:
        a reply never waits for the disk (the write's fsync took 5-8 ms, and a chunk
        step of make demo's sweep took two or three heartbeats)."""
        task_status.started()
        try:
            while True:
                await self._beaten.wait()
                self._beaten = trio.Event()
                await self._write()
                await trio.sleep(self.write_every)
        finally:
            with trio.CancelScope(shield=True):
                await self._write()

    async def _write(self) -> None:
        data = self.state.changes()
        if data is not None:  # one writer: the writes keep their order
            await trio.to_thread.run_sync(self.state.write, data, limiter=self.limiter)

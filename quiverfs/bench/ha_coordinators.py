"""Two ``quiver coordinator --etcd`` processes sharing a real etcd on loopback, for the
cluster benchmark's ``--kill-coordinator``: the first started leads, the second stands
by; the leader can be SIGKILLed, and the takeover timed from the nodes' switches."""
from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from quiverfs.bench.etcd_process import Etcd
from quiverfs.bench.processes import CoordinatorProcess
from quiverfs.errors import QuietError
from quiverfs.rpc import call_once

ETCD_MISSING = ("etcd is not installed (Debian: apt-get install etcd-server etcd-client): "
                "--kill-coordinator needs it for its two coordinators")
LEAD_TIMEOUT = 60.0  # seconds for a coordinator to lead, or to know who does


class HaCoordinators:
    """An etcd and two coordinators under ``base``, on the lease TTL of
    ``coordinator_args`` (the default where it names none)."""

    def __init__(self, base: str, secret_file: str, secret: bytes, heartbeat_timeout: float,
                 force_evict_after: float, coordinator_args: tuple[str, ...]) -> None:
        self.secret = secret
        etcd_dir = os.path.join(base, "etcd")
        os.makedirs(etcd_dir, exist_ok=True)
        self.etcd = Etcd(etcd_dir)
        self.coordinators = [
            CoordinatorProcess(None, secret_file, os.path.join(base, f"coordinator{i}.log"),
                               heartbeat_timeout=heartbeat_timeout,
                               force_evict_after=force_evict_after,
                               extra_args=("--etcd", self.etcd.url, *coordinator_args))
            for i in range(2)]

    @property
    def addresses(self) -> str:
        """The ``--coordinator`` value that lists both."""
        return ",".join(c.address for c in self.coordinators)

    def status(self, c: CoordinatorProcess) -> dict[str, Any]:
        return call_once(c.address, self.secret, "status")

    def start(self) -> None:
        """etcd, then the first coordinator until it leads, then the second until it
        names the first as the leader."""
        self.etcd.start()
        first, second = self.coordinators
        first.start()
        self._wait(lambda: self.status(first)["coordinator"]["role"] == "leader",
                   "the first coordinator to lead")
        second.start()
        self._wait(lambda: self.status(second)["coordinator"]["leader"] == first.address,
                   "the second coordinator to know the leader")

    def leader(self) -> CoordinatorProcess:
        """The coordinator that leads now; RuntimeError if none does."""
        for c in self.coordinators:
            if c.proc is not None and c.proc.poll() is None:
                try:
                    if self.status(c)["coordinator"]["role"] == "leader":
                        return c
                except QuietError:
                    continue
        raise RuntimeError("no coordinator leads")

    def kill(self, c: CoordinatorProcess) -> float:
        """SIGKILL ``c``; the wall-clock time of the kill."""
        killed = time.time()
        c.proc.kill()
        c.proc.wait()
        return killed

    def wait_for_leader(self, other_than: CoordinatorProcess) -> CoordinatorProcess:
        """The coordinator that leads once ``other_than`` is gone."""
        found: list[CoordinatorProcess] = []

        def leads() -> bool:
            try:
                found.append(self.leader())
            except RuntimeError:
                return False
            return found[-1] is not other_than

        self._wait(leads, "another coordinator to lead")
        return found[-1]

    def stop(self) -> None:
        for c in self.coordinators:
            c.stop()
        self.etcd.stop()

    @staticmethod
    def _wait(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + LEAD_TIMEOUT
        while True:
            try:
                if condition():
                    return
            except QuietError:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {LEAD_TIMEOUT:g} s waiting for {what}")
            time.sleep(0.05)

"""Which of several ``quiver coordinator`` processes leads, through etcd (``--etcd``).

A coordinator campaigns by creating the leader key ``/quiver/PREFIX/leader``, holding
its advertised address, on a lease of ``--lease-ttl`` seconds, in a transaction that
fails where the key exists. The leader renews its lease every TTL/3. It counts its
lease from the moment it sent the last renewal that etcd granted, on its own monotonic
clock: etcd counts it from later, so the leader stops leading before etcd can let the
lease go, and without hearing from etcd it steps down by itself. Every state write is
guarded by the leader key (``etcd_store``): a deposed leader's write changes nothing,
and it steps down. A standby reads the key every TTL/4 and campaigns once it is gone;
it loads the whole state before it answers as the leader, and refuses to lead on a key
it cannot read.
"""
from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any, TypeVar

import trio

from coordinator.etcd_client import EtcdClient, EtcdUnavailable, Fence
from coordinator.etcd_store import EtcdState, MalformedKey
from coordinator.state import CoordinatorState

log = logging.getLogger(__name__)

RENEWS_PER_TTL = 3
POLLS_PER_TTL = 4  # a standby's reads of the leader key

T = TypeVar("T")


class NotLeader(Exception):
    """This coordinator does not lead (any more)."""


class Leadership:
    """This coordinator's role, its lease and the writes guarded by it."""

    def __init__(self, state: CoordinatorState, store: EtcdState, client: EtcdClient,
                 advertise: str, ttl: int,
                 admit: Callable[[], None] = lambda: None) -> None:
        self.state = state
        self.admit = admit  # called on the state just loaded, before it is served
        self.store = store  # its own client: writes may overlap the lease's calls
        self.client = client
        self.advertise = advertise
        self.ttl = ttl  # as asked, then as etcd granted it (it may raise it to its minimum)
        self.role = "standby"
        self.leader: str | None = None  # the address the leader key holds, if known
        self.takeovers = 0  # times this coordinator became the leader
        self.last_takeover: float | None = None  # wall-clock time of the last one
        self._fence: Fence | None = None
        self._lease: int | None = None
        self._deadline = -math.inf  # trio clock: the lease is surely held before it
        self._holding = trio.CancelScope()
        self._writes = trio.Lock()  # one store call at a time, in order
        self._threads = trio.CapacityLimiter(2)  # the lease's client, the store's
        self._diffed_at = -math.inf  # state clock: the last comparison with etcd
        self._diffed_version: int | None = None  # the membership version compared then
        self._unsaved = False  # a write failed: compare again at the next chance
        self._etcd_down: str | None = None  # why etcd cannot be reached, logged once
        self._refusals: set[str] = set()  # malformed keys logged, once each

    def leading(self) -> bool:
        """Whether this coordinator leads now: the lease is surely still its own."""
        return self.role == "leader" and trio.current_time() < self._deadline

    def known_leader(self) -> str | None:
        """The leader's address as far as this coordinator knows: never its own while
        it does not lead (a stopped leader resumes before it notices it was replaced)."""
        return None if self.leader == self.advertise and not self.leading() else self.leader

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Campaign, lead while the lease holds, stand by again, for ever."""
        task_status.started()
        while True:
            while not await self._campaign():
                await trio.sleep(self.ttl / POLLS_PER_TTL)
            with trio.CancelScope() as self._holding:
                await self._hold()
            await self._release()

    async def resign(self) -> None:
        """Stop leading now (a clean stop): the lease is revoked, and with it the leader
        key, so that a standby takes over at once."""
        self._step_down("stopping", logging.INFO)
        await self._release()

    async def persist(self) -> None:
        """Write to etcd what changed, before the caller answers from it. Raises
        NotLeader where this coordinator does not lead (it steps down where etcd
        refused the write), EtcdUnavailable where etcd cannot be reached."""
        async with self._writes:
            if not self.leading() or self._fence is None:
                raise NotLeader
            now = self.state.now()
            # The version changes without a change to save in the file (which saves it
            # with the rest), and silences on their own: compare now and then.
            if not (self.state.pending() or self._unsaved
                    or self.state.version != self._diffed_version
                    or now - self._diffed_at >= self.state.heartbeat_timeout / 2):
                return
            self._diffed_at, self._diffed_version = now, self.state.version
            puts, deletes = self.store.diff(self.state, now)
            if not puts and not deletes:
                return
            self._unsaved = True
            if not await self._thread(self.store.write, self._fence, puts, deletes):
                self._step_down("etcd refused a write: the leader key is no longer this "
                                "coordinator's")
                raise NotLeader
            self._unsaved = False

    async def _campaign(self) -> bool:
        """One try to lead; True once leading (its state loaded)."""
        try:
            return await self._try_to_lead()
        except EtcdUnavailable as exc:
            self._unreachable(exc)
            return False

    async def _try_to_lead(self) -> bool:
        key = self.store.leader_key
        held = await self._thread(self.client.get, key)
        self._reachable()
        if held is not None:
            self.leader = held.value.decode(errors="replace")
            return False
        self.leader = None
        sent = trio.current_time()
        lease, ttl = await self._thread(self.client.grant, self.ttl)
        self.ttl = ttl
        won, held = await self._thread(self.client.create, key, self.advertise, lease)
        if not won or held is None:
            await self._thread(self.client.revoke, lease)
            self.leader = None if held is None else held.value.decode(errors="replace")
            return False
        self._lease, self._deadline = lease, sent + ttl
        self._fence = Fence(key, held.create_revision, self.advertise)
        try:
            async with self._writes:  # after any write of an earlier term
                kvs = await self._thread(self.store.fetch)
            saved = self.store.restore(kvs, self.state.force_after, self.state.now())
        except EtcdUnavailable:
            await self._release()
            raise
        except MalformedKey as exc:
            if str(exc) not in self._refusals:
                self._refusals.add(str(exc))
                log.error("%s", exc)
            await self._release()
            await trio.sleep(self.ttl)  # the other coordinators try their turn
            return False
        self.state.resume(saved)
        self.admit()
        self.role, self.leader = "leader", self.advertise
        self.takeovers += 1
        self.last_takeover = time.time()
        self._diffed_at, self._diffed_version = -math.inf, None
        log.info("leading as %s (lease %d s, etcd key %s revision %d)", self.advertise, ttl,
                 key, held.create_revision)
        return True

    async def _hold(self) -> None:
        """Renew the lease every TTL/3 until a renewal fails for a whole TTL, etcd says
        it expired, or a write was refused (``_step_down`` cancels this)."""
        while True:
            sent = trio.current_time()
            ttl = None
            with trio.move_on_at(self._deadline):
                try:
                    ttl = await trio.to_thread.run_sync(
                        self.client.keepalive, self._lease, limiter=self._threads,
                        abandon_on_cancel=True)
                except EtcdUnavailable as exc:
                    self._unreachable(exc)
                else:
                    self._reachable()
            if ttl is not None and ttl <= 0:
                self._step_down("etcd let the lease expire")
                return
            if ttl is not None:
                self._deadline = sent + ttl
            if trio.current_time() >= self._deadline:
                self._step_down(f"the lease was not renewed for {self.ttl} s")
                return
            await trio.sleep_until(min(sent + self.ttl / RENEWS_PER_TTL, self._deadline))

    def _step_down(self, why: str, level: int = logging.WARNING) -> None:
        if self.role != "leader":
            return
        self.role, self.leader, self._fence = "standby", None, None
        self._deadline = -math.inf
        self._holding.cancel()
        log.log(level, "stepped down as the leader: %s", why)

    async def _release(self) -> None:
        """Revoke the lease, where there is one (best effort: it expires anyway)."""
        lease, self._lease, self._fence = self._lease, None, None
        if lease is None:
            return
        try:
            await self._thread(self.client.revoke, lease)
        except EtcdUnavailable as exc:
            log.debug("lease %x not revoked: %s", lease, exc)

    async def _thread(self, fn: Callable[..., T], *args: Any) -> T:
        return await trio.to_thread.run_sync(fn, *args, limiter=self._threads)

    def _unreachable(self, exc: EtcdUnavailable) -> None:
        if self._etcd_down is None:
            log.warning("etcd: %s (%s meanwhile)", exc, self.role)
        self._etcd_down = str(exc)

    def _reachable(self) -> None:
        if self._etcd_down is not None:
            log.info("etcd answers again")
        self._etcd_down = None

    def status(self) -> dict[str, Any]:
        """The role, the leader's address, the lease, the takeovers, and the state
        writes this process made (transactions, keys and the values' bytes)."""
        return {"role": "leader" if self.leading() else "standby",
                "leader": self.known_leader(),
                "advertise": self.advertise, "lease_ttl": self.ttl,
                "takeovers": self.takeovers, "last_takeover": self.last_takeover,
                "etcd_writes": self.store.transactions,
                "etcd_keys_written": self.store.keys_written,
                "etcd_bytes_written": self.store.bytes_written}

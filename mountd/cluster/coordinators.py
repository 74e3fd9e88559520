"""Which of its coordinators a node heartbeats to: it follows the one that leads.

A node is given one or more ``quiver coordinator`` addresses (``--coordinator
A,B,...``). One leads; a standby answers a heartbeat with who leads (``NotLeader``).
A heartbeat goes to the coordinator in use. A standby's answer moves it to the leader
named, if that is one of the node's addresses (else to the next in the list), and the
heartbeat goes there at once; a coordinator that does not answer (refused, timed out,
an error or an answer that cannot be read) is passed over for the next one in the list,
round-robin. Each is tried at most once per heartbeat: when none answers as the leader,
the heartbeat fails as it would with one coordinator gone (reads go on with the last
membership), and the next one starts where this one ended.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

import trio

from quiverfs.heartbeat import Heartbeat, HeartbeatReply, NotLeader, heartbeat_answer, to_wire
from quiverfs.rpc import HANDSHAKE_TIMEOUT, RpcClient, RpcError, Unavailable

log = logging.getLogger(__name__)

HEARTBEAT = 0.5  # seconds between heartbeats to a remote coordinator
# With one coordinator there is no other to try: it gets the time it always had.
ALONE_CALL_TIMEOUT = 5.0  # seconds
# With several, one that is gone must not hold the heartbeat up: a takeover is to be
# followed within twice a 5 s lease. A connection (TCP and the secret's handshake) takes
# milliseconds on a LAN, and a heartbeat's answer includes the leader's state write.
TRY_CONNECT_TIMEOUT = 1.0  # seconds
TRY_CALL_TIMEOUT = 2.0  # seconds
LOGGED_LEADERS = 64  # leader addresses outside the list logged, once each


class RemoteCoordinators:
    """``quiver coordinator`` over RPC, at one address or several of which one leads.
    ``run`` must be running in a nursery (the connections' readers live there)."""

    interval = HEARTBEAT

    def __init__(self, addresses: Sequence[tuple[str, int]], secret: bytes) -> None:
        alone = len(addresses) == 1
        self.addresses = [f"{host}:{port}" for host, port in addresses]
        self.clients = [RpcClient(host, port, secret, timeout=10.0,
                                  connect_timeout=HANDSHAKE_TIMEOUT if alone
                                  else TRY_CONNECT_TIMEOUT)
                        for host, port in addresses]
        self.call_timeout = ALONE_CALL_TIMEOUT if alone else TRY_CALL_TIMEOUT
        self.current = 0  # the one the next heartbeat goes to first
        self.answered: int | None = None  # the one whose answer was the last taken
        self.switches = 0  # times a heartbeat was answered by another one than the last
        self.last_switch: float | None = None  # when, in seconds since the epoch
        self._logged: set[str] = set()  # leaders named that are not in the list

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            for client in self.clients:
                await nursery.start(client.tasks.run)
            task_status.started()

    async def heartbeat(self, beat: Heartbeat) -> HeartbeatReply:
        """The leader's answer to ``beat``; Unavailable, saying why for each one tried,
        when none answers as the leader."""
        args = to_wire(beat)
        tried: set[int] = set()
        why = []
        while len(tried) < len(self.clients):
            i = self.current
            tried.add(i)
            try:
                answer = await self._ask(i, args)
            except Unavailable as exc:
                why.append(str(exc))
                self.current = self._next(i, tried)
                continue
            if isinstance(answer, NotLeader):
                leader = answer.not_leader.leader
                why.append(f"{self.addresses[i]}: not the leader (leader: {leader})")
                j = self._listed(leader, i)
                self.current = j if j is not None and j not in tried else self._next(i, tried)
                continue
            self._taken(i)
            return answer
        raise Unavailable("; ".join(why))

    async def _ask(self, i: int, args: dict[str, Any]) -> HeartbeatReply | NotLeader:
        try:
            reply = await self.clients[i].call("heartbeat", args, timeout=self.call_timeout)
            return heartbeat_answer(reply)
        except (RpcError, ValueError) as exc:  # refused, or an answer we cannot read
            raise Unavailable(f"{self.addresses[i]}: {exc}") from None

    def _next(self, i: int, tried: set[int]) -> int:
        """The first after ``i`` in the list not tried yet; the one after ``i`` when all
        were (where the next heartbeat starts)."""
        n = len(self.clients)
        for step in range(1, n + 1):
            j = (i + step) % n
            if j not in tried:
                return j
        return (i + 1) % n

    def _listed(self, leader: str | None, named_by: int) -> int | None:
        """The index of ``leader`` in the list; None (logged once) when it is not there."""
        if leader is None:
            return None
        if leader in self.addresses:
            return self.addresses.index(leader)
        if leader not in self._logged and len(self._logged) < LOGGED_LEADERS:
            self._logged.add(leader)
            log.warning("coordinator %s names %s as the leader, which is not one of "
                        "--coordinator (%s): trying the others; list it, spelled as "
                        "the coordinators' --listen", self.addresses[named_by], leader,
                        ",".join(self.addresses))
        return None

    def _taken(self, i: int) -> None:
        if self.answered is not None and self.answered != i:
            self.switches += 1
            self.last_switch = time.time()
            log.warning("following coordinator %s, which leads now (was %s)",
                        self.addresses[i], self.addresses[self.answered])
        elif self.answered is None and len(self.clients) > 1:
            log.info("following coordinator %s, which leads", self.addresses[i])
        self.answered = i

    def status(self) -> dict[str, Any]:
        """The addresses, the one in use (whose answer was the last taken; None before
        the first) and the switches between them."""
        return {"addresses": list(self.addresses),
                "in_use": None if self.answered is None else self.addresses[self.answered],
                "switches": self.switches, "last_switch": self.last_switch}

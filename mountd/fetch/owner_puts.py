"""Items fetched here that another node owns, sent to their owners in batches."""
from __future__ import annotations

from collections import Counter

import trio

from mountd.cluster.membership import Cluster
from quiverfs.background import BackgroundTasks
from quiverfs.counters import ReadCounter
from quiverfs.rpc import Unavailable

PUT_LINGER = 0.005  # seconds items bound for one owner wait to share a put request


class OwnerPuts:
    """Queues items by owner; the first one queued starts the sender of its batch."""

    def __init__(self, cluster: Cluster, counters: Counter[ReadCounter]) -> None:
        self.cluster = cluster
        self.counters = counters  # the node's read counters: puts, requests, errors
        self.tasks = BackgroundTasks()  # where batches are sent
        self._queued: dict[str, list[tuple[bytes, bytes]]] = {}  # by owner, not yet sent

    def put(self, owner: str, digest: bytes, data: bytes) -> None:
        """Send a verified item to ``owner`` soon (nothing while not running)."""
        if not self.tasks.running:
            return
        queued = self._queued.setdefault(owner, [])
        queued.append((digest, data))
        if len(queued) == 1:
            self.tasks.start_soon(self._send, owner)

    async def _send(self, owner: str) -> None:
        await trio.sleep(PUT_LINGER)  # a chunk load's concurrent fetches join the batch
        items = self._queued.pop(owner)
        try:
            stored = await self.cluster.peers.put_many(owner, items)
        except Unavailable:
            self.counters[ReadCounter.PEER_PUT_ERRORS] += len(items)
            return
        self.counters[ReadCounter.PEER_PUTS] += sum(stored)
        self.counters[ReadCounter.PEER_PUT_REQUESTS] += 1

"""The peer cache: this node's store served to other nodes, and calls to theirs.

Ops (batched: each takes a list of hashes or items): ``lookup`` -> which are held,
``get`` -> their bytes (None where absent), ``put`` -> store items this node owns.
Every put is checked against its SHA-256 before it is stored; every get is checked
by the receiver. A bad hash is rejected and logged. And ``loaded``: the calling node
stored more of its share of a loading chunk of a dataset (by digest identity), which
jobs here may be waiting for (mountd.jobs.planner); a false one costs them a look.
"""
from __future__ import annotations

import hashlib
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import trio

from mountd.store.content_store import ContentStore
from mountd.store.errors import IntegrityError, StoreError
from quiverfs.background import BackgroundTasks
from quiverfs.peer_network import Networks, peer_refusal, split_peer
from quiverfs.rpc import RpcClient, RpcError, RpcServer, Unavailable

log = logging.getLogger(__name__)

MAX_BATCH = 1024  # hashes or items per request
GET_REPLY_BYTES = 32 << 20  # content bytes one get reply carries; later items come back None
PUT_REQUEST_BYTES = 16 << 20  # content bytes put_many sends per request
DOWN_FOR = 5.0  # seconds a peer that failed a call is skipped
_IDENTITY = re.compile(r"[0-9a-f]{64}")  # a digest's identity (hex SHA-256)


def _hashes(args: dict[str, Any]) -> list[bytes]:
    hashes = args["hashes"]
    if not isinstance(hashes, list) or len(hashes) > MAX_BATCH or not all(
            isinstance(h, bytes) and len(h) == 32 for h in hashes):
        raise ValueError(f"hashes must be a list of at most {MAX_BATCH} 32-byte digests")
    return hashes


class PeerService:
    """The handlers other nodes call."""

    def __init__(self, store: ContentStore, limiter: trio.CapacityLimiter,
                 on_loaded: Callable[[str], None]) -> None:
        self.store = store
        self.limiter = limiter
        self.on_loaded = on_loaded  # wakes the jobs here that wait on a dataset's loads
        self.rejected_puts = 0

    def handlers(self) -> dict[str, Any]:
        return {"lookup": self.lookup, "get": self.get, "put": self.put,
                "loaded": self.loaded}

    async def loaded(self, args: dict[str, Any]) -> bool:
        identity = args["dataset"]
        if not isinstance(identity, str) or not _IDENTITY.fullmatch(identity):
            raise ValueError("dataset must be a digest identity (64 hex digits)")
        self.on_loaded(identity)
        return True

    async def lookup(self, args: dict[str, Any]) -> list[bool]:
        hashes = _hashes(args)
        return await trio.to_thread.run_sync(lambda: [h in self.store for h in hashes],
                                             limiter=self.limiter)

    async def get(self, args: dict[str, Any]) -> list[bytes | None]:
        hashes = _hashes(args)

        def get_all() -> list[bytes | None]:
            out: list[bytes | None] = []
            total = 0
            for h in hashes:
                data = None if total >= GET_REPLY_BYTES else self._get_or_none(h)
                if data is not None and total and total + len(data) > GET_REPLY_BYTES:
                    data = None  # the first item always goes, whatever its size
                total += len(data) if data is not None else 0
                out.append(data)
            return out

        return await trio.to_thread.run_sync(get_all, limiter=self.limiter)

    def _get_or_none(self, digest: bytes) -> bytes | None:
        """A store failure answers "absent": the asking node falls back to the bucket."""
        try:
            return self.store.get(digest)
        except StoreError as exc:
            log.warning("peer get of %s failed here: %s", digest.hex(), exc)
            return None

    async def put(self, args: dict[str, Any]) -> list[bool]:
        items = args["items"]
        if not isinstance(items, list) or len(items) > MAX_BATCH:
            raise ValueError(f"items must be a list of at most {MAX_BATCH} [hash, bytes]")

        def store_all() -> list[bool]:
            results = []
            for item in items:
                try:
                    digest, data = item
                    if not (isinstance(digest, bytes) and isinstance(data, bytes)):
                        raise TypeError
                    results.append(self.store.put(digest, data))  # False: cannot write
                except IntegrityError:
                    self.rejected_puts += 1
                    log.warning("rejected a put whose content does not hash to %s",
                                digest.hex())
                    results.append(False)
                except (TypeError, ValueError):
                    results.append(False)
            return results

        return await trio.to_thread.run_sync(store_all, limiter=self.limiter)

    def server(self, secret: bytes) -> RpcServer:
        return RpcServer(secret, self.handlers())


class PeerSet:
    """Connections to the other members; a peer that fails is skipped for a while, and
    one whose address is malformed or outside ``networks`` (--peer-network) is never
    dialled."""

    def __init__(self, secret: bytes, limiter: trio.CapacityLimiter,
                 networks: Networks = ()) -> None:
        self.secret = secret
        self.limiter = limiter  # the daemon's blocking workers: hashing peers' answers
        self.networks = networks
        self.clients: dict[str, RpcClient] = {}
        self.addresses: dict[str, str] = {}  # node -> the peer address its client dials
        self.refused: dict[str, str] = {}  # node -> its peer address, refused (logged once)
        self.down_until: dict[str, float] = {}
        self.bad_gets = 0
        self.tasks = BackgroundTasks()  # where the clients' connections live

    def update(self, members: dict[str, str]) -> None:
        """Track the current members (node id -> peer HOST:PORT)."""
        for node in list(self.clients):
            if members.get(node) != self.addresses[node]:
                client = self.clients.pop(node)
                del self.addresses[node]
                self.tasks.start_soon(client.close)
        self.refused = {n: p for n, p in self.refused.items() if members.get(n) == p}
        for node, peer in members.items():
            if node in self.clients or node in self.refused or not self.tasks.running:
                continue
            why = peer_refusal(peer, self.networks)
            if why is not None:
                self.refused[node] = peer
                log.warning("not dialling member %s: %s", node, why)
                continue
            host, port = split_peer(peer)
            client = RpcClient(host, port, self.secret, timeout=10.0)
            self.clients[node] = client
            self.addresses[node] = peer
            self.tasks.start_soon(client.tasks.run)

    def is_down(self, node: str) -> bool:
        """Whether ``node`` is not to be asked now: it failed a call lately, or its
        address is refused."""
        return node in self.refused or self.down_until.get(node, 0.0) > time.monotonic()

    async def _call(self, node: str, op: str, args: dict[str, Any]) -> Any:
        client = self.clients.get(node)
        if client is None or self.is_down(node):
            raise Unavailable(f"peer {node} unavailable")
        try:
            return await client.call(op, args)
        except Unavailable:
            self.down_until[node] = time.monotonic() + DOWN_FOR
            log.warning("peer %s unreachable: skipping it for %.0f s", node, DOWN_FOR)
            raise
        except RpcError as exc:
            raise Unavailable(f"peer {node} refused: {exc}") from None

    async def _list_call(self, node: str, op: str, args: dict[str, Any], n: int
                         ) -> list[Any]:
        """A call whose reply is a list of one answer per item of ``n``; any other reply
        (a hostile or mismatched peer) is Unavailable."""
        reply = await self._call(node, op, args)
        if not isinstance(reply, list) or len(reply) != n:
            raise Unavailable(f"peer {node} sent a malformed {op} reply")
        return reply

    async def lookup(self, node: str, hashes: list[bytes]) -> list[bool]:
        out: list[bool] = []
        for i in range(0, len(hashes), MAX_BATCH):
            part = hashes[i:i + MAX_BATCH]
            out += [bool(found) for found in await self._list_call(
                node, "lookup", {"hashes": part}, len(part))]
        return out

    async def loaded(self, node: str, identity: str) -> None:
        """Tell ``node`` that this node stored more of a loading chunk of ``identity``."""
        await self._call(node, "loaded", {"dataset": identity})

    async def get(self, node: str, digest: bytes) -> bytes | None:
        """One item from a peer, checked against its hash (a bad one counts as absent)."""
        (data,) = await self.get_many(node, [digest])
        return data

    async def get_many(self, node: str, hashes: list[bytes]) -> list[bytes | None]:
        """Items from a peer in one request per MAX_BATCH (a reply may leave items out
        past GET_REPLY_BYTES), each checked against its hash; absent or bad: None."""
        got: list[Any] = []
        for i in range(0, len(hashes), MAX_BATCH):
            part = hashes[i:i + MAX_BATCH]
            got += await self._list_call(node, "get", {"hashes": part}, len(part))

        def check() -> list[bytes | None]:
            out: list[bytes | None] = []
            for digest, data in zip(hashes, got):
                if data is not None and (not isinstance(data, bytes)
                                         or hashlib.sha256(data).digest() != digest):
                    self.bad_gets += 1
                    log.error("peer %s sent content that does not hash to %s: ignored",
                              node, digest.hex())
                    data = None
                out.append(data)
            return out

        return await trio.to_thread.run_sync(check, limiter=self.limiter)

    async def put_many(self, node: str, items: list[tuple[bytes, bytes]]) -> list[bool]:
        """Store (hash, content) pairs at a peer, in requests of at most MAX_BATCH items
        and about PUT_REQUEST_BYTES; the peer checks each hash. Whether each was stored."""
        out: list[bool] = []
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and end - start < MAX_BATCH and (
                    end == start or size + len(items[end][1]) <= PUT_REQUEST_BYTES):
                size += len(items[end][1])
                end += 1
            out += [bool(ok) for ok in await self._list_call(
                node, "put", {"items": [list(i) for i in items[start:end]]}, end - start)]
            start = end
        return out

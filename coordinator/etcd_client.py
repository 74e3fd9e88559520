"""The few etcd v3 calls the coordinator makes, through etcd's JSON gateway (etcd3gw).

Every call is synchronous (``requests``): the coordinator runs them with
``trio.to_thread.run_sync`` under a CapacityLimiter, never on its loop. With several
endpoints (``--etcd http://H:P,http://H:P``), a call that cannot reach one tries the
next; etcd forwards what needs its leader. Keys and values are bytes on the wire in
base64, as the gateway wants them.
"""
from __future__ import annotations

import base64
import dataclasses
import urllib.parse
from typing import Any, ClassVar

from quiverfs.errors import ExitCode, QuietError

Endpoint = tuple[str, int]


class EtcdUnavailable(Exception):
    """No endpoint answered, or etcd refused the request; the message says which."""


@dataclasses.dataclass(frozen=True)
class EtcdEndpoints:
    """``--etcd``: etcd client URLs, comma-separated (``http://10.0.0.1:2379,...``).
    Only ``http``: TLS and etcd's users are not supported yet."""

    option: str
    toml_types: ClassVar[tuple[type, ...]] = (str,)

    def __call__(self, value: str) -> tuple[Endpoint, ...]:
        endpoints = []
        for part in value.split(","):
            url = urllib.parse.urlsplit(part.strip())
            try:
                port = url.port
            except ValueError:
                port = None
            if url.scheme != "http" or not url.hostname or port is None or url.path not in (
                    "", "/") or url.username or url.query:
                raise QuietError(f"invalid {self.option} URL {part.strip()!r}: give etcd "
                                 "client URLs like http://10.0.0.1:2379, comma-separated "
                                 "(https is not supported yet)", ExitCode.USAGE)
            endpoints.append((url.hostname, port))
        return tuple(endpoints)


@dataclasses.dataclass
class KeyValue:
    """One key as etcd holds it."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int


@dataclasses.dataclass
class Fence:
    """The leader key as its holder created it: a write guarded by it succeeds only
    while the key is still that one, with that value."""

    key: str
    create_revision: int
    value: str


class EtcdClient:
    """One client (its own HTTP session, so one per thread that uses it at a time)."""

    def __init__(self, endpoints: tuple[Endpoint, ...], timeout: float) -> None:
        import etcd3gw  # here: `quiver` imports this module for its option type alone

        self._exceptions = etcd3gw.exceptions
        # api_path fixed: etcd 3.4 and later serve /v3/, and discovery would cost a call
        self._clients = [etcd3gw.client(host=h, port=p, timeout=timeout, api_path="/v3/")
                         for h, p in endpoints]
        self._current = 0  # the endpoint that answered last

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        why = ""
        for i in range(len(self._clients)):
            n = (self._current + i) % len(self._clients)
            client = self._clients[n]
            try:
                reply = client.post(client.get_url(path), json=payload)
            except (self._exceptions.ConnectionFailedError,
                    self._exceptions.ConnectionTimeoutError) as exc:
                failed = ("timed out" if isinstance(exc, self._exceptions.ConnectionTimeoutError)
                          else "connection failed")
                why = f"{why}{', ' if why else ''}{client.host}:{client.port} {failed}"
                continue
            except self._exceptions.Etcd3Exception as exc:
                raise EtcdUnavailable(f"etcd {client.host}:{client.port} refused {path}: "
                                      f"{exc.detail_text}") from None
            except ValueError as exc:  # a reply that is not JSON
                raise EtcdUnavailable(f"etcd {client.host}:{client.port}: malformed reply "
                                      f"to {path}: {exc}") from None
            self._current = n
            return reply
        raise EtcdUnavailable(f"no etcd endpoint answered ({why})")

    def grant(self, ttl: int) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds: its id, and the TTL etcd granted (it may
        raise a TTL below its own minimum)."""
        reply = self._post("lease/grant", {"TTL": ttl, "ID": 0})
        return int(reply["ID"]), int(reply["TTL"])

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``: the TTL it has again, or -1 where it expired."""
        return int(self._post("lease/keepalive", {"ID": lease})["result"].get("TTL", -1))

    def revoke(self, lease: int) -> None:
        """End ``lease`` now: the keys attached to it are deleted."""
        self._post("kv/lease/revoke", {"ID": lease})

    def get(self, key: str) -> KeyValue | None:
        kvs = self._post("kv/range", {"key": _b64(key)}).get("kvs", [])
        return _key_value(kvs[0]) if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        """Every key under ``prefix``."""
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        reply = self._post("kv/range", {"key": _b64(prefix), "range_end": _b64(end)})
        return [_key_value(kv) for kv in reply.get("kvs", [])]

    def create(self, key: str, value: str, lease: int) -> tuple[bool, KeyValue | None]:
        """Create ``key`` holding ``value`` on ``lease`` unless it exists: whether it was
        created, and the key as it is now (None: deleted since)."""
        k = _b64(key)
        reply = self._post("kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "CREATE",
                         "create_revision": 0}],
            "success": [{"request_put": {"key": k, "value": _b64(value), "lease": lease}},
                        {"request_range": {"key": k}}],
            "failure": [{"request_range": {"key": k}}]})
        kvs = reply["responses"][-1]["response_range"].get("kvs", [])
        return bool(reply.get("succeeded")), _key_value(kvs[0]) if kvs else None

    def fenced(self, fence: Fence, puts: dict[str, bytes], deletes: list[str]) -> bool:
        """Put ``puts`` and delete ``deletes`` in one transaction, only while ``fence``
        holds; whether it did."""
        k = _b64(fence.key)
        ops = [{"request_put": {"key": _b64(key), "value": _b64(value)}}
               for key, value in puts.items()]
        ops += [{"request_delete_range": {"key": _b64(key)}} for key in deletes]
        reply = self._post("kv/txn", {
            "compare": [{"key": k, "result": "EQUAL", "target": "CREATE",
                         "create_revision": fence.create_revision},
                        {"key": k, "result": "EQUAL", "target": "VALUE",
                         "value": _b64(fence.value)}],
            "success": ops, "failure": []})
        return bool(reply.get("succeeded"))


def _b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def _key_value(kv: dict[str, Any]) -> KeyValue:
    return KeyValue(base64.b64decode(kv["key"]).decode(errors="replace"),
                    base64.b64decode(kv.get("value", "")),
                    int(kv.get("create_revision", 0)), int(kv.get("mod_revision", 0)))

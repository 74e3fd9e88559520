"""The few etcd v3 calls the coordinator makes, through etcd's JSON gateway (etcd3gw).

Every call is synchronous (``requests``): the coordinator runs them with
``trio.to_thread.run_sync`` under a CapacityLimiter, never on its loop. With several
endpoints (``--etcd https://H:P,https://H:P``), a call that cannot reach one tries the
next; etcd forwards what needs its leader. Keys and values are bytes on the wire in
base64, as the gateway wants them.

An etcd with TLS is reached at ``https`` URLs, its certificate checked against
``--etcd-ca`` (or the system's CAs), with ``--etcd-cert``/``--etcd-key`` where it checks
its clients' (``--client-cert-auth``). An etcd with auth enabled wants a user: the
client authenticates as ``--etcd-user`` and sends the token etcd gives it with each
call, and authenticates again where etcd no longer knows the token (it expired, or
etcd restarted).
"""
from __future__ import annotations

import base64
import dataclasses
import json
import re
import ssl
import urllib.parse
from typing import Any, ClassVar

from quiverfs.errors import ExitCode, QuietError


class EtcdUnavailable(Exception):
    """No endpoint answered, or etcd refused the request; the message says which."""


@dataclasses.dataclass(frozen=True)
class Endpoint:
    scheme: str  # http or https
    host: str
    port: int


@dataclasses.dataclass(frozen=True)
class EtcdEndpoints:
    """``--etcd``: etcd client URLs, comma-separated (``https://10.0.0.1:2379,...``)."""

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
            if url.scheme not in ("http", "https") or not url.hostname or port is None or (
                    url.path not in ("", "/") or url.username or url.query):
                raise QuietError(f"invalid {self.option} URL {part.strip()!r}: give etcd "
                                 "client URLs like https://10.0.0.1:2379 (or http://), "
                                 "comma-separated", ExitCode.USAGE)
            endpoints.append(Endpoint(url.scheme, url.hostname, port))
        return tuple(endpoints)


@dataclasses.dataclass(frozen=True)
class EtcdAccess:
    """Where etcd is and how to reach it: its endpoints, the TLS files (a CA bundle;
    a client certificate and its key), and the user and password where auth is on."""

    endpoints: tuple[Endpoint, ...]
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None

    def check(self) -> None:
        """QuietError where the TLS files cannot be used (read now, not at each call)."""
        if not any(e.scheme == "https" for e in self.endpoints) and (self.ca or self.cert):
            raise QuietError("--etcd-ca and --etcd-cert are for https --etcd URLs: give "
                             "https://HOST:PORT", ExitCode.USAGE)
        for option, load in (("--etcd-ca", lambda: ssl.create_default_context(cafile=self.ca)),
                             ("--etcd-cert/--etcd-key", self._load_certificate)):
            try:
                load()
            except OSError as exc:  # ssl.SSLError is one
                reason = exc.strerror or str(exc)
                if isinstance(exc, ssl.SSLError):
                    reason = ("no PEM certificate in it" if option == "--etcd-ca" else
                              "not a PEM certificate and its key")
                raise QuietError(f"cannot use {option}: {reason}: give PEM files this "
                                 "user can read (the key without a passphrase)",
                                 ExitCode.PERMISSION) from None

    def _load_certificate(self) -> None:
        if self.cert:
            ssl.create_default_context().load_cert_chain(self.cert, self.key, password=b"")


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
    """One client (its own HTTP sessions, so one per thread that uses it at a time)."""

    def __init__(self, access: EtcdAccess, timeout: float) -> None:
        import etcd3gw  # here: `quiver` imports this module for its option type alone

        self._exceptions = etcd3gw.exceptions
        self._access = access
        # api_path fixed: etcd 3.4 and later serve /v3/, and discovery would cost a call
        self._clients = [etcd3gw.client(host=e.host, port=e.port, protocol=e.scheme,
                                        cert_cert=access.cert, cert_key=access.key,
                                        timeout=timeout, api_path="/v3/")
                         for e in access.endpoints]
        self._current = 0  # the endpoint that answered last

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        why = ""
        for i in range(len(self._clients)):
            n = (self._current + i) % len(self._clients)
            client = self._clients[n]
            try:
                reply = self._call(client, path, payload)
            except (self._exceptions.ConnectionFailedError,
                    self._exceptions.ConnectionTimeoutError) as exc:
                failed = ("timed out" if isinstance(exc, self._exceptions.ConnectionTimeoutError)
                          else _connection_failure(exc))
                why = f"{why}{', ' if why else ''}{client.host}:{client.port} {failed}"
                continue
            except self._exceptions.Etcd3Exception as exc:
                raise EtcdUnavailable(f"etcd {client.host}:{client.port} refused {path}: "
                                      f"{_refusal(exc.detail_text)}") from None
            except ValueError as exc:  # a reply that is not JSON
                raise EtcdUnavailable(f"etcd {client.host}:{client.port}: malformed reply "
                                      f"to {path}: {exc}") from None
            self._current = n
            return reply
        raise EtcdUnavailable(f"no etcd endpoint answered ({why})")

    def _call(self, client: Any, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """``path`` through ``client``, authenticated first where a user is given and
        once more where etcd no longer knows the token."""
        if self._access.user is None:
            return self._send(client, path, payload)
        if "Authorization" not in client.session.headers:
            self._authenticate(client)
        try:
            return self._send(client, path, payload)
        except self._exceptions.Etcd3Exception as exc:
            if "invalid auth token" not in (exc.detail_text or ""):
                raise
        self._authenticate(client)
        return self._send(client, path, payload)

    def _send(self, client: Any, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        # --etcd-ca on each request: requests prefers $REQUESTS_CA_BUNDLE to a session's
        return client.post(client.get_url(path), json=payload,
                           **({"verify": self._access.ca} if self._access.ca else {}))

    def _authenticate(self, client: Any) -> None:
        client.session.headers.pop("Authorization", None)
        try:
            reply = self._send(client, "auth/authenticate", {
                "name": self._access.user, "password": self._access.password or ""})
        except (self._exceptions.ConnectionFailedError,
                self._exceptions.ConnectionTimeoutError):
            raise
        except self._exceptions.Etcd3Exception as exc:
            raise EtcdUnavailable(
                f"etcd {client.host}:{client.port} refused user {self._access.user!r}: "
                f"{_refusal(exc.detail_text)} (check --etcd-user and "
                "--etcd-password-file)") from None
        client.session.headers["Authorization"] = str(reply.get("token", ""))

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


def _refusal(body: str | None) -> str:
    """etcd's reason for refusing a call, from its JSON reply where it is one."""
    try:
        reason = str(json.loads(body or "")["message"])
    except (ValueError, KeyError, TypeError):
        reason = (body or "no reason given").strip()[:200]
    if reason == "etcdserver: user name is empty":
        reason += " (auth is on in etcd: give --etcd-user and --etcd-password-file)"
    return reason


def _connection_failure(exc: Exception) -> str:
    """'connection failed', or the TLS handshake's failure where that was it, with the
    options that set it right."""
    text = str(exc.detail_text or exc)
    if "SSLError" not in text:
        return "connection failed"
    found = re.search(r"\[SSL: [A-Z0-9_]+\] ([^(')]*)", text)
    if found is None:  # etcd hung up: how Go's TLS refuses a client without a certificate
        return ("TLS failed (etcd ended the handshake: if it checks its clients' "
                "certificates, give --etcd-cert and --etcd-key)")
    reason = found.group(1).strip()
    if "verify failed" in reason:
        reason += ": give --etcd-ca, the CA that signed etcd's certificate"
    elif "certificate" in reason:
        reason += ": etcd wants a client certificate its CA signed: give --etcd-cert and " \
                  "--etcd-key"
    return f"TLS failed ({reason})"

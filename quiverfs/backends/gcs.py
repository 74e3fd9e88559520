"""``gs://bucket/prefix`` backend over the official google-cloud-storage client."""
from __future__ import annotations

import functools
import http.client
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any, BinaryIO

import requests
import urllib3
from google.api_core import exceptions as gexc
from google.api_core.retry import Retry
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.auth.transport.requests import Request
from google.auth.transport.urllib3 import AuthorizedHttp
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY
from google.oauth2 import service_account
from urllib3.connection import HTTPConnection
from urllib3.connectionpool import HTTPConnectionPool

from quiverfs.backends.base import Backend, ObjectInfo, StorageOptions, check_key
from quiverfs.errors import ExitCode, QuietError
from quiverfs.gcs_endpoint import DEFAULT_ENDPOINT

log = logging.getLogger(__name__)

# Seconds: connect and read timeouts of one HTTP request, and the whole retry budget of
# the calls that make a digest (list, stat, stream). An item's read has its own, shorter
# bound (StorageOptions.fetch_deadline): a reader waits on it.
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
RETRY_DEADLINE = 120.0
TOKEN_TIMEOUT = 10.0  # seconds: one request to a service-account key's token endpoint
STREAM_CHUNK = 8 << 20
BODY_PIECE = 1 << 20  # bytes of a body read at most between two looks at the deadline
REASON_CHARS = 200  # of a token endpoint's error, in a message


def split_gs_uri(uri: str) -> tuple[str, str]:
    """``gs://bucket/a/b`` -> (``bucket``, ``a/b``)."""
    rest = uri[len("gs://"):]
    bucket, _, prefix = rest.partition("/")
    if not bucket:
        raise QuietError(f"{uri!r} names no bucket: use gs://BUCKET[/PREFIX]", ExitCode.USAGE)
    return bucket, prefix.strip("/")


class GCSBackend(Backend):
    """Objects under ``gs://bucket/prefix``; one client per thread (clients are not
    shared), each with the environment's proxies and CA bundle read when it is made.
    Whole-item reads go through a lighter transport made from the same client
    (``reader``), each within ``options.fetch_deadline``; ``abort`` ends those in flight."""

    def __init__(self, uri: str, options: StorageOptions | None = None,
                 retry_deadline: float = RETRY_DEADLINE) -> None:
        self.bucket_name, self.prefix = split_gs_uri(uri)
        self.uri = f"gs://{self.bucket_name}" + (f"/{self.prefix}" if self.prefix else "")
        self.options = options or StorageOptions()
        self.endpoint = self.options.emulator_host or DEFAULT_ENDPOINT
        self.retry: Retry = DEFAULT_RETRY.with_deadline(retry_deadline)
        self.fetch_deadline = self.options.fetch_deadline
        self.read_retry: Retry = DEFAULT_RETRY.with_deadline(self.fetch_deadline)
        self.timeout = (CONNECT_TIMEOUT, READ_TIMEOUT)
        self._local = threading.local()
        self._clients: list[storage.Client] = []
        self._readers: list[AuthorizedHttp] = []
        self._lock = threading.Lock()
        # the readers' connections, whose sockets abort() shuts
        self._connections: weakref.WeakSet[HTTPConnection] = weakref.WeakSet()
        self._aborted = False

    def client(self) -> storage.Client:
        """The calling thread's client."""
        client = getattr(self._local, "client", None)
        if client is None:
            client = self._make_client()
            self._local.client = client
            with self._lock:
                self._clients.append(client)
        return client

    def reader(self) -> AuthorizedHttp:
        """The calling thread's transport for reads: the client's credentials over
        urllib3, with its session's proxy and CA bundle. A GET through it costs less CPU
        than one through the client's requests session, whose per-request work a read
        does not need."""
        http = getattr(self._local, "reader", None)
        if http is None:
            client = self.client()
            http = self._local.reader = AuthorizedHttp(client._credentials,
                                                       http=_pool_for(client._http, self.endpoint,
                                                                     self._made))
            with self._lock:
                self._readers.append(http)
        return http

    def _made(self, connection: HTTPConnection) -> None:
        with self._lock:
            self._connections.add(connection)

    def _make_client(self) -> storage.Client:
        client = self._new_client()
        _read_environment_once(client._http, self.endpoint)
        return client

    def _new_client(self) -> storage.Client:
        opts = self.options
        client_options = {"api_endpoint": opts.emulator_host} if opts.emulator_host else None
        try:
            if opts.credentials_info is not None:
                return storage.Client.from_service_account_info(
                    opts.credentials_info, client_options=client_options)
            if opts.anonymous or opts.emulator_host:
                return storage.Client(project="quiver", credentials=AnonymousCredentials(),
                                      client_options=client_options)
            return storage.Client(client_options=client_options)
        except auth_exc.DefaultCredentialsError:
            raise QuietError(
                f"no Google Cloud credentials for {self.uri}: set GOOGLE_APPLICATION_CREDENTIALS, "
                "pass --credentials FILE, or --anonymous for a public bucket",
                ExitCode.PERMISSION) from None
        except (ValueError, KeyError) as exc:
            raise QuietError(f"invalid service-account credentials: {exc}",
                             ExitCode.PERMISSION) from None

    def _name(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _error(self, exc: Exception, key: str | None) -> QuietError:
        where = self.object_uri(key) if key else self.uri
        if isinstance(exc, gexc.NotFound):
            if key is not None and self._bucket_exists():
                return QuietError(f"object {where} does not exist", ExitCode.NOT_FOUND)
            return QuietError(f"bucket gs://{self.bucket_name} does not exist: check the name",
                              ExitCode.NOT_FOUND)
        if isinstance(exc, (gexc.Forbidden, gexc.Unauthorized)):
            return QuietError(f"access to {where} denied: check the credentials' permissions",
                              ExitCode.PERMISSION)
        if isinstance(exc, QuietError):
            return exc
        return QuietError(f"cannot reach {where} after retries: {type(exc).__name__}: {exc}",
                          ExitCode.BACKEND)

    def _bucket_exists(self) -> bool:
        try:
            return self.client().bucket(self.bucket_name).exists(
                timeout=self.timeout, retry=self.retry)
        except gexc.GoogleAPIError:
            return False

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """As Backend.read, within ``fetch_deadline`` seconds in all, retries included:
        a body that trickles fails as one that does not come."""
        if length == 0:
            return b""
        client = self.client()
        blob = client.bucket(self.bucket_name).blob(self._name(key))
        # The URL the client's own download builds for a blob whose metadata it has not
        # loaded.
        url = f"{client._connection.API_BASE_URL}/download/storage/v1{blob.path}?alt=media"
        headers = {}
        if offset or length is not None:
            end = "" if length is None else str(offset + length - 1)
            headers["Range"] = f"bytes={offset}-{end}"
        until = time.monotonic() + self.fetch_deadline
        try:
            return self.read_retry(self._get)(url, headers, until, self.object_uri(key))
        except (gexc.GoogleAPIError, auth_exc.GoogleAuthError, urllib3.exceptions.HTTPError,
                http.client.HTTPException, OSError) as exc:
            raise self._error(exc, key) from None

    def _get(self, url: str, headers: dict[str, str], until: float, where: str) -> bytes:
        """One GET, its body read whole by ``until`` (time.monotonic()); a status over 299
        raised as the client would. The deadline and an abort are QuietErrors, which the
        retry does not retry."""
        left = until - time.monotonic()
        if self._aborted:
            raise self._stopped(where)
        if left <= 0:
            raise QuietError(f"{where} was not read within {self.fetch_deadline:g} s",
                             ExitCode.BACKEND)
        timeout = urllib3.Timeout(connect=min(CONNECT_TIMEOUT, left),
                                  read=min(READ_TIMEOUT, left))
        response = self.reader().request("GET", url, headers=headers, timeout=timeout,
                                         retries=False, preload_content=False)
        whole = False
        try:
            if self._aborted:  # its socket may have been made after abort() shut them
                raise self._stopped(where)
            if response.status >= 300:
                text = self._body(response, until, where, limit=200)
                raise gexc.from_http_status(response.status, f"GET {url}: "
                                            f"{text.decode(errors='replace')}")
            data = self._body(response, until, where)
            whole = True
            return data
        finally:
            if not whole:
                response.close()  # its connection is not reused mid-body
            response.release_conn()

    def _body(self, response: urllib3.BaseHTTPResponse, until: float, where: str,
              limit: int | None = None) -> bytes:
        """The body of ``response`` (its first ``limit`` bytes), read in pieces so that
        the deadline is looked at after each one that arrives."""
        pieces = []
        got = 0
        while limit is None or got < limit:
            if time.monotonic() >= until:
                raise QuietError(f"{where} was not read within {self.fetch_deadline:g} s "
                                 f"({got} bytes came)", ExitCode.BACKEND)
            piece = response.read1(BODY_PIECE if limit is None else limit - got)
            if not piece:
                break
            if self._aborted:
                raise self._stopped(where)
            pieces.append(piece)
            got += len(piece)
        return b"".join(pieces)

    def stream_into(self, key: str, sink: BinaryIO) -> int:
        blob = self.client().bucket(self.bucket_name).blob(self._name(key),
                                                             chunk_size=STREAM_CHUNK)
        counter = _CountingSink(sink)
        try:
            blob.download_to_file(counter, checksum=None, timeout=self.timeout,
                                  retry=self.retry)
        except (gexc.GoogleAPIError, requests.RequestException, auth_exc.GoogleAuthError) as exc:
            raise self._error(exc, key) from None
        return counter.count

    def list(self) -> Iterator[ObjectInfo]:
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            for blob in self.client().list_blobs(self.bucket_name, prefix=prefix or None,
                                                  timeout=self.timeout, retry=self.retry):
                if blob.name.endswith("/"):
                    continue  # a "directory" placeholder object
                yield ObjectInfo(blob.name[len(prefix):], int(blob.size or 0))
        except (gexc.GoogleAPIError, requests.RequestException, auth_exc.GoogleAuthError) as exc:
            raise self._error(exc, None) from None

    def stat(self, key: str) -> ObjectInfo:
        try:
            blob = self.client().bucket(self.bucket_name).get_blob(
                self._name(key), timeout=self.timeout, retry=self.retry)
        except (gexc.GoogleAPIError, requests.RequestException, auth_exc.GoogleAuthError) as exc:
            raise self._error(exc, key) from None
        if blob is None:
            raise self._error(gexc.NotFound("missing"), key)
        return ObjectInfo(key, int(blob.size or 0))

    @staticmethod
    def _stopped(where: str) -> QuietError:
        return QuietError(f"{where}: reads stopped (the dataset was unmounted, or mountd "
                          "is stopping)", ExitCode.BACKEND)

    def abort(self) -> None:
        """End the reads in flight now, and refuse new ones: their sockets are shut, and
        a thread blocked on one (for the headers or the body) returns at once. Does not
        block. A connect under way is bounded by CONNECT_TIMEOUT only."""
        with self._lock:
            self._aborted = True
            connections = list(self._connections)
        for connection in connections:
            sock = connection.sock  # read once: the thread using it may replace it
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass  # not connected (any more)

    def close(self) -> None:
        self.abort()
        with self._lock:
            for client in self._clients:
                client.close()
            for reader in self._readers:
                reader.http.clear()
            self._clients.clear()
            self._readers.clear()


def check_service_account(info: dict) -> None:
    """Exchange the service-account key ``info`` for an access token once, as the
    storage client will at its first request: QuietError naming the key if its token
    endpoint refuses it (PERMISSION) or cannot be reached (BACKEND)."""
    who = (f"service-account key {info.get('client_email')!r} (key id "
           f"{info.get('private_key_id')!r})")
    try:
        credentials = service_account.Credentials.from_service_account_info(
            info, scopes=storage.Client.SCOPE)
    except (ValueError, KeyError, auth_exc.GoogleAuthError) as exc:
        raise QuietError(f"{who} is not usable ({_one_line(exc)}): give a key file from "
                         "'gcloud iam service-accounts keys create'",
                         ExitCode.PERMISSION) from None
    with requests.Session() as session:
        request = functools.partial(Request(session), timeout=TOKEN_TIMEOUT)
        try:
            credentials.refresh(request)
        except auth_exc.TransportError as exc:
            raise QuietError(f"cannot reach the token endpoint {info.get('token_uri')!r} of "
                             f"{who}: {_one_line(exc)}", ExitCode.BACKEND) from None
        # an endpoint's answer that is not a token's shape fails inside google-auth
        except (auth_exc.GoogleAuthError, ValueError, TypeError, KeyError) as exc:
            raise QuietError(f"{who} was refused by its token endpoint "
                             f"{info.get('token_uri')!r}: {_one_line(exc)}: check that the "
                             "key is enabled and not deleted, or pass another --credentials",
                             ExitCode.PERMISSION) from None


def _one_line(exc: Exception) -> str:
    """An exception's message (google-auth's first argument), on one line, bounded."""
    first = exc.args[0] if exc.args and isinstance(exc.args[0], str) else str(exc)
    text = " ".join(first.split()).rstrip(".") or type(exc).__name__
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS] + "..."


def _read_environment_once(session: requests.Session, url: str) -> None:
    """Give ``session`` what requests would otherwise look up in the environment for
    every request (the proxies for ``url``, a CA bundle), and stop it looking: those
    look-ups scan the whole environment and read ``~/.netrc`` on every request, a
    cost paid once per object. A ``~/.netrc`` is not read: the bucket's credentials
    are the client's."""
    session.proxies.update(requests.utils.get_environ_proxies(url))
    bundle = os.environ.get("REQUESTS_CA_BUNDLE") or os.environ.get("CURL_CA_BUNDLE")
    if bundle:
        session.verify = bundle
    session.trust_env = False


def _pool_for(session: requests.Session, url: str,
              made: Callable[[HTTPConnection], None]) -> urllib3.PoolManager:
    """A one-connection urllib3 pool that reaches ``url`` as ``session`` does (after
    ``_read_environment_once``): through its proxy, checking its CA bundle. Each
    connection it makes is passed to ``made``."""
    verify = session.verify
    ca_certs = verify if isinstance(verify, str) else requests.certs.where()
    proxy = requests.utils.select_proxy(url, session.proxies)
    kwargs = {"maxsize": 1, "ca_certs": ca_certs,
              "cert_reqs": "CERT_REQUIRED" if verify is not False else "CERT_NONE"}
    if proxy:
        return _TrackingProxyManager(made, proxy, **kwargs)
    return _TrackingPoolManager(made, **kwargs)


class _Tracking:
    """A PoolManager whose pools tell ``made`` of each connection they make (urllib3
    keeps a connection in use out of any place another thread could find it)."""

    def __init__(self, made: Callable[[HTTPConnection], None], *args: Any,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._made_callback = made

    def _new_pool(self, *args: Any, **kwargs: Any) -> HTTPConnectionPool:
        pool = super()._new_pool(*args, **kwargs)  # type: ignore[misc]
        make = pool.ConnectionCls
        made = self._made_callback

        def connection(*args: Any, **kwargs: Any) -> HTTPConnection:
            made(conn := make(*args, **kwargs))
            return conn

        pool.ConnectionCls = connection
        return pool


class _TrackingPoolManager(_Tracking, urllib3.PoolManager):
    pass


class _TrackingProxyManager(_Tracking, urllib3.ProxyManager):
    pass


class _CountingSink:
    """A write-only file object that counts bytes on their way to another sink."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink = sink
        self.count = 0

    def write(self, data: bytes) -> int:
        self.sink.write(data)
        self.count += len(data)
        return len(data)

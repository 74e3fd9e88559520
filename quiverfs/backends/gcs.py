"""``gs://bucket/prefix`` backend over the official google-cloud-storage client."""
from __future__ import annotations

import functools
import http.client
import logging
import os
import threading
from collections.abc import Iterator
from typing import BinaryIO

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

from quiverfs.backends.base import Backend, ObjectInfo, StorageOptions, check_key
from quiverfs.errors import ExitCode, QuietError
from quiverfs.gcs_endpoint import DEFAULT_ENDPOINT

log = logging.getLogger(__name__)

# Seconds: connect and read timeouts of one HTTP request, and the whole retry budget.
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0
RETRY_DEADLINE = 120.0
TOKEN_TIMEOUT = 10.0  # seconds: one request to a service-account key's token endpoint
STREAM_CHUNK = 8 << 20
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
    (``reader``)."""

    def __init__(self, uri: str, options: StorageOptions | None = None,
                 retry_deadline: float = RETRY_DEADLINE) -> None:
        self.bucket_name, self.prefix = split_gs_uri(uri)
        self.uri = f"gs://{self.bucket_name}" + (f"/{self.prefix}" if self.prefix else "")
        self.options = options or StorageOptions()
        self.endpoint = self.options.emulator_host or DEFAULT_ENDPOINT
        self.retry: Retry = DEFAULT_RETRY.with_deadline(retry_deadline)
        self.timeout = (CONNECT_TIMEOUT, READ_TIMEOUT)
        self.urllib3_timeout = urllib3.Timeout(connect=CONNECT_TIMEOUT, read=READ_TIMEOUT)
        self._local = threading.local()
        self._clients: list[storage.Client] = []
        self._readers: list[AuthorizedHttp] = []
        self._lock = threading.Lock()

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
                                                       http=_pool_for(client._http, self.endpoint))
            with self._lock:
                self._readers.append(http)
        return http

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
        try:
            return self.retry(self._get)(url, headers)
        except (gexc.GoogleAPIError, auth_exc.GoogleAuthError, urllib3.exceptions.HTTPError,
                http.client.HTTPException, OSError) as exc:
            raise self._error(exc, key) from None

    def _get(self, url: str, headers: dict[str, str]) -> bytes:
        """One GET, its body read whole; a status over 299 raised as the client would."""
        response = self.reader().request("GET", url, headers=headers,
                                         timeout=self.urllib3_timeout, retries=False)
        if response.status >= 300:
            raise gexc.from_http_status(response.status, f"GET {url}: "
                                        f"{response.data[:200].decode(errors='replace')}")
        return response.data

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

    def close(self) -> None:
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


def _pool_for(session: requests.Session, url: str) -> urllib3.PoolManager:
    """A one-connection urllib3 pool that reaches ``url`` as ``session`` does (after
    ``_read_environment_once``): through its proxy, checking its CA bundle."""
    verify = session.verify
    ca_certs = verify if isinstance(verify, str) else requests.certs.where()
    proxy = requests.utils.select_proxy(url, session.proxies)
    kwargs = {"maxsize": 1, "ca_certs": ca_certs,
              "cert_reqs": "CERT_REQUIRED" if verify is not False else "CERT_NONE"}
    return urllib3.ProxyManager(proxy, **kwargs) if proxy else urllib3.PoolManager(**kwargs)


class _CountingSink:
    """A write-only file object that counts bytes on their way to another sink."""

    def __init__(self, sink: BinaryIO) -> None:
        self.sink = sink
        self.count = 0

    def write(self, data: bytes) -> int:
        self.sink.write(data)
        self.count += len(data)
        return len(data)

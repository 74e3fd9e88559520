"""A record of the HTTP/1.1 requests that pass through a proxy (``ThrottleProxy``): for
tests that must see what a client sent, such as the ``Authorization`` header a bucket's
reads carry, without touching the client or the server."""
from __future__ import annotations

import dataclasses
import threading

MAX_HEAD = 64 << 10  # bytes of a request line and its headers, at most


@dataclasses.dataclass(frozen=True)
class Request:
    """One request as it went upstream: its method, target and headers (names lower-case)."""

    method: str
    target: str
    headers: dict[str, str]


class RequestLog:
    """The requests of every connection fed to it, in the order they were complete."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._requests: list[Request] = []

    def requests(self) -> list[Request]:
        with self._lock:
            return list(self._requests)

    def parser(self) -> RequestParser:
        """A parser for one connection's bytes from client to server."""
        return RequestParser(self)

    def add(self, request: Request) -> None:
        with self._lock:
            self._requests.append(request)


class RequestParser:
    """Splits one connection's upstream bytes into requests: a head, then a body of its
    Content-Length. A head it cannot parse (or a chunked body) ends its parsing, so that
    a test sees fewer requests rather than wrong ones."""

    def __init__(self, log: RequestLog) -> None:
        self.log = log
        self._buffer = b""
        self._body_left = 0
        self._lost = False

    def feed(self, data: bytes) -> None:
        if self._lost:
            return
        self._buffer += data
        while True:
            if self._body_left:
                taken = min(self._body_left, len(self._buffer))
                self._buffer = self._buffer[taken:]
                self._body_left -= taken
                if self._body_left:
                    return
            end = self._buffer.find(b"\r\n\r\n")
            if end < 0:
                self._lost = len(self._buffer) > MAX_HEAD
                return
            head, self._buffer = self._buffer[:end], self._buffer[end + 4:]
            request = _parse_head(head)
            if request is None or "chunked" in request.headers.get("transfer-encoding", ""):
                self._lost = True
                return
            self.log.add(request)
            self._body_left = int(request.headers.get("content-length", "0") or 0)


def _parse_head(head: bytes) -> Request | None:
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep:
            return None
        headers[name.strip().lower()] = value.strip()
    try:
        int(headers.get("content-length", "0") or 0)
    except ValueError:
        return None
    return Request(parts[0], parts[1], headers)

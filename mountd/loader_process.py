"""A loader process: fetches items of chunk loads from a GCS bucket, checks their
SHA-256 and stores them into mountd's store directory, off mountd's serving loop.

mountd (``mountd.loader_pool``) starts it (``main``) and talks to it over its stdin
and stdout: length-prefixed pickles of ``LoadRequest`` in, ``LoadReply`` out, in any
order. Several requests are in flight at once (one thread each: a bucket's time to
first byte is tens of milliseconds), and one thread writes the store
(``StoreWriter``), letting go of the index whenever it is idle. Content that does not
hash to its digest is never stored. The process ends when its stdin does.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import enum
import json
import logging
import os
import pickle
import queue
import signal
import struct
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, BinaryIO

from mountd.content_store import (IndexDamaged, IntegrityError, StoreError, StoreWriter,
                                  ValueFile)
from quiverfs.backends import StorageOptions
from quiverfs.errors import QuietError

if TYPE_CHECKING:
    from quiverfs.backends.gcs import GCSBackend

log = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("!Q")  # the length of the pickle that follows
IDLE_RELEASE = 0.5  # seconds without a put after which the writer lets go of the index
# Chunk loads are work ahead of need; mountd's serving loop, on the same cores, is what a
# reader waits for. At this niceness a busy loader gets about a tenth of the time of a
# busy task at niceness 0 on the same core: mountd and the jobs come first.
NICENESS = 10


@dataclasses.dataclass(frozen=True)
class LoadSource:
    """Where a loader process reads a dataset from: a gs:// root and how to reach it
    (without the registering user, whom only file:// datasets need)."""

    uri: str
    credentials_json: str | None  # a service-account key, as JSON (hashable)
    emulator_host: str | None
    anonymous: bool

    @classmethod
    def of(cls, uri: str, options: StorageOptions) -> LoadSource:
        info = options.credentials_info
        return cls(uri, None if info is None else json.dumps(info, sort_keys=True),
                   options.emulator_host, options.anonymous)

    def options(self) -> StorageOptions:
        info = None if self.credentials_json is None else json.loads(self.credentials_json)
        return StorageOptions(credentials_info=info, emulator_host=self.emulator_host,
                              anonymous=self.anonymous)


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """Fetch ``length`` bytes of ``key`` from ``offset``; store them if they hash to
    ``digest``."""

    id: int
    source: LoadSource
    key: str
    offset: int
    length: int
    digest: bytes


class Outcome(enum.Enum):
    STORED = "stored"  # fetched, checked and stored
    UNSTORED = "unstored"  # fetched and checked, but the store could not take it
    DAMAGED = "damaged"  # the same, because the store's index is damaged
    MISMATCH = "mismatch"  # fetched, but not the digest's content: not stored
    FAILED = "failed"  # the bucket read failed


@dataclasses.dataclass(frozen=True)
class LoadReply:
    """What became of request ``id``: ``data`` comes back only when it was not stored;
    ``reason`` says why it failed or was not stored; ``file`` is where it was stored."""

    id: int
    outcome: Outcome
    nbytes: int = 0
    data: bytes | None = None
    reason: str = ""
    file: ValueFile | None = None


def write_frame(out: BinaryIO, message: Any) -> None:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(FRAME_HEADER.pack(len(body)) + body)
    out.flush()


def read_frame(inp: BinaryIO) -> Any | None:
    """The next message, or None at the end of the stream."""
    header = inp.read(FRAME_HEADER.size)
    if len(header) < FRAME_HEADER.size:
        return None
    (size,) = FRAME_HEADER.unpack(header)
    body = inp.read(size)
    if len(body) < size:
        return None
    return pickle.loads(body)


class Loader:
    """Serves requests from ``inp`` with ``threads`` fetches in flight; replies to ``out``."""

    def __init__(self, writer: StoreWriter, threads: int, out: BinaryIO) -> None:
        self.writer = writer
        self.threads = threads
        self.out = out
        self._out_lock = threading.Lock()
        self._puts: queue.Queue[tuple[LoadRequest, bytes] | None] = queue.Queue()
        self._backends: dict[LoadSource, GCSBackend] = {}
        self._backends_lock = threading.Lock()

    def serve(self, inp: BinaryIO) -> None:
        writing = threading.Thread(target=self._write_loop, name="store writer")
        writing.start()
        try:
            with concurrent.futures.ThreadPoolExecutor(self.threads,
                                                       thread_name_prefix="fetch") as pool:
                while (request := read_frame(inp)) is not None:
                    pool.submit(self._answered, self._fetch, request)
                pool.shutdown(cancel_futures=True)  # mountd is unmounting: finish what runs
        finally:
            self._puts.put(None)
            writing.join()
            for backend in self._backends.values():
                backend.close()

    def _reply(self, reply: LoadReply) -> None:
        with self._out_lock:
            try:
                write_frame(self.out, reply)
            except BrokenPipeError:
                log.debug("mountd has gone: request %d stays unanswered", reply.id)

    def _backend(self, source: LoadSource) -> GCSBackend:
        # Imported here: mountd imports this module for its messages, and the GCS
        # client is slow to import.
        from quiverfs.backends.gcs import GCSBackend

        with self._backends_lock:
            backend = self._backends.get(source)
            if backend is None:
                backend = self._backends[source] = GCSBackend(source.uri, source.options())
            return backend

    def _answered(self, step: Callable[[LoadRequest], None], request: LoadRequest) -> None:
        """Run ``step``; if it fails unexpectedly, the request still gets its answer
        (else mountd would wait for it forever)."""
        try:
            step(request)
        except Exception as exc:  # noqa: BLE001 - one request's failure ends it only
            log.exception("%s: the load failed", request.key)
            self._reply(LoadReply(request.id, Outcome.FAILED, reason=f"loader process: {exc}"))

    def _fetch(self, request: LoadRequest) -> None:
        try:
            data = self._backend(request.source).read(request.key, request.offset,
                                                      request.length)
        except (QuietError, OSError) as exc:
            message = exc.message if isinstance(exc, QuietError) else exc.strerror or str(exc)
            self._reply(LoadReply(request.id, Outcome.FAILED, reason=message))
            return
        self._puts.put((request, data))

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._puts.get(timeout=IDLE_RELEASE)
            except queue.Empty:
                self.writer.release()  # mountd may want to rebuild the index
                continue
            if item is None:
                self.writer.release()
                return
            request, data = item
            self._answered(lambda r: self._reply(self._put(r, data)), request)

    def _put(self, request: LoadRequest, data: bytes) -> LoadReply:
        try:
            file = self.writer.put(request.digest, data)
        except IntegrityError:
            return LoadReply(request.id, Outcome.MISMATCH, len(data))
        except IndexDamaged as exc:
            return LoadReply(request.id, Outcome.DAMAGED, len(data), data, str(exc))
        except StoreError as exc:
            return LoadReply(request.id, Outcome.UNSTORED, len(data), data, str(exc))
        return LoadReply(request.id, Outcome.STORED, len(data), file=file)


def main() -> None:
    p = argparse.ArgumentParser(prog="mountd.loader_process",
                                description="a mountd loader process (started by mountd)")
    p.add_argument("store", help="the store directory")
    p.add_argument("size_limit", type=int, help="the store's bound in bytes")
    p.add_argument("threads", type=int, help="fetches in flight")
    p.add_argument("log_level", type=int, help="logging level of mountd")
    args = p.parse_args()
    os.nice(NICENESS)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s "
                        f"%(name)s[loader {os.getpid()}]: %(message)s")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # mountd ends it, by closing its stdin
    # Replies go to the original stdout; anything printed goes to the log instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    writer = StoreWriter(args.store, args.size_limit)
    Loader(writer, args.threads, out).serve(sys.stdin.buffer)

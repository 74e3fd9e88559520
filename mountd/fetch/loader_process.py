"""A loader process: fetches items from a GCS bucket, checks their SHA-256 and stores
them into mountd's store directory, off mountd's serving loop.

mountd (``mountd.fetch.loader_pool``) starts it (``main``) and talks to it over its
stdin and stdout: length-prefixed pickles of ``LoadRequest`` (or ``Drop``: a dataset was
unmounted) in, ``LoadReply`` out, in any order. Several requests are in flight at once
(one thread each: a bucket's time to first byte is tens of milliseconds); each thread
hashes what it fetched, and one thread writes the store (``StoreWriter``), as many
queued items as there are in one transaction, letting go of the index whenever it is
idle. A request for a reader waiting on a miss (``serve``) is answered with the checked
bytes first, and with what the store made of them after. Content that does not hash to
its digest is never stored or sent. Once it has imported the GCS client and can take
requests it says so (``Ready``); it ends when its stdin does (mountd unmounts, or has
died), giving up the fetches under way.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import enum
import hashlib
import json
import logging
import os
import pickle
import queue
import signal
import struct
import sys
import threading
from typing import TYPE_CHECKING, Any, BinaryIO

from mountd.store.errors import IndexDamaged, StoreError
from mountd.store.value_files import ValueFile
from mountd.store.writer import StoreWriter
from quiverfs.backends import StorageOptions
from quiverfs.errors import QuietError

if TYPE_CHECKING:
    from quiverfs.backends.gcs import GCSBackend

log = logging.getLogger(__name__)

FRAME_HEADER = struct.Struct("!Q")  # the length of the pickle that follows
IDLE_RELEASE = 0.5  # seconds without a put after which the writer lets go of the index
MAX_BATCH = 64  # items the writer stores in one transaction at most
# Bytes of checked items waiting for the writer at once: beyond, an item is not stored
# (mountd frees a miss's slot once its bytes are served, so a writer that hangs on the
# index's lock would otherwise gather every miss meanwhile).
MAX_QUEUED_BYTES = 64 << 20


@dataclasses.dataclass(frozen=True)
class LoadSource:
    """Where a loader process reads a dataset from: a gs:// root and how to reach it
    (without the registering user, whom only file:// datasets need)."""

    uri: str
    credentials_json: str | None  # a service-account key, as JSON (hashable)
    emulator_host: str | None
    anonymous: bool
    fetch_deadline: float  # seconds a read may take, retries included (mountd's setting)

    @classmethod
    def of(cls, uri: str, options: StorageOptions) -> LoadSource:
        info = options.credentials_info
        return cls(uri, None if info is None else json.dumps(info, sort_keys=True),
                   options.emulator_host, options.anonymous, options.fetch_deadline)

    def options(self) -> StorageOptions:
        info = None if self.credentials_json is None else json.loads(self.credentials_json)
        return StorageOptions(credentials_info=info, emulator_host=self.emulator_host,
                              anonymous=self.anonymous, fetch_deadline=self.fetch_deadline)


@dataclasses.dataclass(frozen=True)
class LoadRequest:
    """Fetch ``length`` bytes of ``key`` from ``offset``; if they hash to ``digest``,
    send them back first where ``serve``, and store them where ``store``."""

    id: int
    source: LoadSource
    key: str
    offset: int
    length: int
    digest: bytes
    serve: bool = False
    store: bool = True


@dataclasses.dataclass(frozen=True)
class Drop:
    """Stop reading ``source`` (its last dataset was unmounted): the requests for it
    sent before this message fail, at once where their fetch is under way."""

    source: LoadSource


class Outcome(enum.Enum):
    FETCHED = "fetched"  # fetched and checked: the bytes, for a ``serve`` request
    STORED = "stored"  # fetched, checked and stored
    UNSTORED = "unstored"  # fetched and checked, but the store could not take it
    DAMAGED = "damaged"  # the same, because the store's index is damaged
    MISMATCH = "mismatch"  # fetched, but not the digest's content: not stored
    FAILED = "failed"  # the bucket read failed


@dataclasses.dataclass(frozen=True)
class LoadReply:
    """What became of request ``id``: ``data`` comes back with FETCHED, and when a
    request that was not served could not be stored; ``reason`` says why it failed or
    was not stored; ``file`` is where it was stored. Each request has one ``final``
    reply; a served request that is stored has a FETCHED one before it."""

    id: int
    outcome: Outcome
    nbytes: int = 0
    data: bytes | None = None
    reason: str = ""
    file: ValueFile | None = None
    final: bool = True


@dataclasses.dataclass(frozen=True)
class Culled:
    """Entries a put of this process's evicted to make room (its transaction committed),
    sent after that put's replies."""

    digests: tuple[bytes, ...]


@dataclasses.dataclass(frozen=True)
class Ready:
    """The process's first message: the GCS client is imported and requests are taken."""

    pid: int


def _stored_reply(request: LoadRequest, data: bytes,
                  outcome: ValueFile | None | StoreError) -> LoadReply:
    """The final reply to a request whose checked bytes the store took (``outcome``:
    their value file, or None if kept in the index) or did not (the error). The bytes
    go back only to a request that was not served them already."""
    if not isinstance(outcome, StoreError):
        return LoadReply(request.id, Outcome.STORED, len(data), file=outcome)
    kind = Outcome.DAMAGED if isinstance(outcome, IndexDamaged) else Outcome.UNSTORED
    return LoadReply(request.id, kind, len(data), None if request.serve else data,
                     str(outcome))


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
        self._queued_bytes = 0  # of the items in ``_puts``
        self._queued_lock = threading.Lock()
        self._backends: dict[LoadSource, GCSBackend] = {}
        self._dropped: dict[LoadSource, int] = {}  # the last request id each Drop ends
        self._backends_lock = threading.Lock()

    def serve(self, inp: BinaryIO) -> None:
        writing = threading.Thread(target=self._write_loop, name="store writer")
        writing.start()
        last_id = -1
        try:
            with concurrent.futures.ThreadPoolExecutor(self.threads,
                                                       thread_name_prefix="fetch") as pool:
                while (message := read_frame(inp)) is not None:
                    if isinstance(message, Drop):
                        self._drop(message.source, last_id)
                    else:
                        last_id = message.id
                        pool.submit(self._answered, message)
                # mountd is unmounting, or has died: nobody waits for a fetch under way,
                # and one from a stalled bucket would keep this process alive
                with self._backends_lock:
                    for backend in self._backends.values():
                        backend.abort()
                pool.shutdown(cancel_futures=True)
        finally:
            self._puts.put(None)
            writing.join()
            for backend in self._backends.values():
                backend.close()

    def _reply(self, reply: LoadReply | Culled) -> None:
        with self._out_lock:
            try:
                write_frame(self.out, reply)
            except BrokenPipeError:
                log.debug("mountd has gone: %s stays unsaid", reply)

    def _drop(self, source: LoadSource, last_id: int) -> None:
        """End the requests for ``source`` up to ``last_id``: those under way fail as
        their backend closes, those not started fail in ``_backend``."""
        with self._backends_lock:
            self._dropped[source] = last_id
            backend = self._backends.pop(source, None)
        if backend is not None:
            backend.close()

    def _backend(self, request: LoadRequest) -> GCSBackend:
        """The backend ``request`` reads; QuietError if its source was dropped since."""
        from quiverfs.backends.gcs import GCSBackend  # imported by main() already

        source = request.source
        with self._backends_lock:
            if request.id <= self._dropped.get(source, -1):
                raise QuietError(f"{source.uri}: not read: its dataset was unmounted")
            backend = self._backends.get(source)
            if backend is None:
                backend = self._backends[source] = GCSBackend(source.uri, source.options())
            return backend

    def _answered(self, request: LoadRequest) -> None:
        """Fetch for ``request``; if that fails unexpectedly, the request still gets its
        answer (else mountd would wait for it forever)."""
        try:
            self._fetch(request)
        except Exception as exc:  # noqa: BLE001 - one request's failure ends it only
            log.exception("%s: the load failed", request.key)
            self._reply(LoadReply(request.id, Outcome.FAILED, reason=f"loader process: {exc}"))

    def _fetch(self, request: LoadRequest) -> None:
        try:
            data = self._backend(request).read(request.key, request.offset, request.length)
        except (QuietError, OSError) as exc:
            message = exc.message if isinstance(exc, QuietError) else exc.strerror or str(exc)
            self._reply(LoadReply(request.id, Outcome.FAILED, reason=message))
            return
        if hashlib.sha256(data).digest() != request.digest:  # hashed where the bytes are
            self._reply(LoadReply(request.id, Outcome.MISMATCH, len(data)))
            return
        if request.serve:
            self._reply(LoadReply(request.id, Outcome.FETCHED, len(data), data,
                                  final=not request.store))
        if request.store:
            with self._queued_lock:
                queued = self._queued_bytes + len(data) <= MAX_QUEUED_BYTES
                if queued:
                    self._queued_bytes += len(data)
            if queued:
                self._puts.put((request, data))
            else:
                self._reply(_stored_reply(request, data, StoreError(
                    "the store's writer is behind (the index's lock held)")))

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._puts.get(timeout=IDLE_RELEASE)
            except queue.Empty:
                self.writer.release()  # mountd may want to rebuild the index
                continue
            batch = [item]
            while item is not None and len(batch) < MAX_BATCH:
                try:
                    batch.append(item := self._puts.get_nowait())
                except queue.Empty:
                    break
            written = [i for i in batch if i is not None]
            if written:
                self._write(written)
            if item is None:
                self.writer.release()
                return

    def _write(self, batch: list[tuple[LoadRequest, bytes]]) -> None:
        """Store checked items in one transaction; reply to each."""
        try:
            outcomes = self.writer.put_many([(r.digest, data) for r, data in batch])
        except Exception as exc:  # noqa: BLE001 - the batch's requests still get answers
            log.exception("the store writer failed")
            outcomes = [StoreError(f"loader process: {exc}")] * len(batch)
        with self._queued_lock:
            self._queued_bytes -= sum(len(data) for _, data in batch)
        for (request, data), outcome in zip(batch, outcomes):
            self._reply(_stored_reply(request, data, outcome))
        culled = self.writer.take_culled()
        if culled:
            self._reply(Culled(tuple(culled)))


def main() -> None:
    p = argparse.ArgumentParser(prog="mountd.fetch.loader_process",
                                description="a mountd loader process (started by mountd)")
    p.add_argument("store", help="the store directory")
    p.add_argument("size_limit", type=int, help="the store's bound in bytes")
    p.add_argument("threads", type=int, help="fetches in flight")
    p.add_argument("log_level", type=int, help="logging level of mountd")
    p.add_argument("niceness", type=int, help="added to the process's niceness")
    args = p.parse_args()
    os.nice(args.niceness)
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s %(levelname)s "
                        f"%(name)s[loader {os.getpid()}]: %(message)s")
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)  # mountd ends it, by closing its stdin
    # Replies go to the original stdout; anything printed goes to the log instead.
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    # Imported here, before any request: mountd imports this module for its messages,
    # and the GCS client takes most of a CPU-second to import.
    import quiverfs.backends.gcs  # noqa: F401

    writer = StoreWriter(args.store, args.size_limit)
    write_frame(out, Ready(os.getpid()))
    Loader(writer, args.threads, out).serve(sys.stdin.buffer)

"""mountd's loader processes (``mountd.fetch.loader_process``): the bucket GET, SHA-256 check
and store insert of items from GCS buckets, off the serving loop and across cores.

mountd keeps two pools of them: one for the misses readers wait on (``fetch``: the
checked bytes come back first, the store's outcome after), at the jobs' priority, and
one for chunk loads (``load``), work ahead of need, at a lower one (AHEAD_NICENESS).

The processes start when they are first wanted (``want``: a dataset in a GCS bucket is
mounted; or a first request) and run until unmount, when their stdin is closed and they
give up what they hold; a dataset's unmount has them drop its source (``drop``), and
mountd's stop ends the requests waiting on them (``stop_requests``). One that exits is
started again after RESTART_DELAY; the requests it had in flight end with
LoaderUnavailable, and their callers fetch those items in mountd instead. The processes
write into this node's store directory; what they stored, and what they could not, is
recorded in the store here (``ContentStore.stored_elsewhere``,
``write_failed_elsewhere``), as is what their puts evicted (``ContentStore.culled``).

A pool's slots (requests in flight) are shared fairly by the uids whose datasets the
items are of (``mountd.fetch.fair_share``): a uid whose fetches stall holds at most its
share, and the others' requests go on in the rest.
"""
from __future__ import annotations

import dataclasses
import fcntl
import itertools
import logging
import pickle
import subprocess
import sys

from collections.abc import Callable

import trio

from mountd.fetch.fair_share import FairSlots
from mountd.fetch.loader_process import (FRAME_HEADER, Culled, Drop, LoadReply, LoadRequest,
                                         LoadSource, Outcome, Ready)
from mountd.store.content_store import ContentStore
from quiverfs.backends import Backend

log = logging.getLogger(__name__)

THREADS_PER_PROCESS = 16  # requests in flight per process: ~30 ms to first byte each
# Chunk loads are work ahead of need; mountd's serving loop, on the same cores, is what a
# reader waits for. At this niceness a busy loader gets about a tenth of the time of a
# busy task at niceness 0 on the same core: mountd and the jobs come first.
AHEAD_NICENESS = 10
# The misses a cold epoch's readers wait on keep a process's interpreter busy (the
# storage client's CPU per object), so one process is a one-core bottleneck for cold
# reads: at least two, which use two cores even on a 2-core machine.
MIN_SERVING_PROCESSES = 2
RESTART_DELAY = 1.0  # seconds before a process that exited is started again
START_TIMEOUT = 30.0  # seconds a load waits for a process to (re)start
SEND_TIMEOUT = 30.0  # seconds a request may take to enter a process's stdin
STOP_TIMEOUT = 10.0  # seconds a process may take to finish at unmount before it is killed
READ_SIZE = 1 << 20  # bytes read from a process's stdout at once
PIPE_SIZE = 1 << 20  # bytes a process's stdout holds (Linux's default fs.pipe-max-size)
# Not ``-m mountd.fetch.loader_process``: its messages would be pickled as __main__'s classes.
LOADER_MAIN = "from mountd.fetch.loader_process import main; main()"


class LoaderUnavailable(Exception):
    """No loader process took the request, or its process exited before answering:
    the item is still to be fetched."""


class LoadFailed(Exception):
    """The loader process could not read the item from its bucket."""


class LoadMismatch(Exception):
    """The bucket's bytes do not hash to the item's digest; they were not stored."""


def load_source(backend: Backend) -> LoadSource | None:
    """How a loader process reaches ``backend``; None unless it is a GCS bucket
    (``file://`` datasets are read as their registering user, in mountd)."""
    if not backend.uri.startswith("gs://"):
        return None
    from quiverfs.backends.gcs import GCSBackend  # imported already, for this backend

    if not isinstance(backend, GCSBackend):
        return None
    return LoadSource.of(backend.uri, backend.options)


class _Process:
    """One running loader process and the requests it has not answered in full: each
    one's channel of replies (up to two: the bytes, then the store's outcome) and the
    digest it asked for. What the process stored, and what it evicted to make room, is
    recorded in ``store`` in the order the process said it."""

    def __init__(self, proc: trio.Process, store: ContentStore) -> None:
        self.proc = proc
        self.store = store
        self.pending: dict[int, tuple[trio.MemorySendChannel[LoadReply], bytes]] = {}
        self.send_lock = trio.Lock()
        self.ready = False  # it said Ready: its imports are done

    async def receive(self) -> None:
        """Hand each reply to its request until the process's stdout ends."""
        buffer = bytearray()
        while chunk := await self.proc.stdout.receive_some(READ_SIZE):
            buffer += chunk
            start = 0
            while len(buffer) - start >= FRAME_HEADER.size:
                (size,) = FRAME_HEADER.unpack_from(buffer, start)
                end = start + FRAME_HEADER.size + size
                if len(buffer) < end:
                    break
                with memoryview(buffer) as view:
                    reply: LoadReply | Culled | Ready = pickle.loads(
                        view[start + FRAME_HEADER.size:end])
                start = end
                if isinstance(reply, Ready):
                    self.ready = True
                elif isinstance(reply, Culled):
                    self.store.culled(reply.digests)
                else:
                    self._deliver(reply)
            del buffer[:start]

    def _deliver(self, reply: LoadReply) -> None:
        entry = self.pending.get(reply.id)
        if entry is None:
            return  # abandoned
        replies, digest = entry
        if reply.outcome is Outcome.STORED:  # before a later reply's Culled may drop it
            self.store.stored_elsewhere(digest, reply.file)
        try:
            replies.send_nowait(reply)
        except trio.BrokenResourceError:
            reply = dataclasses.replace(reply, final=True)  # nobody listens any more
        if reply.final:
            del self.pending[reply.id]
            replies.close()

    def abandon(self) -> None:
        """End the requests still waiting (with no reply: LoaderUnavailable)."""
        for replies, _ in self.pending.values():
            replies.close()
        self.pending.clear()


class LoaderPool:
    """``processes`` loader processes at ``niceness`` writing into ``store``, each with
    ``threads`` requests in flight; ``load`` and ``fetch`` send them one item at a
    time."""

    def __init__(self, processes: int, store: ContentStore, limiter: trio.CapacityLimiter,
                 threads: int = THREADS_PER_PROCESS, niceness: int = 0) -> None:
        self.processes = processes
        self.store = store
        self.limiter = limiter
        self.threads = threads
        self.niceness = niceness
        self._live: list[_Process | None] = [None] * processes
        self._slots = FairSlots(processes * threads)
        self._wanted = trio.Event()
        self._started = trio.Event()  # set (and replaced) whenever a process starts
        self._ids = itertools.count()
        self._nursery: trio.Nursery | None = None  # where stores' outcomes are awaited
        self._stopping = False  # mountd is stopping: no request waits on a process

    def want(self) -> None:
        """Start the processes now, if they are not running: each takes most of a
        CPU-second to start, better spent before the first miss than during it."""
        self._wanted.set()

    def status(self) -> dict[str, int]:
        """The processes it keeps, those running, and those ready for requests; the
        requests they hold at once, those in flight, and those waiting for a slot."""
        live = [p for p in self._live if p is not None]
        slots = self._slots.status()
        return {"processes": self.processes, "running": len(live),
                "ready": sum(p.ready for p in live), "threads": self.threads,
                "niceness": self.niceness, "slots": slots["slots"],
                "in_flight": slots["held"], "waiting": slots["waiting"]}

    @property
    def capacity(self) -> int:
        """Requests the processes hold at once."""
        return self.processes * self.threads

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the processes running from the first request on; at cancellation, end
        them."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._wanted.wait()
            for slot in range(self.processes):
                nursery.start_soon(self._keep_running, slot, name=f"loader process {slot}")

    async def _keep_running(self, slot: int) -> None:
        while True:
            try:
                process = _Process(await trio.lowlevel.open_process(
                    [sys.executable, "-c", LOADER_MAIN, self.store.directory,
                     str(self.store.size_limit), str(self.threads),
                     str(logging.getLogger().getEffectiveLevel()), str(self.niceness)],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE), self.store)
                _widen(process.proc.stdout)
            except OSError as exc:
                log.error("cannot start a loader process: %s: its fetches run in mountd",
                          exc.strerror or exc)
                await trio.sleep(RESTART_DELAY)
                continue
            log.debug("loader process %d started", process.proc.pid)
            self._live[slot] = process
            self._started.set()
            self._started = trio.Event()
            try:
                await process.receive()
            except Exception:  # noqa: BLE001 - garbled replies end the process, not mountd
                log.exception("loader process %d: unreadable reply: ending it",
                              process.proc.pid)
                process.proc.kill()
            finally:
                self._live[slot] = None
                process.abandon()
                with trio.CancelScope(shield=True):
                    status = await _end(process.proc)
            log.warning("loader process %d exited (status %s): starting another",
                        process.proc.pid, status)
            await trio.sleep(RESTART_DELAY)

    async def load(self, uid: int, source: LoadSource, key: str, offset: int, length: int,
                   digest: bytes) -> int | bytes:
        """Fetch an item of ``uid``'s dataset, check and store it in a loader process:
        the number of bytes it stored, or the bytes when the store could not take them.
        Raises LoadMismatch, LoadFailed, or LoaderUnavailable (the item is still to be
        fetched)."""
        self._wanted.set()
        async with self._slots.hold(uid):
            replies = await self._ask(LoadRequest(next(self._ids), source, key, offset,
                                                  length, digest))
            with replies:
                reply = _checked(await _next(replies))
        if reply.outcome is Outcome.STORED:  # recorded in the store as it came
            return reply.nbytes
        await self._write_failed(reply)
        assert reply.data is not None  # an unstored reply to a request not served
        return reply.data

    async def fetch(self, uid: int, source: LoadSource, key: str, offset: int, length: int,
                    digest: bytes, store: bool, stored: Callable[[], None]
                    ) -> tuple[bytes, bool]:
        """Fetch and check an item of ``uid``'s dataset in a loader process for a reader
        waiting on it: its bytes as soon as they are checked, and whether the store's
        outcome is still to come. With ``store`` the process then stores them; where the
        outcome is to come, ``stored()`` is called once it is known here (or the process
        has gone). The outcome is awaited without a slot: a store write that hangs holds
        no fetch. Raises LoadMismatch, LoadFailed, or LoaderUnavailable (the item is still to be
        fetched)."""
        self._wanted.set()
        pending = False
        async with self._slots.hold(uid):
            replies = await self._ask(LoadRequest(next(self._ids), source, key, offset,
                                                  length, digest, serve=True, store=store))
            with replies:
                reply = _checked(await _next(replies))
                if not reply.final and self._nursery is not None:
                    self._nursery.start_soon(self._outcome, replies.clone(), stored)
                    pending = True
        assert reply.data is not None  # FETCHED
        return reply.data, pending

    async def _outcome(self, replies: trio.MemoryReceiveChannel[LoadReply],
                       stored: Callable[[], None]) -> None:
        """Record what the store made of a served item; then ``stored()``."""
        try:
            with replies:
                reply = await replies.receive()
            if reply.outcome in (Outcome.UNSTORED, Outcome.DAMAGED):
                await self._write_failed(reply)
        except trio.EndOfChannel:
            pass  # the process exited: the item may not be stored, a read looks again
        finally:
            stored()

    async def _write_failed(self, reply: LoadReply) -> None:
        await trio.to_thread.run_sync(self.store.write_failed_elsewhere, reply.reason,
                                      reply.outcome is Outcome.DAMAGED, limiter=self.limiter)

    def stop_requests(self) -> None:
        """mountd is stopping: end the requests waiting on the processes, and those sent
        from now on, with LoaderUnavailable (a FUSE request waiting on a stalled fetch
        would hold the unmount). The processes themselves end with the pool's run."""
        self._stopping = True
        for process in self._live:
            if process is not None:
                process.abandon()

    async def drop(self, source: LoadSource) -> None:
        """Tell every running process to stop reading ``source`` (no dataset mounted
        reads it any more): the requests for it fail, those under way at once."""
        for process in [p for p in self._live if p is not None]:
            try:
                await self._send(process, Drop(source))
            except LoaderUnavailable as exc:
                log.debug("%s: its requests end with it", exc)

    async def _ask(self, request: LoadRequest) -> trio.MemoryReceiveChannel[LoadReply]:
        """Send ``request`` to a process; the channel its replies come on."""
        if self._stopping:
            raise LoaderUnavailable("mountd is stopping")
        process = await self._a_process()
        send, receive = trio.open_memory_channel[LoadReply](2)
        process.pending[request.id] = (send, request.digest)
        try:
            await self._send(process, request)
        except LoaderUnavailable:
            process.pending.pop(request.id, None)
            raise
        return receive

    @staticmethod
    async def _send(process: _Process, message: LoadRequest | Drop) -> None:
        """Write ``message`` to ``process``'s stdin; LoaderUnavailable if it cannot."""
        body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            # A frame cut short would garble the stream: it is sent whole, or the
            # process is given up.
            with trio.CancelScope(shield=True), trio.move_on_after(SEND_TIMEOUT) as sending:
                async with process.send_lock:
                    await process.proc.stdin.send_all(FRAME_HEADER.pack(len(body)) + body)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise LoaderUnavailable(f"loader process {process.proc.pid} exited") from None
        if sending.cancelled_caught:
            process.proc.kill()
            raise LoaderUnavailable(f"loader process {process.proc.pid} does not read")

    async def _a_process(self) -> _Process:
        """The running process with the fewest requests, waiting for one to (re)start."""
        with trio.move_on_after(START_TIMEOUT):
            while not (live := [p for p in self._live if p is not None]):
                await self._started.wait()
            return min(live, key=lambda p: len(p.pending))
        raise LoaderUnavailable(f"no loader process started within {START_TIMEOUT:.0f} s")


def _widen(pipe: trio.abc.ReceiveStream | None) -> None:
    """Let the pipe hold a whole reply of an item up to PIPE_SIZE, so that it is read
    at once rather than in 64 KiB rounds of the loop (best effort: the system's
    fs.pipe-max-size bounds it)."""
    if isinstance(pipe, trio.lowlevel.FdStream):
        try:
            fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except OSError:
            pass


async def _next(replies: trio.MemoryReceiveChannel[LoadReply]) -> LoadReply:
    """A request's next reply (LoaderUnavailable if its process exited first)."""
    try:
        return await replies.receive()
    except trio.EndOfChannel:
        raise LoaderUnavailable("the loader process exited") from None


def _checked(reply: LoadReply) -> LoadReply:
    """``reply``, unless it says the item was not fetched (LoadFailed) or not the
    digest's content (LoadMismatch)."""
    if reply.outcome is Outcome.MISMATCH:
        raise LoadMismatch("the content does not match its digest")
    if reply.outcome is Outcome.FAILED:
        raise LoadFailed(reply.reason)
    return reply


async def _end(proc: trio.Process) -> int:
    """Close the process's stdin, read what it still says, and wait for it (killing it
    after STOP_TIMEOUT); its exit status."""
    with trio.move_on_after(STOP_TIMEOUT):
        try:
            await proc.stdin.aclose()
            while await proc.stdout.receive_some(READ_SIZE):
                pass  # replies nobody waits for any more
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass  # it has exited already
        return await proc.wait()
    log.warning("loader process %d did not finish within %.0f s: killing it", proc.pid,
                STOP_TIMEOUT)
    proc.kill()
    return await proc.wait()

"""mountd's loader processes (``mountd.loader_process``): the bucket GET, SHA-256 check
and store insert of chunk loads, off the serving loop and across cores.

The processes start with the first load and run until unmount, when their stdin is
closed and they finish what they hold. One that exits is started again after
RESTART_DELAY; the loads it had in flight end with LoaderUnavailable, and their callers
fetch those items in mountd instead. The processes write into this node's store
directory; what they stored, and what they could not, is recorded in the store here
(``ContentStore.stored_elsewhere``, ``write_failed_elsewhere``).
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import pickle
import subprocess
import sys

import trio

from mountd.content_store import ContentStore
from mountd.loader_process import FRAME_HEADER, LoadReply, LoadRequest, LoadSource, Outcome
from quiverfs.backends import Backend

log = logging.getLogger(__name__)

THREADS_PER_PROCESS = 16  # requests in flight per process: ~30 ms to first byte each
RESTART_DELAY = 1.0  # seconds before a process that exited is started again
START_TIMEOUT = 30.0  # seconds a load waits for a process to (re)start
SEND_TIMEOUT = 30.0  # seconds a request may take to enter a process's stdin
STOP_TIMEOUT = 10.0  # seconds a process may take to finish at unmount before it is killed
READ_SIZE = 1 << 20  # bytes read from a process's stdout at once
# Not ``-m mountd.loader_process``: its messages would be pickled as __main__'s classes.
LOADER_MAIN = "from mountd.loader_process import main; main()"


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


@dataclasses.dataclass
class _Waiting:
    done: trio.Event = dataclasses.field(default_factory=trio.Event)
    reply: LoadReply | None = None


class _Process:
    """One running loader process and the requests it has not answered yet."""

    def __init__(self, proc: trio.Process) -> None:
        self.proc = proc
        self.pending: dict[int, _Waiting] = {}
        self.send_lock = trio.Lock()

    async def receive(self) -> None:
        """Hand each reply to its request until the process's stdout ends."""
        buffer = bytearray()
        while chunk := await self.proc.stdout.receive_some(READ_SIZE):
            buffer += chunk
            while len(buffer) >= FRAME_HEADER.size:
                (size,) = FRAME_HEADER.unpack_from(buffer)
                end = FRAME_HEADER.size + size
                if len(buffer) < end:
                    break
                reply: LoadReply = pickle.loads(buffer[FRAME_HEADER.size:end])
                del buffer[:end]
                waiting = self.pending.pop(reply.id, None)
                if waiting is not None:  # else its caller has gone (cancelled)
                    waiting.reply = reply
                    waiting.done.set()

    def abandon(self) -> None:
        """End the requests still waiting (with no reply: LoaderUnavailable)."""
        for waiting in self.pending.values():
            waiting.done.set()
        self.pending.clear()


class LoaderPool:
    """``processes`` loader processes writing into ``store``, each with ``threads``
    requests in flight; ``load`` sends them one item at a time."""

    def __init__(self, processes: int, store: ContentStore, limiter: trio.CapacityLimiter,
                 threads: int = THREADS_PER_PROCESS) -> None:
        self.processes = processes
        self.store = store
        self.limiter = limiter
        self.threads = threads
        self._live: list[_Process | None] = [None] * processes
        self._slots = trio.Semaphore(processes * threads)
        self._wanted = trio.Event()
        self._started = trio.Event()  # set (and replaced) whenever a process starts
        self._ids = itertools.count()

    @property
    def capacity(self) -> int:
        """Requests the processes hold at once."""
        return self.processes * self.threads

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Keep the processes running from the first load on; at cancellation, end them."""
        async with trio.open_nursery() as nursery:
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
                     str(logging.getLogger().getEffectiveLevel())],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE))
            except OSError as exc:
                log.error("cannot start a loader process: %s: chunk loads run in mountd",
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

    async def load(self, source: LoadSource, key: str, offset: int, length: int,
                   digest: bytes) -> int | bytes:
        """Fetch an item, check and store it in a loader process: the number of bytes it
        stored, or the bytes when the store could not take them. Raises LoadMismatch,
        LoadFailed, or LoaderUnavailable (the item is still to be fetched)."""
        self._wanted.set()
        async with self._slots:
            reply = await self._ask(source, key, offset, length, digest)
        if reply.outcome is Outcome.STORED:
            self.store.stored_elsewhere(digest, reply.file)
            return reply.nbytes
        if reply.outcome is Outcome.MISMATCH:
            raise LoadMismatch(digest.hex())
        if reply.outcome is Outcome.FAILED:
            raise LoadFailed(reply.reason)
        await trio.to_thread.run_sync(self.store.write_failed_elsewhere, reply.reason,
                                      reply.outcome is Outcome.DAMAGED, limiter=self.limiter)
        return reply.data  # UNSTORED and DAMAGED replies carry the bytes

    async def _ask(self, source: LoadSource, key: str, offset: int, length: int,
                   digest: bytes) -> LoadReply:
        process = await self._a_process()
        request = LoadRequest(next(self._ids), source, key, offset, length, digest)
        body = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        waiting = process.pending[request.id] = _Waiting()
        try:
            # A frame cut short would garble the stream: it is sent whole, or the
            # process is given up.
            with trio.CancelScope(shield=True), trio.move_on_after(SEND_TIMEOUT) as sending:
                async with process.send_lock:
                    await process.proc.stdin.send_all(FRAME_HEADER.pack(len(body)) + body)
            if sending.cancelled_caught:
                process.proc.kill()
                raise LoaderUnavailable(f"loader process {process.proc.pid} does not read")
            await waiting.done.wait()
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise LoaderUnavailable(f"loader process {process.proc.pid} exited") from None
        finally:
            process.pending.pop(request.id, None)
        if waiting.reply is None:
            raise LoaderUnavailable(f"loader process {process.proc.pid} exited")
        return waiting.reply

    async def _a_process(self) -> _Process:
        """The running process with the fewest requests, waiting for one to (re)start."""
        with trio.move_on_after(START_TIMEOUT):
            while not (live := [p for p in self._live if p is not None]):
                await self._started.wait()
            return min(live, key=lambda p: len(p.pending))
        raise LoaderUnavailable(f"no loader process started within {START_TIMEOUT:.0f} s")


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

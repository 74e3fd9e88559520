"""The store's writes that no read waits for, done in one thread of their own.

A write may wait a long time: for the index's lock, which a loader process holds for
its transaction (up to the index's TIMEOUT when that process hangs), or for a slow disk.
Done in a serving worker, that wait would hold the worker, and the reads behind it. So
a miss's put (waited for only briefly: ``ContentStore.put_soon``), the hits' recency,
and a damaged entry's drop or a loader process's failed write that cannot be recorded
at once are handed to this thread; a put's bytes (checked already) are served from here
until they are stored.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# Bytes of puts waiting for the store at once: beyond, a put is not made (its item is
# served uncached). They wait only while the store is slower than the misses.
MAX_PENDING_BYTES = 64 << 20
MAX_JOBS = 4096  # other writes waiting at once: beyond, one is not made
CLOSE_WAIT = 2.0  # seconds ``close`` waits for the writes still waiting
# Seconds a read waits for its miss's put (many times what a put takes on a disk that
# works, so that a read's item is stored when it returns); a write running longer
# counts the writer as stuck (``stuck``), and no read waits for it.
STUCK_AFTER = 0.25


class BackgroundWrites:
    """A queue of store writes and the thread that does them, in order, one at a time.
    ``pending`` holds the bytes of the puts not done yet, by digest."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.pending: dict[bytes, bytes] = {}
        self._pending_bytes = 0
        self._jobs: collections.deque[tuple[Callable[[], object], object]] = (
            collections.deque())
        self._queued: set[object] = set()  # the keys of the jobs waiting
        self._cond = threading.Condition()
        self._running_since: float | None = None  # time.monotonic() the job began
        self._closed = False
        self._thread: threading.Thread | None = None

    def put(self, digest: bytes, data: bytes, store: Callable[[bytes, bytes], object]
            ) -> threading.Event | None:
        """Call ``store(digest, data)`` soon, and serve ``data`` from ``pending`` until
        it returns; an event set then. None where it would go over MAX_PENDING_BYTES
        (or after ``close``): not stored."""
        with self._cond:
            if self._closed or self._pending_bytes + len(data) > MAX_PENDING_BYTES:
                return None
            self.pending[digest] = data  # one put of it waiting already: the same bytes
            self._pending_bytes += len(data)
            done = threading.Event()
            self._enqueue(lambda: self._stored(digest, data, store, done), None)
        return done

    def _stored(self, digest: bytes, data: bytes, store: Callable[[bytes, bytes], object],
                done: threading.Event) -> None:
        try:
            store(digest, data)
        finally:
            with self._cond:
                self._pending_bytes -= len(data)
                if self.pending.get(digest) is data:
                    del self.pending[digest]
            done.set()

    def stuck(self) -> bool:
        """Whether the write running began more than STUCK_AFTER ago (a hung writer
        holds the index's lock, or the disk hangs)."""
        since = self._running_since
        return since is not None and time.monotonic() - since > STUCK_AFTER

    def submit(self, job: Callable[[], object], key: object = None) -> bool:
        """Call ``job()`` soon; with ``key``, not while a job of that key still waits.
        False if it is not queued (over MAX_JOBS, a job of ``key`` waits, or closed)."""
        with self._cond:
            if self._closed or len(self._jobs) >= MAX_JOBS or (
                    key is not None and key in self._queued):
                return False
            self._enqueue(job, key)
        return True

    def _enqueue(self, job: Callable[[], object], key: object) -> None:
        """Queue ``job`` (the caller holds the condition's lock)."""
        self._jobs.append((job, key))
        if key is not None:
            self._queued.add(key)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="store writes")
            self._thread.start()
        self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._running_since = None
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                job, key = self._jobs.popleft()
                self._queued.discard(key)
                self._running_since = time.monotonic()
            try:
                job()
            except Exception:  # noqa: BLE001 - one write's failure ends that write only
                log.exception("store %s: a background write failed", self.directory)

    def close(self) -> bool:
        """Do the writes still waiting, for up to CLOSE_WAIT, and take no more; False if
        one hangs (left, with the daemon thread, to the process's exit)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is None:
            return True
        self._thread.join(CLOSE_WAIT)
        if self._thread.is_alive():
            log.warning("store %s: %d writes not done at close (a write hangs)",
                        self.directory, len(self._jobs) + 1)
            return False
        return True

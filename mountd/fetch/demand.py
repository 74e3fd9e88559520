"""Which datasets allotted ``full`` are being filled now: their jobs' own fetches in
flight (misses of every kind; not chunk loads or refills), counted per dataset identity
and the uid that registered it.

A dataset allotted full is filled once, by its jobs' misses, and its jobs read at hit
speed from then on: the allocation judged it worth its bytes, and the sooner it is
filled the better. A chunk load of another dataset fetches ahead of its own jobs, at
the bucket's full speed; beside that fill, every byte it reads delays the fill, and its
own jobs gain nothing yet (they read those items later, or fetch them themselves as
cooperative misses when they get to them first). So a chunk load waits (``ChunkLoader``)
until no other dataset of the same uid has been filled for QUIET seconds: jobs that
miss leave gaps between their batches' fetches, and a load let through by one would
read a whole block inside the fill. It waits LIMIT seconds at most, and a dataset's
loads wait in turn, so that meanwhile its loads go on at one block per LIMIT however
many of its chunks load at once. Datasets with chunks (``coop``) never hold a load: a
chunk cycle reads the bucket for as long as its jobs run, and the loads of the dataset
that gains most from the cache would wait on the misses of those that gain least.

Only the same uid's fetches hold a load: between users, the fair shares of
``mountd.fetch.fair_share`` divide the bucket, and one user's reads (a single slow
fetch kept in flight is enough) must not slow another's loads.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

import trio

from quiverfs.counters import FetchCause
from quiverfs.heartbeat import CacheMode

# Fetches ahead of the jobs: the ones that wait.
AHEAD = frozenset({FetchCause.CHUNK_LOAD, FetchCause.REFILL})

Key = tuple[int, str]  # (uid, dataset identity)
QUIET = 0.5  # seconds without fetches that let a load go: longer than a gap between batches
LIMIT = 5.0  # seconds a load waits at most: several misses' times, a slow job's batch or two


class Demand:
    """The fetches filling datasets allotted full, per (uid, dataset identity)."""

    def __init__(self) -> None:
        self.inflight: collections.Counter[Key] = collections.Counter()
        self._quieter = trio.Event()  # set (and replaced) as a fetch ends
        self._turns: dict[Key, trio.Lock] = {}  # per dataset with loads waiting
        self._ended: dict[Key, float] = {}  # when each dataset's last fetch ended (trio time)

    @contextlib.contextmanager
    def fetching(self, uid: int, identity: str, mode: CacheMode, cause: FetchCause
                 ) -> Iterator[None]:
        """Count a fetch for ``cause`` of ``uid``'s dataset ``identity``, allotted
        ``mode``, while it runs, where it fills a dataset allotted full."""
        if cause in AHEAD or mode is not CacheMode.FULL:
            yield
            return
        key = (uid, identity)
        self.inflight[key] += 1
        try:
            yield
        finally:
            self.inflight[key] -= 1
            if not self.inflight[key]:
                del self.inflight[key]
                now = trio.current_time()
                self._ended = {k: t for k, t in self._ended.items() if t > now - QUIET}
                self._ended[key] = now
                self._quieter.set()
                self._quieter = trio.Event()

    def others(self, uid: int, identity: str) -> bool:
        """Whether another dataset of ``uid`` is being filled."""
        return any(u == uid and name != identity for u, name in self.inflight)

    def _quiet_from(self, uid: int, identity: str) -> float:
        """When QUIET seconds will have passed since another dataset of ``uid`` was
        last filled (none is now)."""
        ended = [t for (u, name), t in self._ended.items() if u == uid and name != identity]
        return max(ended, default=-float("inf")) + QUIET

    async def wait_for_others(self, uid: int, identity: str) -> None:
        """Wait for the turn of the loads of ``uid``'s dataset ``identity``, then until
        no other dataset of ``uid`` has been filled for QUIET seconds, or LIMIT seconds
        have passed."""
        key = (uid, identity)
        turn = self._turns.setdefault(key, trio.Lock())
        try:
            async with turn:
                with trio.move_on_after(LIMIT):
                    while True:
                        if self.others(uid, identity):
                            await self._quieter.wait()
                        elif trio.current_time() < (quiet := self._quiet_from(uid, identity)):
                            await trio.sleep_until(quiet)
                        else:
                            break
        finally:
            if not turn.locked() and not turn.statistics().tasks_waiting:
                self._turns.pop(key, None)

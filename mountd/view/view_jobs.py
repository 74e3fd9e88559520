"""The substitutable view (``quiver mount DIGEST --view substitutable``): substitution for
readers that do not use the sampler (paper §4.7, in the filesystem itself).

In a view, opening ``CLASS/x.jpg`` serves an item of the same *pool* (the same
directory and file extension, so of the same label) that the opening job has not yet
received in its current pass over that pool. A pass ends when the job has received
every item of the pool once; the next open of the pool starts the next one. A plain
``DataLoader(shuffle=True)`` reads every path once per epoch, so each epoch is one pass
per pool, and the job gets every item exactly once per epoch.

Every job takes a pool's items in one common order (the chunk cycle's: resident chunks
first, then as the ring brings them; shuffled anew each pass): cached ones first, else a
miss of the first not on its way already (the jobs at the front each fetch another). So
what one job fetches is what the others want next; it stays cached
until every view job here has opened it, and is then the store's first to evict
(``spent``). The readahead
(mountd.view.readahead) fetches the next items in that order, within the dataset's
allotment, for the pools where some job has the fewest cached items left. The view's
jobs do not drive the chunk cycle: each pool's demand runs at its own random rate, and
the slowest pool of the slowest job would hold every chunk back.

A job is recognised by who opens (the rule, in order; docs/view.md):
1. ``QUIVER_JOB=NAME`` in the reader's environment (as it was when the process started);
2. a torchrun run (``TORCHELASTIC_RUN_ID`` with ``MASTER_ADDR``/``MASTER_PORT``): its
   local ranks start in sessions of their own, so they are recognised by the run;
3. the reader's process group: the command a shell started, with its DataLoader workers
   and ``mp.spawn`` ranks.
Jobs are per view and per uid: no one shares another user's passes. Items without a
label are their own pool: they are always served exactly.
"""
from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import os
import re
import time
from typing import Any

import trio

from mountd.datasets.dataset import MountedDataset
from mountd.fetch.services import ReadServices
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.jobs.registry import JobRegistry
from mountd.view.native_queue import NativeQueues, ViewPlane
from mountd.view.readahead import JobNeeds, ViewReadahead
from mountd.view.view_job import Choice, PoolPass, ViewJob
from quiverfs.counters import FetchCause, ReadCounter, SamplerJobCounter, ViewJobCounter
from quiverfs.heartbeat import CacheMode, to_wire
from quiverfs.job_protocol import JOB_ENV

log = logging.getLogger(__name__)

POOL_BATCH = 8  # hits of one pool planned at once (one store look-up for up to 8 opens)
MAX_JOBS_PER_USER = 64  # view jobs a uid holds at once; its least recently used goes first
JOB_IDLE = 3600.0  # seconds without an open after which a job is forgotten
SWEEP_EVERY = 5.0  # seconds between looks for jobs whose processes are gone
MAX_IDENTITIES = 4096  # reader pids whose job identity is remembered
MAX_PGIDS = 64  # process groups remembered per job (it ends when all of them are gone)
LOOKUP_BLOCK = 4 * POOL_BATCH  # pending items of a pool looked up in the store at once
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


class ViewJobs:
    """Recognises the job behind each open of a view file and chooses what it gets."""

    def __init__(self, jobs: JobRegistry, services: ReadServices) -> None:
        self.registry = jobs
        self.bulk = services.bulk
        self.cluster = services.cluster
        self.limiter = services.limiter
        self.stats = services.stats
        self.staging = services.staging
        self.recency = services.recency
        self.services = services
        self.jobs: dict[tuple[str, int, str], ViewJob] = {}
        self._identities: collections.OrderedDict[int, tuple[int, str]] = (
            collections.OrderedDict())  # pid -> (its pgid then, job identity)
        self.readahead = ViewReadahead(services.bulk, services.recency, self._needs)
        self.native: NativeQueues | None = None  # where the native plane serves opens
        self._native_ids = itertools.count(1)

    def serve_natively(self, plane: ViewPlane) -> None:
        """From now on, queue jobs' hits in the native plane (mountd.view.native_queue),
        which answers their opens."""
        self.native = NativeQueues(plane, self._plan, self.opened_natively, self.given_back,
                                   self._load)

    # -- which job ----------------------------------------------------------------------
    async def _identity(self, pid: int) -> tuple[str, int | None]:
        """(job identity, process group) of the reading process ``pid``."""
        try:
            pgid = os.getpgid(pid) if pid > 0 else None
        except ProcessLookupError:  # gone, or in a pid namespace mountd cannot see
            pgid = None
        if pgid is None:
            return "uid", None
        known = self._identities.get(pid)
        if known is not None and known[0] == pgid:
            return known[1], pgid
        env = await trio.to_thread.run_sync(_environment, pid, limiter=self.limiter)
        identity = identity_from(env, pgid)
        self._identities[pid] = (pgid, identity)
        while len(self._identities) > MAX_IDENTITIES:
            self._identities.popitem(last=False)
        return identity, pgid

    async def job_for(self, ds: MountedDataset, pid: int, uid: int) -> ViewJob:
        identity, pgid = await self._identity(pid)
        key = (ds.name, uid, identity)
        job = self.jobs.get(key)
        if job is None:
            group = await self.registry.group_for(ds)
            job = self.jobs.get(key)  # another open may have made it meanwhile
            if job is None:
                job = self._create(key, ds, group)
        job.last_used = time.monotonic()
        if pgid is not None and len(job.pgids) < MAX_PGIDS:
            job.pgids.add(pgid)
        if pgid is not None and self.native is not None:
            self.native.opener(job, pid, pgid)
        return job

    def _create(self, key: tuple[str, int, str], ds: MountedDataset, group: DatasetJobs
                ) -> ViewJob:
        name, uid, identity = key
        mine = [k for k in self.jobs if k[1] == uid]
        if uid != 0 and len(mine) >= MAX_JOBS_PER_USER:
            oldest = min(mine, key=lambda k: self.jobs[k].last_used)
            log.info("uid %d holds %d view jobs: forgetting %s", uid, len(mine), oldest[2])
            self._drop(oldest)
        job_id = f"view:{name}:{uid}:{identity}"
        job = self.jobs[key] = ViewJob(job_id, ds, uid, identity, group,
                                       next(self._native_ids))
        group.add(job)
        if self.native is not None:
            self.native.created(job)
        log.info("view %s: new job %s (uid %d)", name, identity, uid)
        return job

    def _drop(self, key: tuple[str, int, str]) -> None:
        job = self.jobs.pop(key)
        job.group.discard(job.id)
        if self.native is not None:
            self.native.dropped(job)

    def dataset_removed(self, name: str) -> None:
        for key in [k for k in self.jobs if k[0] == name]:
            self._drop(key)

    async def run(self) -> None:
        """The readahead, and the sweep of ended jobs."""
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.readahead.run)
            nursery.start_soon(self._sweep)
            if self.native is not None:
                nursery.start_soon(self.native.run)

    async def _sweep(self) -> None:
        """Forget jobs whose processes are all gone (their needs would keep items
        cached, and draw the readahead), and jobs idle for JOB_IDLE."""
        while True:
            await trio.sleep(SWEEP_EVERY)
            now = time.monotonic()
            for key, job in list(self.jobs.items()):
                if now - job.last_used > JOB_IDLE or (job.pgids and not any(
                        _group_alive(g) for g in job.pgids)):
                    log.info("view %s: job %s ended", key[0], key[2])
                    self._drop(key)

    def _needs(self) -> list[tuple[DatasetJobs, list[JobNeeds]]]:
        """Each dataset with view jobs here, and what each of them is yet to be served
        (and in which pass of each pool); what the store evicted since taken first."""
        self._take_evictions()
        by_group: dict[int, tuple[DatasetJobs, list[JobNeeds]]] = {}
        for job in self.jobs.values():
            by_group.setdefault(id(job.group), (job.group, []))[1].append(
                (job.unopened(), job.pass_number))
        return list(by_group.values())

    def _take_evictions(self) -> None:
        """The store's news of what it evicted since the last call, told to each dataset
        with view jobs here: the items it takes to be cached (``CachedItems``) are then
        those the store holds, and its readahead's room is true. Taken before each look
        in the store and each hold (news older than either would undo it), and at least
        every IDLE_LOOK (the readahead's), so that a node without view jobs drops it."""
        news = self.services.store.evictions
        evicted = [news.popleft() for _ in range(len(news))]
        if not evicted:
            return
        for group in {id(job.group): job.group for job in self.jobs.values()}.values():
            items = group.ds.pools.items_with(group.ds.digest, evicted)
            if len(items):
                group.cached.evicted(items)

    def status(self, uid: int) -> list[dict[str, Any]]:
        return [{**job.stats(),
                 "chunks": to_wire(job.group.view) if job.group.view is not None else None}
                for job in self.jobs.values() if uid in (0, job.uid)]

    # -- what it gets -------------------------------------------------------------------
    async def choose(self, ds: MountedDataset, entry: int, pid: int, uid: int) -> Choice:
        """The item an open of ``entry`` serves to the job of process ``pid``."""
        pool = int(ds.pools.pool_of[entry])
        if len(ds.pools.members[pool]) == 1:
            return Choice(entry, False, FetchCause.EXACT, True)
        job = await self.job_for(ds, pid, uid)
        while True:
            current = job.pass_of(pool)
            if current.queue:
                choice = self._taken(job, pool, current.queue.popleft())
                break
            if current.native and not current.pending.any() and self.native is not None:
                taken = await self.native.take_back(job, pool, current)
                if taken is not None:
                    choice = self._taken(job, pool, taken)
                    break
                continue
            async with current.lock:
                if not current.queue and current.pending.any():
                    await self._plan(job, pool, current)
        job.opened_in(current)
        self._count(job, [choice])
        if self.native is not None:
            self.native.top_up(job, pool)
        return choice

    def _count(self, job: ViewJob, choices: list[Choice]) -> None:
        """``choices`` served to ``job``'s opens, counted as opens and hits or misses."""
        hits = sum(c.hit for c in choices)
        job.counters[ViewJobCounter.OPENS] += len(choices)
        for key, read_key, n in ((ViewJobCounter.HITS, ReadCounter.VIEW_HITS, hits),
                                 (ViewJobCounter.MISSES, ReadCounter.VIEW_MISSES,
                                  len(choices) - hits)):
            if n:
                job.counters[key] += n
                self.stats.count(job.ds, read_key, n)

    def opened_natively(self, job: ViewJob, pool: int, opened: list[tuple[Choice, float]]
                        ) -> None:
        """Hits queued in the native plane that were opened there (drained together, with
        the seconds each open took): counted as opens and reads of the store here would
        be, spent as ``_taken`` spends them (all at once), and their plans' promises kept
        (a read here takes it from the staging), so that a chunk's eviction may drop them."""
        ds, digest = job.ds, job.ds.digest
        self._spend(job.group, [c.index for c, _ in opened
                                if c.hit and self._spent(job, pool, c.index)])
        self._count(job, [c for c, _ in opened])
        files = self.services.store.files
        for choice, seconds in opened:
            h = digest.hash(choice.index)
            self.staging.take(h)
            self.recency.hit(h)
            files.seen(h)
            self.stats.observe("local", seconds)
        self.stats.count(ds, ReadCounter.LOCAL_HITS, len(opened))
        self.stats.count(ds, ReadCounter.LOCAL_BYTES,
                         sum(digest.sizes[c.index] for c, _ in opened))

    async def _plan(self, job: ViewJob, pool: int, current: PoolPass,
                    batch: int = POOL_BATCH, misses: bool = True) -> None:
        """Choose the next items of a pool pass, in the common order: up to ``batch``
        cached ones, or where none is, a miss of the first item the job still needs
        that is not on its way (with ``misses``; without, nothing: a miss is chosen as
        it is opened, when what is cached then is known)."""
        group, digest = job.group, job.ds.digest
        self._take_evictions()  # before the looks: older news would undo what they find
        pending = current.pending_items()
        order = group.in_order(pending, current.number)
        candidates = order[group.cached.findable(order)]
        hits: list[int] = []
        for start in range(0, len(candidates), LOOKUP_BLOCK):
            block = [int(i) for i in candidates[start:start + LOOKUP_BLOCK]]
            held = await self._held([digest.hash(i) for i in block])
            group.cached.seen(block, held)
            hits.extend(i for i, h in zip(block, held) if h)
            if len(hits) >= batch:
                break
        hits = hits[:batch]
        if not hits and not misses:
            return
        self._take_evictions()  # news of what was evicted during the looks, before the hold
        if hits:
            fetch = []
        else:
            # the first not on its way already: another job's miss of it would be waited
            # for, and the jobs at the front would take the bucket one item at a time
            free = order[~group.cached.coming[order]]
            fetch = [int(free[0] if len(free) else order[0])]
        job.place(current, hits + fetch)
        # a miss no other job needs is read and not kept; hits are spent when opened
        spent = [i for i in fetch if self._spent(job, pool, i)]
        self._spend(group, spent)
        self.recency.wanted(digest.hash(i) for i in hits + fetch if i not in spent)
        kept = [i for i in fetch if i not in spent and group.mode is not CacheMode.NONE]
        if kept:
            group.cached.hold(kept)
        current.queue.extend(Choice(i, True, FetchCause.COOP_MISS, True) for i in hits)
        current.queue.extend(Choice(i, False, FetchCause.COOP_MISS, i not in spent)
                             for i in fetch)
        self.staging.planned([digest.hash(i) for i in hits])
        self.readahead.wake()

    async def _load(self, job: ViewJob, choice: Choice) -> bool:
        """Fetch the miss ``choice`` into the store, for an open waiting in the native
        plane; whether it is there and verified (the plane serves it). A failed fetch is
        not counted here: the open, declined, goes to Python, whose read fetches it
        again and counts what fails."""
        ds = job.ds
        failed: collections.Counter[SamplerJobCounter] = collections.Counter()
        await self.bulk.load(ds, [choice.index], failed, choice.cause, waiting=True)
        return ds.digest.hash(choice.index) in self.services.store.verified

    def given_back(self, job: ViewJob, item: int) -> None:
        """The native plane gave ``item`` back (its file gone, or not the verified one):
        its file is forgotten, so that it is no longer taken as held (``_held``)."""
        self.services.store.files.forget(job.ds.digest.hash(item))

    async def _held(self, hashes: list[bytes]) -> list[bool]:
        """Which of ``hashes`` are held: those whose value file the store here knows,
        and where it knows every one (``ValueFiles.holds``: each put's and each
        eviction's news reach it), those of this node's that it does not, without a
        look; the rest looked up (a worker thread's, or a peer's). One evicted since
        is fetched where Python opens it (as one evicted after its look is), and given
        back by the native plane, which opens its file first."""
        files, other_owner = self.services.store.files, self.cluster.other_owner
        known: list[bool | None] = []
        for h in hashes:
            held = files.holds(h)
            # a peer's item not here: its owner is asked
            known.append(None if held is False and other_owner(h) is not None else held)
        asked = [h for h, k in zip(hashes, known) if k is None]
        if not asked:
            return [bool(k) for k in known]
        found = iter(await self.bulk.held(asked))
        return [next(found) if k is None else k for k in known]

    def _taken(self, job: ViewJob, pool: int, choice: Choice) -> Choice:
        """``choice``, as an open of ``job``'s takes it from its queue: a hit that no
        other job needs any more is spent now, not when planned (the job opens its
        planned hits over a while, and the store evicts spent items first)."""
        if choice.hit and self._spent(job, pool, choice.index):
            self._spend(job.group, [choice.index])
            return dataclasses.replace(choice, keep=False)
        return choice

    def _spend(self, group: DatasetJobs, items: list[int]) -> None:
        if items:
            group.cached.spend(items)
            self.recency.spent(group.ds.digest.hash(i) for i in items)

    def _spent(self, job: ViewJob, pool: int, item: int) -> bool:
        """Whether no other job here needs ``item`` of ``pool`` (placed for ``job``) in
        its current pass, nor has chosen it and not opened it yet: on a lone node with
        view jobs only (elsewhere, other jobs and nodes may still read it). Never where
        the dataset is allotted full: it is kept whole, each item for the next pass."""
        if job.group.mode is CacheMode.FULL or len(self.cluster.live()) > 1:
            return False
        for other in job.group.jobs.values():
            if not isinstance(other, ViewJob):
                return False
            if other is not job and (other.need[item] or other.queued(pool, item)):
                return False
        return True


def _environment(pid: int) -> dict[bytes, bytes]:
    """The environment ``pid`` started with ({} where it cannot be read)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return {}
    pairs = (entry.partition(b"=") for entry in raw.split(b"\0") if entry)
    return {k: v for k, sep, v in pairs if sep}


def identity_from(env: dict[bytes, bytes], pgid: int) -> str:
    """The job identity of a reader with environment ``env`` in process group ``pgid``."""
    name = env.get(JOB_ENV.encode(), b"").decode("utf-8", "replace")
    if _JOB_NAME.fullmatch(name):
        return f"env:{name}"
    run = env.get(b"TORCHELASTIC_RUN_ID")
    port = env.get(b"MASTER_PORT")
    if run is not None and port is not None:
        addr = env.get(b"MASTER_ADDR", b"")
        text = b":".join((addr, port, run)).decode("utf-8", "replace")[:200]
        return f"torchrun:{text}"
    return f"pgid:{pgid}"


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists: mountd is not root in some tests
        pass
    return True

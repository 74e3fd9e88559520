"""The substitutable view (``quiver mount DIGEST --view substitutable``): substitution for
readers that do not use the sampler (paper §4.7, in the filesystem itself).

In a view, opening ``CLASS/x.jpg`` serves an item of the same *pool* (the same
directory and file extension, so of the same label) that the opening job has not yet
received in its current pass over that pool: cached items first (from the oldest usable
chunk), else a miss, from the chunk that loads next first. A pass ends when the job has
received every item of the pool once; the next open of the pool starts the next one. A
plain ``DataLoader(shuffle=True)`` reads every path once per epoch, so each epoch is
one pass per pool, and the job gets every item exactly once per epoch.

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
import hashlib
import logging
import os
import re
import time
from typing import Any

import numpy as np
import trio

from mountd.bulk_fetch import BulkFetch
from mountd.cluster import Cluster
from mountd.dataset import MountedDataset
from mountd.dataset_jobs import DatasetJobs
from mountd.item_reader import ItemReader
from mountd.job_registry import JobRegistry
from mountd.read_stats import FetchCause
from mountd.substitution import EpochSampler, advance
from quiverfs.chunk_cycle import EpochRef
from quiverfs.digest import Digest
from quiverfs.heartbeat import CacheMode, JobReport, to_wire

log = logging.getLogger(__name__)

VIEWS = ("exact", "substitutable")
POOL_BATCH = 8  # hits of one pool planned at once (one store look-up for up to 8 opens)
# Seconds an open waits for the chunk cycle to bring items of its pool, when the resident
# chunks hold none the job still needs: a miss then would be a bucket read no other job
# shares. As long as the sampler's jobs wait (mountd.batch_planner.CHUNK_WAIT).
CHUNK_WAIT = 20.0
MAX_JOBS_PER_USER = 64  # view jobs a uid holds at once; its least recently used goes first
JOB_IDLE = 3600.0  # seconds without an open after which a job is forgotten
SWEEP_EVERY = 5.0  # seconds between looks for jobs whose processes are gone
MAX_IDENTITIES = 4096  # reader pids whose job identity is remembered
MAX_PGIDS = 64  # process groups remembered per job (it ends when all of them are gone)
JOB_ENV = "QUIVER_JOB"
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclasses.dataclass(frozen=True)
class ViewPools:
    """The pools of a view's digest: items that may stand in for one another."""

    pool_of: np.ndarray  # int32 per item
    members: tuple[np.ndarray, ...]  # item indices per pool

    @classmethod
    def of(cls, digest: Digest) -> ViewPools:
        """Pools by (directory, lower-case extension) of labelled items; an unlabelled
        item is a pool of its own."""
        keys: dict[tuple[str, str], int] = {}
        pool_of = np.empty(len(digest), dtype=np.int32)
        for i in range(len(digest)):
            path = digest.path(i)
            if not digest.label(i):
                key = (path, "")  # a path is never also a directory: no clash
            else:
                dirname, _, name = path.rpartition("/")
                key = (dirname, os.path.splitext(name)[1].lower())
            pool_of[i] = keys.setdefault(key, len(keys))
        order = np.argsort(pool_of, kind="stable")
        bounds = np.searchsorted(pool_of[order], np.arange(len(keys) + 1))
        members = tuple(order[bounds[p]:bounds[p + 1]].astype(np.int64)
                        for p in range(len(keys)))
        return cls(pool_of, members)


def has_labels(digest: Digest) -> bool:
    return any(digest.labels)


@dataclasses.dataclass(frozen=True)
class Choice:
    """What an open of a view file serves, and how a miss of it is fetched."""

    index: int
    hit: bool  # cached when chosen
    cause: FetchCause
    keep: bool


class _PoolPass:
    """A job's current pass over one pool: its sampler, and items chosen not yet served."""

    def __init__(self, number: int, sampler: EpochSampler) -> None:
        self.number = number
        self.sampler = sampler
        self.queue: collections.deque[Choice] = collections.deque()
        self.lock = trio.Lock()  # one planning at a time: the sampler is a generator

    @property
    def used_up(self) -> bool:
        """Every item handed out (a planning under way may still be queueing some)."""
        return not self.queue and not self.sampler.remaining and not self.lock.locked()


class ViewJob:
    """One job reading a view: its pass over each pool, and its counters."""

    def __init__(self, job_id: str, ds: MountedDataset, uid: int, identity: str,
                 group: DatasetJobs) -> None:
        self.id = job_id
        self.ds = ds
        self.uid = uid
        self.identity = identity
        self.group = group
        self.seed = int.from_bytes(hashlib.sha256(job_id.encode()).digest()[:8], "little")
        generation = group.view.generation if group.view is not None else 0
        self.ref = EpochRef(generation, np.zeros(group.plan.n_chunks, dtype=np.int64))
        self.pools: dict[int, _PoolPass] = {}
        self.pgids: set[int] = set()  # process groups seen opening for it
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_used = time.monotonic()

    def report(self) -> JobReport:
        """What the coordinator needs: its passes stand for an epoch; never probed (its
        reads are not timed per batch)."""
        return JobReport(id=self.id, gen=self.ref.started_generation, gpus=1,
                         remaining=tuple(int(n) for n in self.ref.remaining_chunks),
                         probe_seq=0, probeable=False)

    def stats(self) -> dict[str, Any]:
        return {"job": self.id, "dataset": self.ds.name, "uid": self.uid,
                "identity": self.identity, "counters": dict(self.counters),
                "pools_in_pass": len(self.pools),
                "remaining": int(self.ref.remaining_chunks.sum())}

    def pass_of(self, pool: int) -> _PoolPass:
        """The job's current pass over ``pool``; a new one where the last is used up."""
        current = self.pools.get(pool)
        if current is not None and not current.used_up:
            return current
        number = 0 if current is None else current.number + 1
        members = self.ds.pools.members[pool]
        order = members[np.random.default_rng([self.seed, pool, number])
                        .permutation(len(members))]
        plan = self.group.plan
        sampler = EpochSampler(order, POOL_BATCH, seed=self.seed + number,
                               chunk_of=plan.chunk_of)
        self.ref.remaining_chunks += np.bincount(plan.chunk_of[members],
                                                 minlength=plan.n_chunks)
        if self.group.view is not None:
            self.ref.started_generation = self.group.view.generation
        self.counters["passes"] += 1
        self.pools[pool] = made = _PoolPass(number, sampler)
        return made


class ViewJobs:
    """Recognises the job behind each open of a view file and chooses what it gets."""

    def __init__(self, jobs: JobRegistry, reader: ItemReader, bulk: BulkFetch,
                 cluster: Cluster) -> None:
        self.registry = jobs
        self.reader = reader
        self.bulk = bulk
        self.cluster = cluster
        self.jobs: dict[tuple[str, int, str], ViewJob] = {}
        self._identities: collections.OrderedDict[int, tuple[int, str]] = (
            collections.OrderedDict())  # pid -> (its pgid then, job identity)

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
        env = await trio.to_thread.run_sync(_environment, pid, limiter=self.reader.limiter)
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
        job = self.jobs[key] = ViewJob(job_id, ds, uid, identity, group)
        group.jobs[job_id] = job
        log.info("view %s: new job %s (uid %d)", name, identity, uid)
        return job

    def _drop(self, key: tuple[str, int, str]) -> None:
        job = self.jobs.pop(key)
        job.group.jobs.pop(job.id, None)

    def dataset_removed(self, name: str) -> None:
        for key in [k for k in self.jobs if k[0] == name]:
            self._drop(key)

    async def run(self) -> None:
        """Forget jobs whose processes are all gone (they would hold chunks back from
        eviction), and jobs idle for JOB_IDLE."""
        while True:
            await trio.sleep(SWEEP_EVERY)
            now = time.monotonic()
            for key, job in list(self.jobs.items()):
                if now - job.last_used > JOB_IDLE or (job.pgids and not any(
                        _group_alive(g) for g in job.pgids)):
                    log.info("view %s: job %s ended", key[0], key[2])
                    self._drop(key)

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
                choice = current.queue.popleft()
                break
            async with current.lock:
                if not current.queue and current.sampler.remaining:
                    await self._plan_for_open(job, current)
        job.counters["opens"] += 1
        job.counters["hits" if choice.hit else "misses"] += 1
        self.reader.stats.count(ds, "view_hits" if choice.hit else "view_misses")
        return choice

    async def _plan_for_open(self, job: ViewJob, current: _PoolPass) -> None:
        """Queue what the next opens of a pool get: cached items of the job's pass, or
        where there are none, one miss. In coop mode, where the usable chunks (loaded or
        loading) hold no item of the pool that the pass still needs, the job first waits
        (at most CHUNK_WAIT) for the cycle to bring some: a miss then would be a bucket
        read that no other job shares. A job that holds back the marked chunk never
        waits: the cycle waits for its reads."""
        group, ref, started = job.group, job.ref, trio.current_time()
        with trio.move_on_after(CHUNK_WAIT):
            while group.mode is CacheMode.COOP and group.view is not None:
                usable, marked = group.usable(ref), group.view.marked
                if (any(len(current.sampler.pending_in(c)) for c in usable)
                        or marked in usable and ref.remaining_chunks[marked] > 0):
                    break
                await group.changed.wait()
        job.counters["chunk_wait_s"] += trio.current_time() - started
        await self._plan(job, current)

    async def _plan(self, job: ViewJob, current: _PoolPass) -> None:
        """Choose the next items of a pool pass: up to POOL_BATCH cached ones, from the
        oldest usable chunk first; where none is cached, one miss (the chunks that come
        soonest first: ``_ahead``)."""
        group, ref, digest = job.group, job.ref, job.ds.digest

        async def is_cached(items: np.ndarray) -> np.ndarray:
            # Any item the store holds is a hit, whichever chunk it is of: the open reads
            # it now (a manifest's hits are read later, so the sampler takes them only
            # from the chunks that stay resident until then).
            return np.asarray(await self.bulk.held([digest.hash(int(i)) for i in items]))

        ahead = self._ahead(group, ref)
        steps = current.sampler.planning(lambda items: -ahead[group.plan.chunk_of[items]],
                                         group.oldest_usable(ref), partial=True)
        limiter = self.reader.limiter
        items, batch = await trio.to_thread.run_sync(advance, steps, None, limiter=limiter)
        while batch is None:
            items, batch = await trio.to_thread.run_sync(advance, steps,
                                                         await is_cached(items),
                                                         limiter=limiter)
        if group.take(ref, batch.items):
            self.cluster.poke()  # this job released the marked chunk
        horizon = len(group.view.resident) if group.view is not None else 0

        def choice(i: int, hit: bool) -> Choice:
            """How the item is read should it miss (a hit may be evicted first)."""
            if group.mode is not CacheMode.COOP:
                return Choice(i, hit, FetchCause.COOP_MISS, group.mode is CacheMode.FULL)
            if ahead[group.plan.chunk_of[i]] <= horizon:
                # the cycle loads it soon: kept, the other jobs hit it meanwhile, and the
                # loader finds it held
                return Choice(i, hit, FetchCause.COOP_MISS, True)
            # read once, not cached: it would push out what the cycle brought in
            return Choice(i, hit, FetchCause.STAGED_MISS, False)

        current.queue.extend(choice(i, True) for i in batch.hits)
        current.queue.extend(choice(i, False) for i in batch.fetch)
        self.reader.staging.planned([digest.hash(i) for i in batch.hits])

    @staticmethod
    def _ahead(group: DatasetJobs, ref: EpochRef) -> np.ndarray:
        """Per chunk, how soon the cycle brings it in: 0 for the chunks the job may use
        (resident), then 1, 2, ... in the order the cycle loads the others (all 0 where
        there is no cycle: everything may stay cached)."""
        n, view = group.plan.n_chunks, group.view
        ahead = np.zeros(n, dtype=np.int64)
        if view is None or group.mode is not CacheMode.COOP:
            return ahead
        ahead[:] = (np.arange(n) - view.next) % n + 1
        ahead[group.usable(ref)] = 0
        return ahead


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

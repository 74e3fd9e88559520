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
# A job counts as done with a chunk once at most this share of the chunk's items is left
# for it there. Its pools are read at random rates, so waiting for the last items of
# its slowest pool would hold back the cycle for all; what is left is served from the
# items kept when the chunk is evicted, or read as misses.
SCRAPS = 0.1
LOOKUP_BLOCK = 4 * POOL_BATCH  # pending items of a pool looked up in the store at once
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
    """A job's current pass over one pool: which of its items the job has not been
    served yet, and items chosen not yet served."""

    def __init__(self, number: int, members: np.ndarray, rng: np.random.Generator) -> None:
        self.number = number
        self.members = members  # the pool's items, ascending
        self.visit = rng.permutation(len(members))  # this pass's random order (positions)
        self.pending = np.ones(len(members), dtype=bool)
        self.queue: collections.deque[Choice] = collections.deque()
        self.lock = trio.Lock()  # one planning at a time

    def pending_items(self) -> np.ndarray:
        """The items not yet served in this pass, in its random order."""
        return self.members[self.visit[self.pending[self.visit]]]

    def needs(self, items: np.ndarray) -> np.ndarray:
        """Which of ``items`` (all of this pool) are not yet served in this pass."""
        return self.pending[np.searchsorted(self.members, items)]

    def place(self, items: list[int]) -> None:
        """Hand out ``items``: each at most once per pass."""
        positions = np.searchsorted(self.members, items)
        if not self.pending[positions].all() or len(set(items)) < len(items):
            raise AssertionError("an item was chosen twice in one pass")
        self.pending[positions] = False

    @property
    def used_up(self) -> bool:
        """Every item handed out (a planning under way may still be queueing some)."""
        return not self.queue and not self.pending.any() and not self.lock.locked()


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
        sizes = np.bincount(group.plan.chunk_of, minlength=group.plan.n_chunks)
        self.scraps = np.floor(SCRAPS * sizes).astype(np.int64)  # per chunk
        self.pools: dict[int, _PoolPass] = {}
        self.pgids: set[int] = set()  # process groups seen opening for it
        self.counters: collections.Counter[str] = collections.Counter()
        self.last_used = time.monotonic()

    def report(self) -> JobReport:
        """What the coordinator needs: its passes stand for an epoch; never probed (its
        reads are not timed per batch)."""
        return JobReport(id=self.id, gen=self.ref.started_generation, gpus=1,
                         remaining=tuple(int(n) for n in self.left()),
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
        rng = np.random.default_rng([self.seed, pool, number])
        plan = self.group.plan
        self.ref.remaining_chunks += np.bincount(plan.chunk_of[members],
                                                 minlength=plan.n_chunks)
        if self.group.view is not None:
            self.ref.started_generation = self.group.view.generation
        self.counters["passes"] += 1
        self.pools[pool] = made = _PoolPass(number, members, rng)
        return made

    def left(self) -> np.ndarray:
        """Per chunk, the items the job still needs there as the cycle counts them: none
        where only its scraps are left (SCRAPS)."""
        left = self.ref.remaining_chunks.copy()
        left[left <= self.scraps] = 0
        return left

    def holds_marked(self) -> bool:
        """Whether the job holds back the marked chunk's eviction."""
        view = self.group.view
        return (view is not None and view.marked is not None
                and self.ref.started_generation < view.marked_generation
                and bool(self.left()[view.marked]))

    def kept_for(self, items: np.ndarray) -> np.ndarray:
        """Which of an evicted chunk's ``items`` the job has not been served in its
        current passes (it released the chunk with them left: SCRAPS)."""
        out = np.zeros(len(items), dtype=bool)
        pools = self.ds.pools.pool_of[items]
        for pool in np.unique(pools):
            current = self.pools.get(int(pool))
            if current is not None and not current.used_up:
                mine = pools == pool
                out[mine] = current.needs(items[mine])
        return out


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
                if not current.queue and current.pending.any():
                    await self._plan_for_open(job, current)
        job.counters["opens"] += 1
        job.counters["hits" if choice.hit else "misses"] += 1
        self.reader.stats.count(ds, "view_hits" if choice.hit else "view_misses")
        return choice

    async def _plan_for_open(self, job: ViewJob, current: _PoolPass) -> None:
        """Queue what the next opens of a pool get: cached items of the job's pass, or
        where there are none, one miss. In coop mode, while the cycle moves and will
        bring items of the pool the pass still needs, a job that finds none cached first
        waits for it (at most CHUNK_WAIT): a miss then would be a bucket read that no
        other job shares. A job that holds back the marked chunk never waits: the cycle
        waits for its reads."""
        started = trio.current_time()
        with trio.move_on_after(CHUNK_WAIT):
            while True:
                # Taken before the look: a cycle that moves while _plan awaits the store
                # sets this event, where waiting on the one after it would sleep through
                # the move (this job may now hold the marked chunk that all wait for).
                changed = job.group.changed
                if await self._plan(job, current, may_miss=not self._should_wait(
                        job, current)):
                    break
                await changed.wait()
        job.counters["chunk_wait_s"] += trio.current_time() - started
        if not current.queue and current.pending.any():
            await self._plan(job, current, may_miss=True)

    @staticmethod
    def _should_wait(job: ViewJob, current: _PoolPass) -> bool:
        """Whether a pass with nothing cached should wait for the cycle rather than
        miss: the cycle moves (a chunk is marked or loading), the job does not hold it
        back, and no item it still needs is in a resident chunk (loading, or culled)."""
        group = job.group
        view = group.view
        return (group.mode is CacheMode.COOP and view is not None
                and (view.marked is not None or bool(view.loading))
                and not job.holds_marked()
                and not np.isin(group.plan.chunk_of[current.pending_items()],
                                view.resident).any())

    async def _plan(self, job: ViewJob, current: _PoolPass, may_miss: bool) -> bool:
        """Choose the next items of a pool pass: up to POOL_BATCH cached ones (those
        kept from evicted chunks first, then the resident chunks' from the oldest);
        where none is cached and ``may_miss``, one miss (from the chunks the cycle
        brings soonest: ``_ahead``). False where it chose nothing."""
        group, digest = job.group, job.ds.digest
        chunk_of = group.plan.chunk_of
        view = group.view
        pending = current.pending_items()
        ahead = self._ahead(group, job.ref)
        # The order to look items up in; items of chunks further than the horizon ahead
        # are not cached (unless kept at an eviction) and are not looked up.
        horizon = len(view.resident) if view is not None else 0
        chunks = chunk_of[pending]
        rank = ahead[chunks]
        if view is not None and group.mode is CacheMode.COOP:
            position = np.zeros(group.plan.n_chunks, dtype=np.int64)
            position[list(view.resident)] = np.arange(len(view.resident)) - horizon
            resident = np.isin(chunks, view.resident)
            rank[resident] = position[chunks[resident]]  # the oldest resident first
        rank[group.kept[pending]] = -horizon - 1
        looked = np.argsort(rank, kind="stable")
        candidates = pending[looked[rank[looked] <= horizon]]
        hits: list[int] = []
        for start in range(0, len(candidates), LOOKUP_BLOCK):
            block = candidates[start:start + LOOKUP_BLOCK]
            held = await self.bulk.held([digest.hash(int(i)) for i in block])
            hits.extend(int(i) for i, h in zip(block, held) if h)
            if len(hits) >= POOL_BATCH:
                break
        hits, fetch = hits[:POOL_BATCH], []
        if not hits:
            if not may_miss:
                return False
            fetch = [int(pending[np.argmin(ahead[chunk_of[pending]])])]
        current.place(hits + fetch)
        holder = job.holds_marked()
        group.take(job.ref, hits + fetch)
        if holder and not job.holds_marked():
            self.cluster.poke()  # this job released the marked chunk

        def choice(i: int, hit: bool) -> Choice:
            """How the item is read should it miss (a hit may be evicted first)."""
            if group.mode is not CacheMode.COOP:
                return Choice(i, hit, FetchCause.COOP_MISS, group.mode is CacheMode.FULL)
            if ahead[chunk_of[i]] <= horizon:
                # the cycle loads it soon: kept, the other jobs hit it meanwhile, and the
                # loader finds it held
                return Choice(i, hit, FetchCause.COOP_MISS, True)
            # read once, not cached: it would push out what the cycle brought in
            return Choice(i, hit, FetchCause.STAGED_MISS, False)

        current.queue.extend(choice(i, True) for i in hits)
        current.queue.extend(choice(i, False) for i in fetch)
        self.reader.staging.planned([digest.hash(i) for i in hits])
        return True

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

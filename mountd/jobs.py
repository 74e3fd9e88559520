"""Jobs that opted into substitutable reads, and the chunk cycle their datasets run.

A job (one rank of a training run) registers a config; then each read of its batch
file ``eE-bI`` returns the manifest of mini-batch I of epoch E, planned by an
EpochSampler over the items the job's ImageFolder sees. Misses the sampler picks are
fetched before the manifest is returned, so the job's workers read cache hits.
"""
from __future__ import annotations

import collections
import dataclasses
import json
import logging
import math
import time
from typing import Any

import numpy as np
import trio

from mountd.dataset import MountedDataset
from mountd.item_reader import ItemReader, ReadFailed
from mountd.mount_table import MountTable
from mountd.probing import BenefitProbe
from mountd.substitution import DEFAULT_SCAN_FACTOR, EpochSampler, advance, epoch_shard
from quiverfs import ownership
from quiverfs.chunk_cycle import ChunkState, EpochRef
from quiverfs.chunk_plan import default_chunk_bytes, make_plan
from quiverfs.heartbeat import (CacheMode, CycleView, DatasetReport, JobReport, LoadedShare,
                                to_wire)
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)

FETCH_CONCURRENCY = 16  # misses fetched at once for one batch or one chunk load
CHECK_BLOCK = 512  # items whose store membership is checked per thread call
# Seconds a coop job waits for the chunk cycle to bring it cached items before it
# fetches misses outside the resident chunks (each of those is a bucket read that no
# other job shares). A wait that times out is not repeated until the cycle moves.
CHUNK_WAIT = 20.0
WAIT_POLL = 0.25  # seconds between looks at what other nodes loaded, while waiting
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff",
                    ".webp")  # torchvision's IMG_EXTENSIONS


MAX_CONFIG_INT = 1 << 63  # bound of a job config's integers (seeds, sizes, ranks)
MAX_JOBS_PER_USER = 256  # jobs one uid (not root) may have registered at once


class JobError(Exception):
    """A job request that cannot be served; the message says why and what to do."""


class JobLimit(JobError):
    """A uid already holds as many jobs as it may."""


@dataclasses.dataclass(frozen=True)
class JobConfig:
    """What a job registers: which items it reads, and how it samples them."""

    dataset: str
    batch_size: int
    seed: int = 0
    rank: int = 0
    world_size: int = 1
    prefix: str = ""
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    scan_factor: int = DEFAULT_SCAN_FACTOR
    gpus: int = 1

    @classmethod
    def parse(cls, raw: bytes) -> JobConfig:
        try:
            data = json.loads(raw)
        except ValueError:
            raise JobError("the job config is not JSON") from None
        if not isinstance(data, dict):
            raise JobError("the job config must be a JSON object")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise JobError(f"unknown job config keys: {', '.join(sorted(unknown))}")
        if "dataset" not in data or "batch_size" not in data:
            raise JobError("the job config needs 'dataset' and 'batch_size'")
        ints = ("batch_size", "seed", "rank", "world_size", "scan_factor", "gpus")
        for key in ints:
            if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool)
                                or not 0 <= data[key] < MAX_CONFIG_INT):
                raise JobError(f"{key} must be an integer in 0..{MAX_CONFIG_INT - 1}, "
                               f"not {data[key]!r}")
        for key in ("dataset", "prefix"):
            if key in data and not isinstance(data[key], str):
                raise JobError(f"{key} must be a string, not {data[key]!r}")
        if "extensions" in data:
            if not isinstance(data["extensions"], list) or not all(
                    isinstance(e, str) for e in data["extensions"]):
                raise JobError("extensions must be a list of strings, like [\".jpg\"]")
            data["extensions"] = tuple(e.lower() for e in data["extensions"])
        cfg = cls(**data)
        if cfg.batch_size < 1:
            raise JobError(f"batch_size must be at least 1, not {cfg.batch_size}")
        if cfg.world_size < 1:
            raise JobError(f"world_size must be at least 1, not {cfg.world_size}")
        if not 0 <= cfg.rank < cfg.world_size:
            raise JobError(f"rank {cfg.rank} is not in 0..{cfg.world_size - 1} "
                           f"(world_size {cfg.world_size})")
        if cfg.scan_factor < 1 or cfg.gpus < 1:
            raise JobError("scan_factor and gpus must be at least 1")
        return cfg


def image_folder_items(ds: MountedDataset, prefix: str, extensions: tuple[str, ...]
                       ) -> np.ndarray:
    """The entries ImageFolder(ROOT/NAME/prefix) lists: files under a class directory
    whose names end in one of ``extensions``."""
    prefix = prefix.strip("/")
    start = f"{prefix}/" if prefix else ""
    out = []
    for i in range(len(ds.digest)):
        path = ds.digest.path(i)
        if not path.startswith(start):
            continue
        rel = path[len(start):]
        if "/" in rel and rel.lower().endswith(extensions):
            out.append(i)
    return np.asarray(out, dtype=np.int64)


class Job:
    """One registered rank: its config, current epoch and counters."""

    def __init__(self, job_id: str, uid: int, gid: int) -> None:
        self.id = job_id
        self.uid = uid
        self.gid = gid
        self.created = time.time()
        self.config: JobConfig | None = None
        self.group: DatasetJobs | None = None
        self.universe = np.zeros(0, dtype=np.int64)
        self.error = ""
        self.epoch = -1
        self.sampler: EpochSampler | None = None
        self.ref: EpochRef | None = None
        self.manifests: dict[int, bytes] = {}
        self.lock = trio.Lock()
        self.counters: collections.Counter[str] = collections.Counter()
        self.batch_times: collections.deque[float] = collections.deque(maxlen=1000)
        self.probe = BenefitProbe()
        self.gave_up_on: tuple[Any, ...] | None = None  # cycle state a chunk wait timed out in

    def record_time(self, epoch: int, batch: int, seconds: float) -> None:
        """The time the job reported between asking for batch - 1 and ``batch``."""
        self.batch_times.append(seconds)
        self.counters["reported_batches"] += 1
        self.probe.record(epoch, batch, seconds)

    def report(self) -> JobReport:
        """What the coordinator needs of the job (once its epoch has begun)."""
        t_miss, t_hit = self.probe.measured or (None, None)
        return JobReport(id=self.id, gen=self.ref.started_generation, gpus=self.config.gpus,
                         remaining=tuple(int(n) for n in self.ref.remaining_chunks),
                         probe_seq=self.probe.seq, t_miss=t_miss, t_hit=t_hit,
                         probing=self.probe.active)

    def benefit(self) -> dict[str, Any]:
        """t_miss and t_hit (seconds per batch) as the last complete probe measured them."""
        t_miss, t_hit = self.probe.measured or (None, None)
        return {"t_miss": t_miss, "t_hit": t_hit, "probing": self.probe.active,
                "benefit": t_miss / t_hit if t_miss and t_hit else None}

    def config_view(self) -> dict[str, Any]:
        if self.config is None:
            return {}
        n = len(self.universe)
        shard = n // self.config.world_size + (self.config.rank < n % self.config.world_size)
        return {**dataclasses.asdict(self.config), "job": self.id, "universe": n,
                "shard_items": shard,
                "batches_per_epoch": math.ceil(shard / self.config.batch_size)}

    def stats(self) -> dict[str, Any]:
        times = list(self.batch_times)
        return {"job": self.id, "dataset": self.config.dataset if self.config else None,
                "epoch": self.epoch,
                "batches_planned": self.sampler.planned if self.sampler else 0,
                "batches_per_epoch": self.sampler.n_batches if self.sampler else 0,
                "remaining": self.sampler.remaining if self.sampler else 0,
                "counters": dict(self.counters),
                "mean_batch_s": sum(times) / len(times) if times else None,
                "gpus": self.config.gpus if self.config else None, **self.benefit()}


class DatasetJobs:
    """The jobs of one dataset on this node, its chunk plan, and the cycle as last heard."""

    def __init__(self, ds: MountedDataset, chunk_bytes: float | None,
                 max_chunk_bytes: float | None) -> None:
        self.ds = ds
        if chunk_bytes is None and max_chunk_bytes is not None:
            chunk_bytes = min(default_chunk_bytes(ds.digest.total_bytes), max_chunk_bytes)
        self.plan = make_plan(ds.digest, chunk_bytes)
        self.jobs: dict[str, Job] = {}
        self.view: CycleView | None = None  # the cycle, as the coordinator last said
        self.loaded: list[LoadedShare] = []  # shares this node finished loading
        self.busy: set[str] = set()  # load tasks running, by key
        self.version = -1  # membership version of the last refill
        self.changed = trio.Event()  # set (and replaced) when the cycle moves
        # ((loading chunk, loaders), mask over items of this node's share, its fraction)
        self._share: tuple[tuple[Any, ...], np.ndarray, float] | None = None

    def cycle_key(self) -> tuple[Any, ...] | None:
        return None if self.view is None else self.view.key()

    def usable(self, ref: EpochRef) -> list[int]:
        if self.view is None:
            return []
        if self.mode is not CacheMode.COOP:  # whatever is cached may be used
            return list(range(self.plan.n_chunks))
        return self.view.usable(ref)

    def oldest_usable(self, ref: EpochRef) -> int | None:
        """The oldest resident chunk the job-epoch has items left in (marked, else
        active), whose hits it should take first, in coop mode."""
        if self.view is None or self.mode is not CacheMode.COOP:
            return None
        usable = self.usable(ref)
        for chunk in (self.view.marked, self.view.active):
            if chunk is not None and chunk in usable and ref.remaining_chunks[chunk] > 0:
                return int(chunk)
        return None

    def loader_share(self, me: str) -> tuple[np.ndarray, float] | None:
        """The items of the loading chunk that this node loads (a mask over all items,
        by rendezvous among the loaders) and their share of the chunk; None when no chunk
        loads or this node loads all of it. Another node's share is left to it: a job
        here fetching it too would read it from the bucket twice."""
        view = self.view
        if view is None or view.loading is None or view.loaders == (me,):
            return None
        key = (view.loading, view.loaders)
        if self._share is None or self._share[0] != key:
            members = self.plan.members[view.loading]
            digest = self.ds.digest
            mine = np.array([ownership.owner(digest.hash(int(i)), list(view.loaders)) == me
                             for i in members], dtype=bool)
            mask = np.zeros(len(self.plan.chunk_of), dtype=bool)
            mask[members[mine]] = True
            self._share = (key, mask, float(mine.mean()) if len(mine) else 1.0)
        return self._share[1], self._share[2]

    def upcoming(self) -> int | None:
        """The chunk that starts loading once the marked one is evicted, if none loads."""
        view = self.view
        if view is None or view.loading is not None or self.mode is not CacheMode.COOP:
            return None
        return view.next

    @property
    def mode(self) -> CacheMode:
        """The coordinator's allocation for the dataset."""
        return self.view.mode if self.view is not None else CacheMode.COOP

    def report(self) -> DatasetReport:
        return DatasetReport(
            name=self.ds.name, chunks=self.plan.n_chunks, size=self.ds.digest.total_bytes,
            chunk_bytes=int(max(self.plan.chunk_bytes)), loaded=tuple(self.loaded),
            jobs=tuple(j.report() for j in self.jobs.values()
                       if j.ref is not None and j.config is not None))


class JobManager:
    """Registers jobs, plans their batches, and carries out their chunk cycles."""

    def __init__(self, table: MountTable, reader: ItemReader,
                 chunk_bytes: int | None = None, max_chunk_bytes: float | None = None) -> None:
        self.table = table
        self.reader = reader
        self.chunk_bytes = chunk_bytes
        self.max_chunk_bytes = max_chunk_bytes  # so that two chunks fit a lone node's cache
        self.jobs: dict[str, Job] = {}
        self.groups: dict[str, DatasetJobs] = {}
        self.cluster: Any = None  # mountd.cluster.Cluster, wired by the daemon
        self._nursery: trio.Nursery | None = None

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()

    # -- registration -----------------------------------------------------------------
    def create(self, job_id: str, uid: int, gid: int) -> Job:
        if job_id in self.jobs:
            raise JobError(f"job {job_id!r} exists")
        if uid != 0 and sum(job.uid == uid for job in self.jobs.values()) >= MAX_JOBS_PER_USER:
            raise JobLimit(f"uid {uid} has {MAX_JOBS_PER_USER} jobs: remove one first")
        job = self.jobs[job_id] = Job(job_id, uid, gid)
        return job

    async def configure(self, job: Job, raw: bytes) -> None:
        try:
            cfg = JobConfig.parse(raw)
            ds = self.table.by_name.get(cfg.dataset)
            if ds is None or (job.uid != 0 and ds.reg.uid != job.uid):
                raise JobError(f"unknown dataset {cfg.dataset!r}: mount it first "
                               "('quiver mount DIGEST --name NAME')")
            universe = await trio.to_thread.run_sync(
                image_folder_items, ds, cfg.prefix, cfg.extensions,
                limiter=self.reader.limiter)
            if not len(universe):
                raise JobError(f"no image files under {cfg.dataset}/{cfg.prefix}: check "
                               "the prefix and extensions")
        except JobError as exc:
            job.error = str(exc)
            raise
        if job.group is not None:
            self._leave(job)
        job.config, job.universe, job.error = cfg, universe, ""
        job.epoch, job.sampler, job.ref = -1, None, None
        group = self.groups.get(ds.name)
        if group is None or group.ds is not ds:
            made = await trio.to_thread.run_sync(
                DatasetJobs, ds, self.chunk_bytes, self.max_chunk_bytes,
                limiter=self.reader.limiter)
            group = self.groups.get(ds.name)  # another job may have made it meanwhile
            if group is None or group.ds is not ds:
                group = self.groups[ds.name] = made
        group.jobs[job.id] = job
        job.group = group
        log.info("job %s (uid %d) reads %s/%s: %d items, batch %d, rank %d/%d", job.id,
                 job.uid, cfg.dataset, cfg.prefix, len(universe), cfg.batch_size, cfg.rank,
                 cfg.world_size)

    def remove(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self._leave(job)

    @staticmethod
    def _leave(job: Job) -> None:
        if job.group is not None:
            job.group.jobs.pop(job.id, None)
            job.group = None

    def dataset_removed(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            for job in list(group.jobs.values()):
                job.error = f"dataset {name!r} was unmounted"
                job.group = None
            group.jobs.clear()

    # -- batches ----------------------------------------------------------------------
    async def manifest(self, job: Job, epoch: int, index: int) -> bytes:
        """The manifest of batch ``index`` of ``epoch`` (planning earlier ones first)."""
        async with job.lock:
            if job.config is None or job.group is None:
                raise JobError(job.error or "the job has no config: write its config first")
            if epoch < job.epoch:
                raise JobError(f"epoch {epoch} is over (the job is at epoch {job.epoch})")
            sampler = job.sampler
            if epoch > job.epoch or sampler is None:
                sampler = self._start_epoch(job, job.config, job.group, epoch)
            if index >= sampler.n_batches:
                raise JobError(f"epoch {epoch} has {sampler.n_batches} batches")
            while sampler.planned <= index:
                await self._plan_next(job, job.group, sampler)
            if sampler.planned == index + 1 < sampler.n_batches and self._nursery is not None:
                # plan the next batch while the job's workers read this one
                self._nursery.start_soon(self._plan_ahead, job, sampler)
            return job.manifests[index]

    async def _plan_ahead(self, job: Job, sampler: EpochSampler) -> None:
        async with job.lock:
            if job.sampler is not sampler or job.group is None or (
                    sampler.planned >= sampler.n_batches):
                return  # the job moved on, or left
            try:
                await self._plan_next(job, job.group, sampler)
            except Exception:  # the job's own request for the batch will meet it again
                log.exception("job %s: planning batch %d ahead failed", job.id,
                              sampler.planned)

    @staticmethod
    def _start_epoch(job: Job, cfg: JobConfig, group: DatasetJobs, epoch: int) -> EpochSampler:
        order = epoch_shard(job.universe, cfg.seed, epoch, cfg.rank, cfg.world_size)
        job.epoch = epoch
        job.sampler = EpochSampler(order, cfg.batch_size, seed=cfg.seed + epoch,
                                   scan_factor=cfg.scan_factor, chunk_of=group.plan.chunk_of)
        generation = group.view.generation if group.view is not None else 0
        job.ref = EpochRef(generation, np.bincount(group.plan.chunk_of[order],
                                                   minlength=group.plan.n_chunks))
        job.manifests = {}
        return job.sampler

    async def _plan_next(self, job: Job, group: DatasetJobs, sampler: EpochSampler) -> None:
        ref = job.ref
        digest = group.ds.digest
        chunk_of = group.plan.chunk_of
        probing = job.probe.plan(job.epoch, sampler.planned, sampler.n_batches,
                                 group.mode is not CacheMode.NONE)

        async def is_cached(items: np.ndarray) -> np.ndarray:
            held = np.zeros(len(items), dtype=bool)
            if probing:  # the job must see what it would without the cache
                return held
            usable = np.isin(chunk_of[items], group.usable(ref))
            if usable.any():
                held[usable] = await self._held([digest.hash(int(i)) for i in items[usable]])
            return held

        if not probing:
            await self._wait_for_chunks(job, group, min(sampler.batch_size, sampler.remaining))
        upcoming = group.upcoming()
        loading = group.view.loading if group.view is not None else None
        share = await self._loader_share(group)

        def prefer(items: np.ndarray) -> np.ndarray:
            # Misses in the resident chunks first: this node's share of the loading
            # chunk, and items of the active or marked chunks that were culled
            # (refilling them lets those chunks be consumed, released and replaced).
            # Then the chunk that loads next: its loader will find them held, and other
            # jobs will hit them. Then other nodes' shares of the loading chunk.
            chunks = chunk_of[items]
            rank = 3 * np.isin(chunks, group.usable(ref)) + 2 * (chunks == upcoming)
            if share is not None:
                rank[(chunks == loading) & ~share[0][items]] = 1
            return rank
        # The sampler's steps run in a worker; each block it asks about is looked up
        # from here, between two steps, so no worker waits for another's token.
        steps = sampler.planning(prefer, group.oldest_usable(ref))
        items, batch = await trio.to_thread.run_sync(advance, steps, None,
                                                     limiter=self.reader.limiter)
        while batch is None:
            items, batch = await trio.to_thread.run_sync(advance, steps,
                                                         await is_cached(items),
                                                         limiter=self.reader.limiter)
        if probing:
            await self.reader.force_misses(group.ds, batch.items)
        elif group.mode is not CacheMode.NONE:
            resident = ({*group.usable(ref), upcoming} if group.mode is CacheMode.COOP
                        else None)
            await self._fetch_all(group.ds, batch.fetch, job.counters, resident)
            self.reader.planned([digest.hash(i) for i in batch.hits])
            if self.cluster is not None and self.cluster.peers is not None:
                await self.reader.stage_from_peers(group.ds, batch.hits)
        marked = group.view.marked if group.view is not None else None
        held_marked = marked is not None and ref.remaining_chunks[marked] > 0
        np.subtract.at(ref.remaining_chunks, chunk_of[batch.items], 1)
        if held_marked and not ref.remaining_chunks[marked] and self.cluster is not None:
            self.cluster.poke()  # this job-epoch released the marked chunk
        job.counters["hits"] += len(batch.hits)
        job.counters["fetched"] += len(batch.fetch)
        prefix = job.config.prefix.strip("/")
        cut = len(prefix) + 1 if prefix else 0
        items = batch.items
        job.manifests[batch.index] = json.dumps({
            "epoch": job.epoch, "batch": batch.index, "hits": len(batch.hits),
            "paths": [digest.path(i)[cut:] for i in items],
            "labels": [digest.label(i) for i in items],
            "hashes": [digest.hash(i).hex() for i in items]}).encode()

    async def _loader_share(self, group: DatasetJobs) -> tuple[np.ndarray, float] | None:
        if self.cluster is None:
            return None
        return await trio.to_thread.run_sync(group.loader_share, self.cluster.me,
                                             limiter=self.reader.limiter)

    async def _wait_for_chunks(self, job: Job, group: DatasetJobs, need: int) -> None:
        """In coop mode, wait (at most CHUNK_WAIT) until the usable chunks hold ``need``
        of the job's pending items: cached, or for this node to load. Until then its
        batch would be filled with misses that no other job shares now (or that another
        node is loading), so the bucket's bandwidth is better left to the loaders. A
        job with items left in the marked chunk never waits: its batches release it."""
        started = trio.current_time()
        key = group.cycle_key()
        with trio.move_on_after(CHUNK_WAIT) as scope:
            while (group.mode is CacheMode.COOP and group.view is not None
                   and key != job.gave_up_on):
                usable = group.usable(job.ref)
                marked, loading = group.view.marked, group.view.loading
                supply = int(job.ref.remaining_chunks[usable].sum())
                share = await self._loader_share(group)
                if share is not None and loading in usable:  # others' shares: once held
                    pending = job.sampler.pending_in(loading)
                    others = pending[~share[0][pending]]
                    held = await self._held([group.ds.digest.hash(int(i)) for i in others])
                    supply -= len(others) - sum(held)
                if (supply >= need
                        or marked in usable and job.ref.remaining_chunks[marked] > 0):
                    break  # enough to plan from, or the job holds back the marked chunk
                with trio.move_on_after(WAIT_POLL if share is not None else math.inf):
                    await group.changed.wait()
                key = group.cycle_key()
        if scope.cancelled_caught:
            job.gave_up_on = key
            log.info("job %s: no chunk came in %.0f s; fetching misses", job.id, CHUNK_WAIT)
        job.counters["chunk_wait_s"] += trio.current_time() - started

    async def _held(self, hashes: list[bytes]) -> list[bool]:
        """Which hashes their owners hold (this node's store, or a peer's); a peer that
        cannot be asked counts as holding nothing."""
        by_owner: dict[str | None, list[int]] = collections.defaultdict(list)
        for pos, h in enumerate(hashes):
            by_owner[self.reader.owner(h)].append(pos)
        out = [False] * len(hashes)
        for node, positions in by_owner.items():
            wanted = [hashes[p] for p in positions]
            if node is None:
                store = self.reader.store
                found = await trio.to_thread.run_sync(
                    lambda: [h in store for h in wanted], limiter=self.reader.limiter)
            else:
                try:
                    found = await self.cluster.peers.lookup(node, wanted)
                except Unavailable:
                    continue
            for p, f in zip(positions, found):
                out[p] = bool(f)
        return out

    async def _fetch_all(self, ds: MountedDataset, items: list[int],
                         counters: collections.Counter[str],
                         resident: set[int] | None = None) -> None:
        """Fetch items into the cache; with ``resident`` (coop mode), items of other
        chunks are only staged for their one read, so they cannot evict the chunks."""
        if not items:
            return
        slots = trio.Semaphore(FETCH_CONCURRENCY)
        chunk_of = self.groups[ds.name].plan.chunk_of if resident is not None else None

        async def one(i: int) -> None:
            async with slots:
                try:
                    if chunk_of is not None and int(chunk_of[i]) not in resident:
                        await self.reader.stage(ds, i)
                    else:
                        await self.reader.fetch(ds, i)
                except ReadFailed:
                    counters["fetch_errors"] += 1  # the worker's own read will report it

        async with trio.open_nursery() as nursery:
            for i in items:
                nursery.start_soon(one, i)

    # -- chunk cycle ------------------------------------------------------------------
    def report(self) -> dict[str, dict[str, Any]]:
        """What the coordinator needs, per dataset identity with jobs here."""
        return {g.ds.reg.identity: g.report() for g in self.groups.values() if g.jobs}

    async def apply(self, cycles: dict[str, CycleView], version: int) -> None:
        """Act on the coordinator's answer: load shares, drop evicted chunks, refill."""
        me = self.cluster.me
        for group in list(self.groups.values()):
            view = cycles.get(group.ds.reg.identity)
            if view is None:
                continue
            before = group.cycle_key()
            previous, group.view = group.view, view
            if group.cycle_key() != before:
                group.changed.set()
                group.changed = trio.Event()
            group.ds.cache_mode = view.mode
            for job in group.jobs.values():
                seq = view.probes.get(job.id, 0)
                if seq > job.probe.seq:
                    job.probe.begin(seq, view.probe_batches)
                    log.info("job %s: probe %d of %d batches", job.id, seq,
                             view.probe_batches)
            if view.loading is not None and me in view.loaders:
                share = LoadedShare(view.loading, view.loaders)
                if share not in group.loaded:
                    self._spawn(group, f"load {view.loading}", view.loading, view.loaders,
                                share)
            if previous is not None:
                for chunk, (old, new) in enumerate(zip(previous.states, view.states)):
                    if old is not ChunkState.EVICTED and new is ChunkState.EVICTED:
                        await self._evict_local(group, chunk)
            if version != group.version and view.active is not None and me in view.users:
                if group.version >= 0:  # membership changed: owners moved, refill
                    self._spawn(group, f"refill {version}", view.active, view.users, None)
                group.version = version

    def _spawn(self, group: DatasetJobs, name: str, chunk: int, loaders: tuple[str, ...],
               share: LoadedShare | None) -> None:
        if name in group.busy or self._nursery is None:
            return
        group.busy.add(name)
        self._nursery.start_soon(self._load_share, group, name, chunk, loaders, share,
                                 name=f"{group.ds.name}: {name}")

    async def _load_share(self, group: DatasetJobs, name: str, chunk: int,
                          loaders: tuple[str, ...], share: LoadedShare | None) -> None:
        """Fetch this node's share of a chunk (rendezvous among the loaders) into its
        owners' stores; report the share done."""
        try:
            me = self.cluster.me
            digest = group.ds.digest
            mine = await trio.to_thread.run_sync(
                lambda: [int(i) for i in group.plan.members[chunk]
                         if ownership.owner(digest.hash(int(i)), list(loaders)) == me],
                limiter=self.reader.limiter)
            counters: collections.Counter[str] = collections.Counter()
            for start in range(0, len(mine), CHECK_BLOCK):
                block = mine[start:start + CHECK_BLOCK]
                held = await self._held([digest.hash(i) for i in block])
                await self._fetch_all(group.ds, [i for i, h in zip(block, held) if not h],
                                      counters)
            if share is not None:
                group.loaded.append(share)
                del group.loaded[:-4]  # the coordinator only asks about the current one
                self.cluster.poke()
            log.info("dataset %s: %s done (%d items of chunk %d)", group.ds.name, name,
                     len(mine), chunk)
        finally:
            group.busy.discard(name)

    async def _evict_local(self, group: DatasetJobs, chunk: int) -> None:
        """Drop this node's copies of an evicted chunk (keeping items resident chunks
        share, and hits that manifests promised and were not read yet: the store's LRU
        drops those later)."""
        view, digest, store = group.view, group.ds.digest, self.reader.store
        resident = [c for c in (view.active, view.loading, view.marked) if c is not None]

        def drop() -> None:
            keep = {digest.hash(int(i)) for c in resident for i in group.plan.members[c]}
            for h in (digest.hash(int(i)) for i in group.plan.members[chunk]):
                if h not in keep and not self.reader.awaiting_read(h):
                    store.discard(h)

        await trio.to_thread.run_sync(drop, limiter=self.reader.limiter)
        log.info("dataset %s: chunk %d evicted here", group.ds.name, chunk)

    def status(self, uid: int) -> list[dict[str, Any]]:
        return [{**job.stats(),
                 "chunks": to_wire(job.group.view) if job.group and job.group.view else None}
                for job in self.jobs.values() if uid == 0 or job.uid == uid]

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

from mountd.chunk_cycle import ChunkCycle, EpochRef
from mountd.dataset import MountedDataset
from mountd.item_reader import ItemReader, ReadFailed
from mountd.mount_table import MountTable
from mountd.substitution import DEFAULT_SCAN_FACTOR, EpochSampler, epoch_shard
from quiverfs.chunk_plan import make_plan

log = logging.getLogger(__name__)

FETCH_CONCURRENCY = 16  # misses fetched at once for one batch or one chunk load
CYCLE_TICK = 0.2  # seconds between chunk-cycle checks
CHECK_BLOCK = 512  # items whose store membership is checked per thread call
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff",
                    ".webp")  # torchvision's IMG_EXTENSIONS


class JobError(Exception):
    """A job request that cannot be served; the message says why and what to do."""


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
            if key in data and (not isinstance(data[key], int) or isinstance(data[key], bool)):
                raise JobError(f"{key} must be an integer, not {data[key]!r}")
        if "extensions" in data:
            data["extensions"] = tuple(str(e).lower() for e in data["extensions"])
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
                "mean_batch_s": sum(times) / len(times) if times else None}


class DatasetJobs:
    """The jobs of one dataset, its chunk plan and cycle, and the task driving it."""

    def __init__(self, ds: MountedDataset, chunk_bytes: int | None, force_after: float) -> None:
        self.ds = ds
        self.plan = make_plan(ds.digest, chunk_bytes)
        self.cycle = ChunkCycle(self.plan, force_after)
        self.jobs: dict[str, Job] = {}
        self.wake = trio.Event()
        self.loaded_items = 0

    def refs(self) -> list[EpochRef]:
        return [j.ref for j in self.jobs.values() if j.ref is not None]


class JobManager:
    """Registers jobs, plans their batches, and runs their datasets' chunk cycles."""

    def __init__(self, table: MountTable, reader: ItemReader,
                 chunk_bytes: int | None = None, force_after: float = 120.0) -> None:
        self.table = table
        self.reader = reader
        self.chunk_bytes = chunk_bytes
        self.force_after = force_after
        self.jobs: dict[str, Job] = {}
        self.groups: dict[str, DatasetJobs] = {}
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
            group = self.groups[ds.name] = DatasetJobs(ds, self.chunk_bytes, self.force_after)
            if self._nursery is not None:
                self._nursery.start_soon(self._drive, group, name=f"chunks {ds.name}")
        group.jobs[job.id] = job
        job.group = group
        log.info("job %s (uid %d) reads %s/%s: %d items, batch %d, rank %d/%d", job.id,
                 job.uid, cfg.dataset, cfg.prefix, len(universe), cfg.batch_size, cfg.rank,
                 cfg.world_size)

    def remove(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self._leave(job)

    def _leave(self, job: Job) -> None:
        if job.group is not None:
            job.group.jobs.pop(job.id, None)
            job.group.wake.set()
            job.group = None

    def dataset_removed(self, name: str) -> None:
        group = self.groups.pop(name, None)
        if group is not None:
            for job in list(group.jobs.values()):
                job.error = f"dataset {name!r} was unmounted"
                job.group = None
            group.jobs.clear()
            group.wake.set()

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
            return job.manifests[index]

    @staticmethod
    def _start_epoch(job: Job, cfg: JobConfig, group: DatasetJobs, epoch: int) -> EpochSampler:
        order = epoch_shard(job.universe, cfg.seed, epoch, cfg.rank, cfg.world_size)
        job.epoch = epoch
        job.sampler = EpochSampler(order, cfg.batch_size, seed=cfg.seed + epoch,
                                   scan_factor=cfg.scan_factor)
        job.ref = EpochRef(group.cycle.generation, np.bincount(
            group.plan.chunk_of[order], minlength=group.plan.n_chunks))
        job.manifests = {}
        group.wake.set()
        return job.sampler

    async def _plan_next(self, job: Job, group: DatasetJobs, sampler: EpochSampler) -> None:
        ref = job.ref
        digest, store = group.ds.digest, self.reader.store
        chunk_of = group.plan.chunk_of

        def is_cached(items: np.ndarray) -> np.ndarray:
            usable = np.isin(chunk_of[items], group.cycle.usable(ref))
            return np.array([u and digest.hash(int(i)) in store
                             for i, u in zip(items, usable)], dtype=bool)

        def prefer(items: np.ndarray) -> np.ndarray:
            loading = group.cycle.loading
            return chunk_of[items] == (loading if loading is not None else -1)

        batch = await trio.to_thread.run_sync(sampler.plan, is_cached, prefer,
                                              limiter=self.reader.limiter)
        await self._fetch_all(group.ds, batch.fetch, job.counters)
        np.subtract.at(ref.remaining_chunks, chunk_of[batch.items], 1)
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
        group.wake.set()

    async def _fetch_all(self, ds: MountedDataset, items: list[int],
                         counters: collections.Counter[str]) -> None:
        slots = trio.Semaphore(FETCH_CONCURRENCY)

        async def one(i: int) -> None:
            async with slots:
                try:
                    await self.reader.fetch(ds, i)
                except ReadFailed:
                    counters["fetch_errors"] += 1  # the worker's own read will report it

        async with trio.open_nursery() as nursery:
            for i in items:
                nursery.start_soon(one, i)

    # -- chunk cycle ------------------------------------------------------------------
    async def _drive(self, group: DatasetJobs) -> None:
        """Load chunks in turn while the dataset has jobs; evict marked ones."""
        cycle = group.cycle
        while self.groups.get(group.ds.name) is group:
            if group.jobs:
                chunk = cycle.start_loading()
                if chunk is not None:
                    await self._load(group, chunk)
                    cycle.loaded()
                victim = cycle.evictable(group.refs())
                if victim is not None:
                    await self._evict(group, victim)
                    continue
            group.wake = trio.Event()
            with trio.move_on_after(CYCLE_TICK):
                await group.wake.wait()

    async def _load(self, group: DatasetJobs, chunk: int) -> None:
        """One pass over the chunk's items, fetching those not in the store."""
        members = group.plan.members[chunk]
        digest, store = group.ds.digest, self.reader.store
        counters: collections.Counter[str] = collections.Counter()
        for start in range(0, len(members), CHECK_BLOCK):
            block = members[start:start + CHECK_BLOCK]
            missing = await trio.to_thread.run_sync(
                lambda: [int(i) for i in block if digest.hash(int(i)) not in store],
                limiter=self.reader.limiter)
            await self._fetch_all(group.ds, missing, counters)
            group.loaded_items += len(block)
        log.info("dataset %s: chunk %d loaded (%d items)", group.ds.name, chunk, len(members))

    async def _evict(self, group: DatasetJobs, chunk: int) -> None:
        keep = set()
        for c in (group.cycle.active, group.cycle.loading):
            if c is not None:
                keep.update(group.ds.digest.hash(int(i)) for i in group.plan.members[c])
        hashes = [h for h in (group.ds.digest.hash(int(i)) for i in group.plan.members[chunk])
                  if h not in keep]
        store = self.reader.store
        await trio.to_thread.run_sync(lambda: [store.discard(h) for h in hashes],
                                      limiter=self.reader.limiter)
        group.cycle.evicted(chunk)
        log.info("dataset %s: chunk %d evicted", group.ds.name, chunk)

    def status(self, uid: int) -> list[dict[str, Any]]:
        return [{**job.stats(),
                 "chunks": job.group.cycle.snapshot() if job.group else None}
                for job in self.jobs.values() if uid == 0 or job.uid == uid]

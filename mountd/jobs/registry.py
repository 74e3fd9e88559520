"""Jobs that opted into substitutable reads: their registration and configs.

A job (one rank of a training run) is created by ``mkdir ROOT/.quiver/jobs/JOB`` and
configured by writing its ``config``; it then belongs to the DatasetJobs of the dataset
it reads, where the batch planner and the chunk loader find it.
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

from mountd.datasets.dataset import MountedDataset
from mountd.datasets.mount_table import MountTable
from mountd.datasets.tree import DatasetTree
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.jobs.epoch_plan import EpochPlan
from mountd.jobs.probing import BenefitProbe
from quiverfs.counters import SamplerJobCounter
from quiverfs.heartbeat import JobReport, to_wire
from quiverfs.job_protocol import DEFAULT_SCAN_FACTOR

log = logging.getLogger(__name__)

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
    # The job's items, one of two ways: files in a class directory under the prefix whose
    # names end in one of ``extensions`` (DatasetFolder's rule), or, where ``paths`` is
    # set, the ``paths`` files listed in JOB/paths (mountd.fs.job_files), relative to the prefix.
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS
    paths: int | None = None
    scan_factor: int = DEFAULT_SCAN_FACTOR
    gpus: int = 1
    # Epochs the job runs (0 .. epochs - 1), where it says: none after them is planned
    # (BatchPlanner.manifest refuses one). None: not said, any epoch may follow.
    epochs: int | None = None

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
        ints = ("batch_size", "seed", "rank", "world_size", "scan_factor", "gpus", "paths",
                "epochs")
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
        if "paths" in data:
            if "extensions" in data:
                raise JobError("the job config names 'extensions' and 'paths': select the "
                               "files by one of them")
            if data["paths"] < 1:
                raise JobError("paths (the number of paths written to JOB/paths) must be "
                               "at least 1")
            data["extensions"] = ()
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
        if cfg.epochs is not None and cfg.epochs < 1:
            raise JobError("epochs (how many the job runs) must be at least 1")
        return cfg


def folder_items(ds: MountedDataset, prefix: str, extensions: tuple[str, ...]
                 ) -> np.ndarray:
    """The entries DatasetFolder(ROOT/NAME/prefix, extensions=...) lists (ImageFolder's
    with image extensions): files under a class directory whose names end in one of
    ``extensions``."""
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


def listed_items(ds: MountedDataset, prefix: str, listed: bytes | bytearray, count: int
                 ) -> np.ndarray:
    """The entries (sorted) of the ``count`` files listed in ``listed``: JOB/paths, one
    path a line relative to ``prefix``. JobError where the list is not UTF-8, does not
    hold ``count`` paths, or names a file twice or one the digest does not hold."""
    try:
        text = listed.decode()
    except UnicodeDecodeError as exc:
        line = listed.count(b"\n", 0, exc.start) + 1
        raise JobError(f"JOB/paths is not UTF-8 (line {line}, byte {exc.start}): write "
                       "the paths as UTF-8, one a line") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()  # the newline that ends the last path
    where = f"{ds.name}/{prefix.strip('/')}".rstrip("/")
    if len(lines) != count:
        raise JobError(f"JOB/paths holds {len(lines)} paths, the config says {count}: "
                       "open JOB/paths and write the whole list, then the config")
    tree = ds.tree
    top: int | None = 0
    for part in filter(None, prefix.split("/")):
        top = tree.lookup(top, part) if top is not None and tree.is_dir(top) else None
    if top is None or not tree.is_dir(top):
        raise JobError(f"{where} is not a directory of the mounted digest: check the "
                       "sampler's root")
    dirs: dict[str, int | None] = {"": top}
    found = np.empty(count, dtype=np.int64)
    missing: list[int] = []
    for n, path in enumerate(lines):
        dirname, _, name = path.rpartition("/")
        parent = dirs.get(dirname, -1)
        if parent == -1:
            parent = dirs[dirname] = _resolve_dir(tree, top, dirname)
        node = tree.lookup(parent, name) if parent is not None else None
        if node is None or tree.is_dir(node):
            missing.append(n)
        else:
            found[n] = tree.entry_index(node)
    if missing:
        bad = next((n for n in missing if _path_problem(lines[n])), None)
        if bad is not None:
            raise JobError(f"JOB/paths line {bad + 1}: {lines[bad]!r} "
                           f"{_path_problem(lines[bad])}: list paths relative to {where}")
        raise JobError(f"{len(missing)} of the {count} paths in JOB/paths are not files of "
                       f"the mounted digest under {where} (such as {lines[missing[0]]!r}): "
                       "the sampler reads only files the digest holds; make and mount a "
                       "digest that has them ('quiver digest create'), or leave them out "
                       "of the dataset")
    items, first, counts = np.unique(found, return_index=True, return_counts=True)
    if len(items) != count:
        twice = lines[first[np.argmax(counts > 1)]]
        raise JobError(f"JOB/paths lists {twice!r} more than once: the sampler yields "
                       "each file once an epoch, so list each file once")
    return items


def _resolve_dir(tree: DatasetTree, top: int, dirname: str) -> int | None:
    """The directory node of ``dirname`` below node ``top``, or None."""
    node: int | None = top
    for part in dirname.split("/"):
        node = tree.lookup(node, part)
        if node is None or not tree.is_dir(node):
            return None
    return node


def _path_problem(path: str) -> str | None:
    """Why ``path`` is not a relative path in canonical form, or None."""
    if not path:
        return "is empty"
    if "\0" in path:
        return "holds a NUL byte"
    if path.startswith("/"):
        return "is absolute"
    if any(part in ("", ".", "..") for part in path.split("/")):
        return "has an empty, '.' or '..' component"
    return None


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
        self.plan: EpochPlan | None = None  # the current epoch's, as the planner keeps it
        self.lock = trio.Lock()
        self.counters: collections.Counter[SamplerJobCounter] = collections.Counter()
        self.batch_times: collections.deque[float] = collections.deque(maxlen=1000)
        self.probe = BenefitProbe(on_end=self._probe_ended)

    def _probe_ended(self) -> None:
        """The chunk loader waits for a lone job's probe to end."""
        if self.group is not None:
            self.group.poke()

    def record_time(self, epoch: int, batch: int, seconds: float) -> None:
        """The time the job reported between asking for batch - 1 and ``batch``."""
        self.batch_times.append(seconds)
        self.counters[SamplerJobCounter.REPORTED_BATCHES] += 1
        self.probe.record(epoch, batch, seconds)

    def report(self) -> JobReport | None:
        """What the coordinator needs of the job; None until its epoch has begun."""
        if self.plan is None or self.config is None:
            return None
        t_miss, t_hit = self.probe.times()
        ref = self.plan.ref
        return JobReport(id=self.id, gen=ref.started_generation, gpus=self.config.gpus,
                         remaining=tuple(int(n) for n in ref.remaining_chunks),
                         probe_seq=self.probe.seq, t_miss=t_miss, t_hit=t_hit,
                         probing=self.probe.active, batch_bytes=self.batch_bytes())

    def batch_bytes(self) -> int:
        """Bytes of one of its batches, at its dataset's mean item size; 0 before its
        epoch began."""
        if self.plan is None or self.group is None:
            return 0
        return self.plan.sampler.batch_size * self.group.ds.mean_item_bytes

    @staticmethod
    def kept_for(items: np.ndarray) -> np.ndarray:
        """Which of an evicted chunk's ``items`` to keep for the job: none, as a sampler
        job takes hits only from the chunks it may use."""
        return np.zeros(len(items), dtype=bool)

    def benefit(self) -> dict[str, Any]:
        """t_miss and t_hit (seconds per batch) as the last probe measured them."""
        t_miss, t_hit = self.probe.times()
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
        sampler = self.plan.sampler if self.plan is not None else None
        return {"job": self.id, "dataset": self.config.dataset if self.config else None,
                "epoch": self.plan.epoch if self.plan is not None else -1,
                "batches_planned": sampler.planned if sampler else 0,
                "batches_per_epoch": sampler.n_batches if sampler else 0,
                "remaining": sampler.remaining if sampler else 0,
                "counters": dict(self.counters),
                "mean_batch_s": sum(times) / len(times) if times else None,
                "gpus": self.config.gpus if self.config else None, **self.benefit()}


class JobRegistry:
    """The registered jobs, by id, and the DatasetJobs of each dataset they read."""

    def __init__(self, table: MountTable, limiter: trio.CapacityLimiter,
                 chunk_bytes: int | None = None, max_chunk_bytes: float | None = None) -> None:
        self.table = table
        self.limiter = limiter
        self.chunk_bytes = chunk_bytes
        self.max_chunk_bytes = max_chunk_bytes  # so that several chunks fit a lone node's cache
        self.jobs: dict[str, Job] = {}
        self.groups: dict[str, DatasetJobs] = {}
        # per dataset name: held while its DatasetJobs is made, so that the jobs that
        # open it together wait for one chunk plan, not each compute its own
        self._making: dict[str, trio.Lock] = collections.defaultdict(trio.Lock)

    def create(self, job_id: str, uid: int, gid: int) -> Job:
        if job_id in self.jobs:
            raise JobError(f"job {job_id!r} exists")
        if uid != 0 and sum(job.uid == uid for job in self.jobs.values()) >= MAX_JOBS_PER_USER:
            raise JobLimit(f"uid {uid} has {MAX_JOBS_PER_USER} jobs: remove one first")
        job = self.jobs[job_id] = Job(job_id, uid, gid)
        return job

    async def configure(self, job: Job, raw: bytes,
                        listed: bytes | bytearray | None = None) -> None:
        """Configure ``job`` from its config write; ``listed`` is what was written to its
        JOB/paths, for a config that names ``paths``."""
        try:
            cfg = JobConfig.parse(raw)
            ds = self.table.by_name.get(cfg.dataset)
            if ds is None or (job.uid != 0 and ds.reg.uid != job.uid):
                raise JobError(f"unknown dataset {cfg.dataset!r}: mount it first "
                               "('quiver mount DIGEST --name NAME')")
            if ds.pools is not None:
                raise JobError(f"{cfg.dataset!r} is a substitutable view, which substitutes "
                               "by itself: give the sampler an exact mount of the digest")
            if cfg.paths is not None:
                universe = await trio.to_thread.run_sync(
                    listed_items, ds, cfg.prefix, listed or b"", cfg.paths,
                    limiter=self.limiter)
            else:
                universe = await trio.to_thread.run_sync(
                    folder_items, ds, cfg.prefix, cfg.extensions, limiter=self.limiter)
            if not len(universe):
                where = f"{cfg.dataset}/{cfg.prefix.strip('/')}".rstrip("/")
                raise JobError(f"no files ending in {' '.join(cfg.extensions) or '(none)'} "
                               f"in a class directory under {where}: check the prefix and "
                               "extensions, or list the files (JOB/paths)")
        except JobError as exc:
            job.error = str(exc)
            raise
        if job.group is not None:
            self._leave(job)
        job.config, job.universe, job.error = cfg, universe, ""
        job.plan = None
        group = await self.group_for(ds)
        job.group = group
        group.add(job)
        log.info("job %s (uid %d) reads %s/%s: %d items, batch %d, rank %d/%d", job.id,
                 job.uid, cfg.dataset, cfg.prefix, len(universe), cfg.batch_size, cfg.rank,
                 cfg.world_size)

    async def group_for(self, ds: MountedDataset) -> DatasetJobs:
        """The DatasetJobs of ``ds``, made (its chunk plan computed) at its first job."""
        async with self._making[ds.name]:
            group = self.groups.get(ds.name)
            if group is None or group.ds is not ds:
                group = self.groups[ds.name] = await trio.to_thread.run_sync(
                    DatasetJobs, ds, self.chunk_bytes, self.max_chunk_bytes,
                    limiter=self.limiter)
        return group

    def remove(self, job: Job) -> None:
        self.jobs.pop(job.id, None)
        self._leave(job)

    @staticmethod
    def _leave(job: Job) -> None:
        if job.group is not None:
            group, job.group = job.group, None
            group.discard(job.id)

    def dataset_removed(self, name: str) -> None:
        self._making.pop(name, None)
        group = self.groups.pop(name, None)
        if group is not None:
            for job in list(group.jobs.values()):
                job.error = f"dataset {name!r} was unmounted"
                job.group = None
            group.jobs.clear()
            group.poke()

    def status(self, uid: int) -> list[dict[str, Any]]:
        return [{**job.stats(),
                 "chunks": to_wire(job.group.view) if job.group and job.group.view else None}
                for job in self.jobs.values() if uid == 0 or job.uid == uid]

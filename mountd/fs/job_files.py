"""The control area ``ROOT/.quiver/jobs``: how a training job talks to mountd.

    mkdir ROOT/.quiver/jobs/JOB          register a job (the directory is yours, 0700)
    JOB/paths       write-only: the job's files, one UTF-8 path a line relative to the
                    prefix, for a config that selects its files by list rather than by
                    extensions; each open for writing starts a new list, and the next
                    config write takes it (so write it again before each config)
    JOB/config      write one JSON object (one write call): dataset, batch_size, seed,
                    rank, world_size, prefix, optionally epochs (how many the job
                    runs: no batch after them is planned), and either extensions
                    (DatasetFolder's rule; torchvision's image extensions where neither
                    is given) or paths (the number of lines in JOB/paths); read it back
                    with universe and batches_per_epoch
    JOB/eE-bI       read: the manifest (JSON) of mini-batch I of epoch E (with the
                    batches after it, where it hands out a segment: mountd.jobs.planner)
    JOB/report      write lines "EPOCH BATCH SECONDS": per-batch times (for probing)
    JOB/next        the same manifests through one open file (read-write): a write of
                    report lines that ends with a line "EPOCH BATCH" asks for that
                    batch's manifest, which this open file's reads then return (from
                    offset 0); two requests a manifest, where a file per batch takes a
                    lookup, an open, a read and a release, and its report a write
    JOB/error       read: why the last config write or batch read failed
    JOB/stats       read: progress and hit counters (JSON)
    rmdir ROOT/.quiver/jobs/JOB          unregister

Inode numbers encode what a file is, so no per-file state lives in mountd; the one
exception is the JOB/paths list, held until a config takes it: the kernel splits a large
write into WRITE requests of up to 128 KiB, which may arrive out of order, so pieces are
placed by offset. Any local user may write there (mountd runs as root): a list is bounded
per job and per uid (``MAX_PATHS_BYTES``...), and what a config cannot use is refused
with EINVAL and a reason in JOB/error.
"""
from __future__ import annotations

import errno
import json
import logging
import stat
import time
from collections import Counter

import pyfuse3

from mountd.jobs.planner import BatchPlanner
from mountd.jobs.registry import Job, JobError, JobLimit, JobRegistry
from quiverfs.heartbeat import MAX_BATCH_SECONDS
from quiverfs.job_protocol import ASK, BATCH_NAME, JOB_FILES, JOB_NAME, JOBS_NAME

log = logging.getLogger(__name__)

CONTROL_INODE = 2  # ROOT/.quiver
JOBS_INODE = 3  # ROOT/.quiver/jobs
_JOB_BASE = 1 << 60  # + job number * 8 + file kind
_BATCH_BASE = 1 << 61  # | job number << 36 | epoch << 20 | batch
# index = inode offset (0: dir), at most 7
_KINDS = ("", *JOB_FILES)
TIMEOUT = 1.0  # seconds the kernel may cache control entries
MAX_PATHS_BYTES = 128 << 20  # one job's JOB/paths: some 3 million paths of 40 bytes
MAX_PATHS_BYTES_PER_USER = 256 << 20  # a uid's (not root's) lists no config has taken yet


class PathLists:
    """The JOB/paths lists written and not yet taken by a config write, bounded per job
    and per uid. A list that broke a bound is refused until the job opens JOB/paths again."""

    def __init__(self) -> None:
        self._lists: dict[Job, bytearray] = {}
        self._refused: dict[Job, str] = {}
        self._bytes: Counter[int] = Counter()  # uid -> bytes held in its jobs' lists

    def start(self, job: Job) -> None:
        """Opening JOB/paths for writing begins a new list."""
        self.drop(job)

    def drop(self, job: Job) -> None:
        data = self._lists.pop(job, None)
        if data is not None:
            self._bytes[job.uid] -= len(data)
            if not self._bytes[job.uid]:
                del self._bytes[job.uid]
        self._refused.pop(job, None)

    def write(self, job: Job, off: int, buf: bytes) -> None:
        """Place ``buf`` at ``off``; JobError (and the list refused) past a bound."""
        if job in self._refused:
            raise JobError(self._refused[job])
        end = off + len(buf)
        data = self._lists.get(job)
        grow = max(0, end - (len(data) if data is not None else 0))
        if end > MAX_PATHS_BYTES:
            self._refuse(job, f"JOB/paths holds at most {MAX_PATHS_BYTES} bytes, and a write "
                              f"reached byte {end}: select the files by extensions (a "
                              "DatasetFolder), or sample a part of the dataset per job")
        if job.uid != 0 and self._bytes[job.uid] + grow > MAX_PATHS_BYTES_PER_USER:
            self._refuse(job, f"uid {job.uid}'s path lists not yet taken by a config hold "
                              f"{self._bytes[job.uid]} bytes, and this write would pass "
                              f"{MAX_PATHS_BYTES_PER_USER}: write each job's config after "
                              "its paths, or remove idle jobs")
        if data is None:
            data = self._lists[job] = bytearray()
        if grow:
            data.extend(bytes(grow))  # a hole stays NUL bytes: a bad path if never filled
            self._bytes[job.uid] += grow
        data[off:end] = buf

    def take(self, job: Job) -> bytearray | None:
        """The job's list, for the config being written (which frees it); JobError if the
        list was refused."""
        refused = self._refused.get(job)
        data = self._lists.get(job)
        self.drop(job)
        if refused is not None:
            job.error = refused
            raise JobError(refused)
        return data

    def _refuse(self, job: Job, why: str) -> None:
        self.drop(job)
        self._refused[job] = job.error = why
        log.info("job %s (uid %d): %s", job.id, job.uid, why)
        raise JobError(why)


class ControlFiles:
    """Inodes, attributes and I/O of the control area."""

    def __init__(self, jobs: JobRegistry, planner: BatchPlanner) -> None:
        self.jobs = jobs
        self.planner = planner
        self._numbers: dict[str, int] = {}  # job id -> number
        self._by_number: dict[int, Job] = {}
        self.lists = PathLists()
        self._next = 1
        self.started_ns = time.time_ns()

    @staticmethod
    def owns(inode: int) -> bool:
        return inode in (CONTROL_INODE, JOBS_INODE) or inode >= _JOB_BASE

    # -- naming -----------------------------------------------------------------------
    def _job_of(self, inode: int) -> tuple[Job, str, int, int]:
        """(job, kind, epoch, batch) for a job inode; kind "batch" for batch files."""
        if inode >= _BATCH_BASE:
            number, epoch, batch = ((inode >> 36) & 0xFFFFFF, (inode >> 20) & 0xFFFF,
                                    inode & 0xFFFFF)
            kind = "batch"
        else:
            number, offset = divmod(inode - _JOB_BASE, 8)
            if offset >= len(_KINDS):
                raise pyfuse3.FUSEError(errno.ENOENT)
            kind, epoch, batch = _KINDS[offset] or "dir", 0, 0
        job = self._by_number.get(number)
        if job is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        return job, kind, epoch, batch

    def _job_inode(self, job: Job, kind: str = "") -> int:
        return _JOB_BASE + self._numbers[job.id] * 8 + _KINDS.index(kind)

    # -- attributes -------------------------------------------------------------------
    def _attr(self, inode: int, mode: int, uid: int = 0, gid: int = 0,
              size: int = 0) -> pyfuse3.EntryAttributes:
        attr = pyfuse3.EntryAttributes()
        attr.st_ino = inode
        attr.st_mode = mode
        attr.st_nlink = 2 if stat.S_ISDIR(mode) else 1
        attr.st_uid, attr.st_gid, attr.st_size = uid, gid, size
        attr.st_atime_ns = attr.st_mtime_ns = attr.st_ctime_ns = self.started_ns
        attr.attr_timeout = attr.entry_timeout = TIMEOUT
        return attr

    def getattr(self, inode: int) -> pyfuse3.EntryAttributes:
        if inode == CONTROL_INODE:
            return self._attr(inode, stat.S_IFDIR | 0o555)
        if inode == JOBS_INODE:
            return self._attr(inode, stat.S_IFDIR | 0o1777)
        job, kind, _, _ = self._job_of(inode)
        if kind == "dir":
            return self._attr(inode, stat.S_IFDIR | 0o700, job.uid, job.gid)
        mode = {"config": 0o600, "report": 0o600, "next": 0o600, "paths": 0o200}.get(
            kind, 0o400)
        return self._attr(inode, stat.S_IFREG | mode, job.uid, job.gid)

    def lookup(self, parent: int, name: str) -> pyfuse3.EntryAttributes:
        if parent == CONTROL_INODE and name == JOBS_NAME:
            return self.getattr(JOBS_INODE)
        if parent == JOBS_INODE:
            job = self.jobs.jobs.get(name)
            if job is None or name not in self._numbers:
                raise pyfuse3.FUSEError(errno.ENOENT)
            return self.getattr(self._job_inode(job))
        job, kind, _, _ = self._job_of(parent)
        if kind != "dir":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        if name in _KINDS[1:]:
            return self.getattr(self._job_inode(job, name))
        m = BATCH_NAME.fullmatch(name)
        if m is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        inode = (_BATCH_BASE | self._numbers[job.id] << 36 | int(m.group(1)) << 20
                 | int(m.group(2)))
        return self.getattr(inode)

    def entries(self, inode: int, uid: int) -> list[tuple[bytes, int]]:
        if inode == CONTROL_INODE:
            return [(JOBS_NAME.encode(), JOBS_INODE)]
        if inode == JOBS_INODE:
            return [(job.id.encode(), self._job_inode(job)) for job in self.jobs.jobs.values()
                    if uid in (0, job.uid) and job.id in self._numbers]
        job, kind, _, _ = self._job_of(inode)
        if kind != "dir":
            raise pyfuse3.FUSEError(errno.ENOTDIR)
        return [(k.encode(), self._job_inode(job, k)) for k in _KINDS[1:]]

    # -- directories ------------------------------------------------------------------
    def mkdir(self, parent: int, name: str, ctx: pyfuse3.RequestContext
              ) -> pyfuse3.EntryAttributes:
        if parent != JOBS_INODE:
            raise pyfuse3.FUSEError(errno.EROFS)
        if not JOB_NAME.fullmatch(name):
            raise pyfuse3.FUSEError(errno.EINVAL)
        try:
            job = self.jobs.create(name, ctx.uid, ctx.gid)
        except JobLimit:
            raise pyfuse3.FUSEError(errno.EDQUOT) from None
        except JobError:
            raise pyfuse3.FUSEError(errno.EEXIST) from None
        self._numbers[name] = self._next
        self._by_number[self._next] = job
        self._next += 1
        return self.getattr(self._job_inode(job))

    def rmdir(self, parent: int, name: str, ctx: pyfuse3.RequestContext) -> None:
        if parent != JOBS_INODE:
            raise pyfuse3.FUSEError(errno.EROFS)
        job = self.jobs.jobs.get(name)
        if job is None:
            raise pyfuse3.FUSEError(errno.ENOENT)
        if ctx.uid not in (0, job.uid):
            raise pyfuse3.FUSEError(errno.EPERM)
        self.jobs.remove(job)
        self.planner.left(job)
        self.lists.drop(job)
        del self._by_number[self._numbers.pop(name)]

    # -- files ------------------------------------------------------------------------
    def open(self, inode: int, flags: int) -> ControlHandle:
        job, kind, epoch, batch = self._job_of(inode)
        writing = flags & 0o3 != 0
        if kind == "dir":
            raise pyfuse3.FUSEError(errno.EISDIR)
        if writing and kind not in ("config", "report", "paths", "next"):
            raise pyfuse3.FUSEError(errno.EACCES)
        if kind == "paths":
            if not writing:
                raise pyfuse3.FUSEError(errno.EACCES)  # write-only: mountd keeps no copy
            self.lists.start(job)
        return ControlHandle(self.jobs, self.planner, self.lists, job, kind, epoch, batch)


class ControlHandle:
    """An open control file. Reads produce the content once, on the first read."""

    def __init__(self, jobs: JobRegistry, planner: BatchPlanner, lists: PathLists, job: Job,
                 kind: str, epoch: int, batch: int) -> None:
        self.jobs = jobs
        self.planner = planner
        self.lists = lists
        self.job = job
        self.kind = kind
        self.epoch = epoch
        self.batch = batch
        self.data: bytes | None = None
        self.asked = False  # JOB/next: a batch was asked for (epoch, batch)
        self.ahead = False  # JOB/next: asked while the job reads the batches before it

    async def read(self, off: int, size: int) -> bytes:
        if self.data is None:
            self.data = await self._content()
        return self.data[off:off + size]

    async def _content(self) -> bytes:
        job = self.job
        if self.kind == "next" and not self.asked:
            job.error = "write 'EPOCH BATCH' to JOB/next before reading it"
            raise pyfuse3.FUSEError(errno.EINVAL)
        if self.kind in ("batch", "next"):
            try:
                return await self.planner.manifest(job, self.epoch, self.batch, self.ahead)
            except JobError as exc:
                job.error = str(exc)
                raise pyfuse3.FUSEError(errno.EINVAL) from None
        if self.kind == "config":
            return json.dumps(job.config_view()).encode()
        if self.kind == "error":
            return (job.error + "\n").encode() if job.error else b""
        if self.kind == "stats":
            return json.dumps(job.stats()).encode()
        return b""

    async def write(self, off: int, buf: bytes) -> int:
        if self.kind == "config":
            try:
                await self.jobs.configure(self.job, buf, self.lists.take(self.job))
            except JobError:
                raise pyfuse3.FUSEError(errno.EINVAL) from None
            return len(buf)
        if self.kind == "paths":
            if self.jobs.jobs.get(self.job.id) is not self.job:
                raise pyfuse3.FUSEError(errno.ENOENT)  # removed: nothing would free a list
            try:
                self.lists.write(self.job, off, buf)
            except JobError:
                raise pyfuse3.FUSEError(errno.EINVAL) from None
            return len(buf)
        lines = buf.decode("utf-8", "replace").splitlines()
        if self.kind == "next":
            self._ask(lines.pop() if lines else "")
        for line in lines:
            parts = line.split()
            try:
                epoch, batch, seconds = int(parts[0]), int(parts[1]), float(parts[2])
            except (IndexError, ValueError):
                continue  # a report line we do not understand is ignored, not fatal
            if 0 <= seconds <= MAX_BATCH_SECONDS:  # no NaN or inf: heartbeats carry them
                self.job.record_time(epoch, batch, seconds)
        return len(buf)

    def _ask(self, line: str) -> None:
        """JOB/next's last line: the batch whose manifest the next reads return."""
        m = ASK.fullmatch(line)
        if m is None:
            self.job.error = ("JOB/next: the last line written must be 'EPOCH BATCH' (or "
                              f"'EPOCH BATCH ahead'), not {line[:80]!r}")
            raise pyfuse3.FUSEError(errno.EINVAL)
        self.epoch, self.batch = int(m.group(1)), int(m.group(2))
        self.ahead = m.group(3) is not None
        self.data, self.asked = None, True

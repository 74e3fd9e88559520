"""mountd's lifecycle: check the root, mount, serve, unmount cleanly on a signal."""
from __future__ import annotations

import dataclasses
import errno
import faulthandler
import logging
import os
import signal
import socket
import subprocess

import pyfuse3
import trio

from mountd.cluster.coordinators import RemoteCoordinators
from mountd.cluster.membership import Cluster, EmbeddedFactory
from mountd.cluster.peers import PeerService, PeerSet
from mountd.control.controller import Controller
from mountd.control.metrics import MountdCollector
from mountd.control.quotas import MAX_DIGEST_BYTES_PER_USER, Quota
from mountd.control.server import ControlServer
from mountd.datasets.memory_budget import MemoryBudget, MemoryLimits, default_total
from mountd.datasets.mount_table import MountTable
from mountd.datasets.registry import Registry
from mountd.fetch.fair_share import WAITING_READS_PER_UID
from mountd.fetch.loader_pool import AHEAD_NICENESS, MIN_SERVING_PROCESSES, LoaderPool
from mountd.fetch.probed import invalidate_inodes
from mountd.fetch.services import read_services
from mountd.fs.control_fs import ControlFS
from mountd.fs.control_mount import ControlMount
from mountd.fs.datasets_fs import DATASET_TIMEOUT, ROOT_ENTRY_TIMEOUT, QuiverFS, no_open_available
from mountd.fs.fuse_limits import FUSE_TASKS, READAHEAD_KB, tune_connection
from mountd.fs.job_files import ControlFiles
from mountd.fs.native_plane import DataPath, NativePlane
from mountd.fs.native_views import NativeViews
from mountd.jobs.chunk_loader import ChunkLoader
from mountd.jobs.planner import BatchPlanner
from mountd.jobs.registry import JobRegistry
from mountd.store.content_store import ContentStore
from mountd.store.scrubber import IDLE_WAIT, SCRUB_MB_S, STEP_BYTES, ByteRate, Scrubber
from mountd.view.view_jobs import ViewJobs
from quiverfs import sd_notify
from quiverfs.backends.base import FETCH_DEADLINE
from quiverfs.chunk_plan import CACHE_CHUNKS
from quiverfs.errors import ExitCode, QuietError
from quiverfs.fs_identity import (NOBODY, IdentityUnavailable, UserIdentity, acting_as,
                                  refuse_mount)
from quiverfs.heartbeat import NODE_ID
from quiverfs.metrics_server import MetricsServer
from quiverfs.mount_point import is_mounted
from quiverfs.peer_network import Networks, host_refusal
from quiverfs.process_limits import raise_open_file_limit, return_large_blocks
from quiverfs.rpc import RpcServer, load_secret

log = logging.getLogger(__name__)

HIT_RECORD_INTERVAL = 1.0  # seconds between writes of LRU recency to the store
# seconds between writes of spent marks (and of their undoing): a fast job spends items
# at hundreds a second, and until they are written the store evicts items that are still
# needed instead
SPENT_RECORD_INTERVAL = 0.1
DEFAULT_LISTEN = ("127.0.0.1", 0)  # the peer server's address without --listen


@dataclasses.dataclass
class MountdConfig:
    """Settings of one mountd (command line or config file, whose defaults are the
    command line's)."""

    root: str
    cache_dir: str
    cache_size: int  # bytes
    control_socket: str
    threads: int  # short blocking workers (the store, status), and as many fetch threads
    loader_processes: int  # processes that fetch and store chunk loads; 0: in mountd
    force_evict_after: float  # seconds a marked chunk may outlive its first release
    probe_batches: int  # for the embedded coordinator
    chunk_bytes: int | None  # None: 10% of a dataset or 15 GiB, the smaller
    # HOST, PORT of each coordinator, in order; None runs the coordinator logic embedded
    coordinator: tuple[tuple[str, int], ...] | None
    listen: tuple[str, int] | None  # the peer server's address (with a coordinator)
    cluster_secret_file: str | None
    metrics: tuple[str, int] | None  # where to serve Prometheus metrics
    peer_networks: Networks = ()  # members' peer addresses allowed (with a coordinator)
    push_memory: int = 256 << 20  # bytes of planned items pushed to the kernel, unread
    memory_per_uid: int = 2 << 30  # bytes of registrations' shared copies, per uid
    memory_total: int | None = None  # and of all users'; None: a quarter of physical memory
    digest_bytes_per_uid: int = MAX_DIGEST_BYTES_PER_USER  # of digest files kept, per uid
    node_id: str = dataclasses.field(default_factory=socket.gethostname)
    fuse_tasks: int = FUSE_TASKS  # FUSE requests handled at once
    fuse_opens: bool = False  # dataset files opened with a handle even where no-open works
    data_path: DataPath = DataPath.NATIVE  # how cached dataset files are served
    fuse_threads: int = 16  # the native data plane's threads (mountd.cli.FUSE_THREADS)
    prefetch_concurrency: int = 16  # items a prefetch fetches at once
    fetch_deadline: float = FETCH_DEADLINE  # seconds a bucket read may take, retries included
    gcs_endpoints: tuple[str, ...] = ()  # endpoints users other than root may name
    scrub_mb_s: float = SCRUB_MB_S  # MB (10^6 bytes) of the store re-hashed a second; 0: none


def check_cluster_config(cfg: MountdConfig) -> None:
    """Refuse (exit 2) a node id or a peer server address that the coordinator would
    refuse at every heartbeat."""
    if not NODE_ID.fullmatch(cfg.node_id):
        raise QuietError(f"node id {cfg.node_id!r} is not valid: give --node-id of letters, "
                         "digits, '.', '_' and '-' (at most 253)", ExitCode.USAGE)
    host, _ = cfg.listen or DEFAULT_LISTEN
    why = host_refusal(host, cfg.peer_networks)
    if why is not None:
        raise QuietError(f"--listen {host}: {why}: peers could not reach this node",
                         ExitCode.USAGE)


def prepare_root(root: str) -> None:
    """Make sure ``root`` is a directory we can mount on, clearing a crashed mount."""
    if is_mounted(root, fuse_only=True):
        try:
            os.statvfs(root)  # always answered by the daemon, never from kernel caches
        except OSError as exc:
            if exc.errno != errno.ENOTCONN:
                raise QuietError(f"mount root {root}: {exc.strerror}", ExitCode.MOUNT) from None
            log.warning("%s is a stale mount (transport endpoint not connected): "
                        "unmounting it", root)
            subprocess.run(["fusermount3", "-u", "-z", root], check=False,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        else:
            raise QuietError(f"{root} is already mounted by a running FUSE daemon: stop it "
                             f"(or 'fusermount3 -u {root}') first", ExitCode.MOUNT)
    if not os.path.exists(root):
        raise QuietError(f"mount root {root} does not exist: create it first "
                         f"(mkdir -p {root})", ExitCode.MOUNT)
    if not os.path.isdir(root):
        raise QuietError(f"mount root {root} is not a directory", ExitCode.MOUNT)


class Mountd:
    """One mount root, one content store, one control socket."""

    def __init__(self, cfg: MountdConfig, embedded_coordinator: EmbeddedFactory) -> None:
        self.cfg = cfg
        self.root = os.path.abspath(cfg.root)
        # The state first: one that cannot be written stops the start before the store
        # (which serves uncached when it cannot write) says anything.
        self.registry = Registry(os.path.join(cfg.cache_dir, "state"), cfg.fetch_deadline)
        self.store = ContentStore(os.path.join(cfg.cache_dir, "store"), cfg.cache_size)
        self.table = MountTable()
        self.limiter = trio.CapacityLimiter(cfg.threads)
        self.scrubber = Scrubber(self.store, self._withdraw) if cfg.scrub_mb_s > 0 else None
        self.peer_service: PeerService | None = None
        self.peer_server: RpcServer | None = None
        self.coordinators: RemoteCoordinators | None = None
        self.cluster = self._cluster(embedded_coordinator)
        # Loader processes: one pool for the misses readers wait on, one for chunk loads.
        n = cfg.loader_processes
        serving = (LoaderPool(max(MIN_SERVING_PROCESSES, n), self.store, self.limiter)
                   if n else None)
        ahead = LoaderPool(n, self.store, self.limiter, niceness=AHEAD_NICENESS) if n else None
        self.pools = [pool for pool in (serving, ahead) if pool is not None]
        no_open = not cfg.fuse_opens and no_open_available()
        self.services = read_services(self.store, self.limiter, self.cluster,
                                      cfg.push_memory, serving, ahead, WAITING_READS_PER_UID)
        # A lone node sizes chunks so that several fit its cache; in a cluster every node
        # must compute the same plan, so the default stays 10% (or --chunk-size).
        self.jobs = JobRegistry(self.table, self.limiter, cfg.chunk_bytes,
                                None if cfg.coordinator else cfg.cache_size / CACHE_CHUNKS)
        self.planner = BatchPlanner(self.services)
        self.loader = ChunkLoader(self.jobs, self.services)
        self.views = ViewJobs(self.jobs, self.services)
        self.controller = Controller(
            self.root, self.table, self.registry, self.services, self.jobs, self.views,
            self.peer_service, cfg.prefetch_concurrency,
            MemoryBudget(MemoryLimits(cfg.memory_per_uid, cfg.memory_total or default_total())),
            "no-open" if no_open else "open",
            {name: pool for name, pool in (("serving", serving), ("ahead", ahead))
             if pool is not None}, cfg.gcs_endpoints,
            Quota(digest_bytes=cfg.digest_bytes_per_uid))
        if not (cfg.fuse_opens or no_open):
            log.warning("this pyfuse3 does not pass the inode to read (mountd/patches): "
                        "dataset files are served with OPEN and RELEASE")
        self.fs = QuiverFS(self.table, self.services, no_open)
        self.native = self._native_plane(no_open)
        self.fs.on_init = self._check_passthrough
        self.control_mount = ControlMount(
            self.root, ControlFS(self.table, self.services.reader,
                                 ControlFiles(self.jobs, self.planner), self.views),
            self.services.stats.fuse_requests)
        # Bound now, so that a taken port fails before mounting.
        collector = MountdCollector(self.services, self.table, self.jobs,
                                    loader_pools=self.controller.loader_pools,
                                    coordinators=self.coordinators)
        self.metrics = MetricsServer(cfg.metrics, collector) if cfg.metrics else None
        self.control = ControlServer(cfg.control_socket, self.controller.handlers())
        self.control.bind()
        self.device: str | None = None  # MAJOR:MINOR of the mount, once mounted
        self._terminated = False

    def run(self) -> None:
        prepare_root(self.root)
        try:
            with acting_as(UserIdentity(NOBODY, NOBODY)):
                pass
        except IdentityUnavailable as exc:
            log.warning("%s: other users' file:// datasets cannot be read", exc)
        self.controller.restore()
        options = set(pyfuse3.default_options)
        # Read-only: the kernel then never marks a file's attributes stale after a read
        # (no GETATTR at the next open). ROOT/.quiver, which takes writes, is another mount.
        options |= {"fsname=quiver", "subtype=quiver", "allow_other", "ro"}
        pyfuse3.init(self.fs, self.root, options)
        if self.native is not None and not self.native.attach():
            self.native = None
        if self.native is not None:
            # nothing is pushed: the plane's READ of a stored item costs less than its
            # push (a store read and a copy into the kernel by a Python worker)
            self.services.push.budget = 0
            # the same plane answers ROOT/.quiver's view files (mountd.fs.native_views)
            views = NativeViews(self.native.plane, self.views, self.services.stats,
                                self.cfg.fuse_threads)
            self.control_mount.native = views
            self.control_mount.fs.native_opened = views.opened
            self.control_mount.fs.python_opened = views.python_opened
        self.services.stats.data_path = (
            DataPath.PYTHON if self.native is None
            else DataPath.PASSTHROUGH if self.native.passthrough else DataPath.NATIVE)
        # a dataset's files there would be read by the workers that serve them
        self.device = refuse_mount(self.root)
        log.info("mounted %s (cache %s, %d bytes)", self.root, self.cfg.cache_dir,
                 self.cfg.cache_size)
        try:
            trio.run(self._serve)
        finally:
            if self.native is not None:  # its threads end, and it closes /dev/fuse
                self.native.stop()
            pyfuse3.close(unmount=True)
            self.store.close()
            log.info("unmounted %s", self.root)

    async def _serve(self) -> None:
        async with trio.open_nursery() as nursery:
            await nursery.start(self.controller.tasks.run)
            await nursery.start(self.planner.tasks.run)
            await nursery.start(self.services.puts.tasks.run)
            await nursery.start(self.services.push.run)
            for pool in self.pools:  # ended before the store closes, when unmounting
                await nursery.start(pool.run)
            if self.peer_server is not None:
                await nursery.start(self.peer_server.serve)
                await nursery.start(self.cluster.peers.tasks.run)
            await nursery.start(self.cluster.link.run)
            await nursery.start(self.loader.run)
            if self.metrics is not None:
                await nursery.start(self.metrics.serve)
            if self.native is not None:  # before the mount table changes
                await nursery.start(self.native.run)
            nursery.start_soon(self._record_hits)
            nursery.start_soon(self.views.run)
            nursery.start_soon(self._tune_kernel)
            if self.scrubber is not None:
                nursery.start_soon(self._scrub, self.scrubber)
            nursery.start_soon(self._serve_fuse, nursery.cancel_scope)
            # ROOT/.quiver's mount looks it up here: it starts once requests are served
            await nursery.start(self.control_mount.run)  # refuses its mount's files
            await nursery.start(self.control.serve)  # a client sees ROOT/.quiver mounted
            await nursery.start(self._on_signals)  # before READY=1: systemd may stop us next
            sd_notify.notify("READY=1")
        if not self._terminated:
            raise QuietError(f"the FUSE session at {self.root} ended unexpectedly "
                             "(unmounted from outside?)", ExitCode.MOUNT)

    async def _serve_fuse(self, done: trio.CancelScope) -> None:
        await pyfuse3.main(min_tasks=1, max_tasks=self.cfg.fuse_tasks)
        done.cancel()

    def _peer_loaded(self, identity: str) -> None:
        """A peer stored more of a loading chunk of dataset ``identity``: the jobs here
        waiting for one of its chunks look again."""
        for group in self.jobs.groups.values():
            if group.ds.reg.identity == identity:
                group.poke()

    def _cluster(self, embedded_coordinator: EmbeddedFactory) -> Cluster:
        """This node's cluster: with --coordinator, the peer server's port is bound now
        (a taken one fails before mounting) and its tasks start with the others; else a
        lone node with the coordinator embedded."""
        cfg = self.cfg
        if cfg.coordinator is None:
            link = embedded_coordinator(os.path.join(cfg.cache_dir, "state", "coordinator"),
                                        cfg.force_evict_after, cfg.probe_batches,
                                        self.limiter)
            return Cluster(cfg.node_id, "local", cfg.cache_size, link, None)
        secret = load_secret(cfg.cluster_secret_file)
        self.peer_service = PeerService(self.store, self.limiter, self._peer_loaded)
        self.peer_server = self.peer_service.server(secret)
        host, port = cfg.listen or DEFAULT_LISTEN
        address = self.peer_server.bind(host, port, "--listen")
        self.coordinators = RemoteCoordinators(cfg.coordinator, secret)
        log.info("node %s: peer server on %s, coordinator %s", cfg.node_id, address,
                 ",".join(self.coordinators.addresses))
        return Cluster(cfg.node_id, address, cfg.cache_size, self.coordinators,
                       PeerSet(secret, self.limiter, cfg.peer_networks))

    async def _tune_kernel(self) -> None:
        """Once INIT is answered, the datasets' connection's limits and readahead
        (mountd.fs.fuse_limits)."""
        await self.fs.initialized.wait()
        if self.device is not None:
            await trio.to_thread.run_sync(tune_connection, self.device, READAHEAD_KB,
                                          limiter=self.limiter)

    def _native_plane(self, no_open: bool) -> NativePlane | None:
        """The native data plane where --data-path asks for it and it can be loaded
        (it answers READs by inode: no-open mode only)."""
        if self.cfg.data_path is DataPath.PYTHON:
            return None
        if not no_open:
            log.warning("the native data plane serves files without OPEN requests "
                        "(not with --fuse-opens, nor without mountd's pyfuse3 patch): "
                        "dataset files are served through Python")
            return None
        native = NativePlane.create(self.cfg.fuse_threads, ROOT_ENTRY_TIMEOUT,
                                    DATASET_TIMEOUT, self.table, self.store,
                                    self.services.stats, self.services.integrity,
                                    self.services.staging, self.limiter)
        if native is None:
            return None
        self.services.probed.withdraw = native.withdrawn
        if self.cfg.data_path is DataPath.PASSTHROUGH:
            native.use_passthrough(True)
            self.fs.serve_opens(True, direct=True)  # passthrough: the kernel reads the file
            self.controller.fuse_mode = "open"
        return native

    def _check_passthrough(self) -> None:
        """At the kernel's INIT, before its reply: where it does not offer passthrough,
        the plane reads the store's files itself, in no-open mode."""
        native = self.native
        if native is None or not native.passthrough or native.passthrough_offered():
            return
        log.warning("this kernel does not offer FUSE passthrough: the native data plane "
                    "reads cached files itself (--data-path native)")
        native.use_passthrough(False)
        self.fs.serve_opens(False)
        self.controller.fuse_mode = "no-open"
        self.services.stats.data_path = DataPath.NATIVE

    async def _scrub(self, scrubber: Scrubber) -> None:
        """Hash the store's entries again, one pass after another, at --scrub-mb-s
        (mountd.store.scrubber); drop those found corrupt."""
        rate = ByteRate(self.cfg.scrub_mb_s * 1e6, STEP_BYTES)
        # Withdrawing an entry may wait in the kernel for a read of its inode, whose
        # handler needs a worker of mountd's limiter: so it never holds one.
        drops = trio.CapacityLimiter(1)
        try:
            while True:
                step = await trio.to_thread.run_sync(scrubber.step, limiter=self.limiter)
                for bad in step.corrupt:
                    await trio.to_thread.run_sync(scrubber.drop, bad, limiter=drops)
                wait = rate.wait(step.cost, trio.current_time())
                await trio.sleep(max(wait, IDLE_WAIT) if step.idle else wait)
        finally:
            scrubber.close()

    def _withdraw(self, digest: bytes) -> None:
        """The scrubber's ``on_corrupt``, before it drops ``digest``'s entry: the native
        data plane serves it no more (once its READs in flight are answered), and the
        kernel drops its pages of every inode naming it, whose next reads then reach
        mountd and fetch it again (a worker thread's call)."""
        if self.native is not None:
            self.native.withdraw_now(digest)
        inodes = self.table.inodes_naming(digest)
        trio.from_thread.run_sync(self.fs.forget_reading, inodes)
        invalidate_inodes(inodes)

    async def _record_hits(self) -> None:
        recorded = trio.current_time()
        while True:
            await trio.sleep(SPENT_RECORD_INTERVAL)
            if self.native is not None:  # its hits reach the recency written below
                self.native.drain()
            if (self.services.recency.pending()
                    or trio.current_time() - recorded >= HIT_RECORD_INTERVAL):
                recorded = trio.current_time()
                # not in a worker: it waits for the index's lock, which a hung writer holds
                self.store.writes.submit(self.services.recency.record, key="recency")

    async def _on_signals(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED
                          ) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as sigs:
            task_status.started()
            async for signum in sigs:
                log.info("%s: unmounting", signal.Signals(signum).name)
                self._terminated = True
                # A read waiting on a stalled bucket would hold the exit until it gave
                # up: a worker's socket is shut now, and a loader process's request
                # ends here (its fallback to a worker then fails at once).
                for ds in self.table.by_name.values():
                    ds.backend.abort()
                for pool in self.pools:
                    pool.stop_requests()
                await self.control_mount.stop()  # its unmount looks ROOT/.quiver up here
                pyfuse3.terminate()


def run_mountd(cfg: MountdConfig, embedded_coordinator: EmbeddedFactory) -> None:
    # Everything mountd and its loader processes create is root's alone unless it says
    # otherwise (the control socket): the store and state hold every user's data.
    os.umask(0o077)
    faulthandler.register(signal.SIGUSR1)
    raise_open_file_limit()
    return_large_blocks()
    Mountd(cfg, embedded_coordinator).run()

"""The chunk loader: carries out the coordinator's chunk cycles on this node (loads its
share of a loading chunk, drops an evicted one, refills after membership changes) and
reports what the coordinator needs in each heartbeat.

Each dataset's report, its part of an answer, and each load is a step of its own: one
that fails on a bug below is logged and given up (the heartbeat after tries it again),
and the other datasets' steps go on. Left to propagate, it would end the heartbeat's
task, and with it mountd, for every user.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
from collections.abc import Callable

import numpy as np
import trio

from mountd.cluster.peers import PeerSet
from mountd.fetch.services import ReadServices
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.jobs.registry import Job, JobRegistry
from quiverfs import ownership
from quiverfs.chunk_cycle import MAX_LOADING, ChunkState
from quiverfs.counters import FetchCause, SamplerJobCounter
from quiverfs.failure_runs import FailureRuns
from quiverfs.heartbeat import CacheMode, CycleView, DatasetReport, LoadedShare
from quiverfs.rpc import Unavailable

log = logging.getLogger(__name__)

# Items whose store membership is checked at once, just before they are fetched: few, so
# that items the jobs fetched meanwhile (their cooperative misses) are not fetched again.
CHECK_BLOCK = 32


class ChunkLoader:
    """Acts on each heartbeat's answer for the datasets with jobs here."""

    def __init__(self, registry: JobRegistry, services: ReadServices) -> None:
        self.registry = registry
        self.bulk = services.bulk
        self.cluster = services.cluster
        self.store = services.store
        self.recency = services.recency
        self.limiter = services.limiter
        self.stats = services.stats
        self.staging = services.staging
        self._nursery: trio.Nursery | None = None
        self._failures = FailureRuns(log)  # by (dataset, step): heartbeats repeat them

    async def run(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        """Heartbeat (``cluster.run``) inside the nursery that chunk loads run in, so
        that every answer it acts on can start them."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self.cluster.run(self.report, self.apply, self.stats.bucket.rate)

    def report(self) -> dict[str, DatasetReport]:
        """What the coordinator needs, per dataset identity with jobs here (one digest
        mounted under several names, say exact and as a view, is one dataset to it)."""
        reports: dict[str, DatasetReport] = {}
        for group in self.registry.groups.values():
            if not group.jobs:
                continue
            try:
                mine = group.report()
            except Exception:
                self._failed(group, "its report", "it is left out of this heartbeat")
                continue
            self._succeeded(group, "its report")
            seen = reports.get(group.ds.reg.identity)
            if seen is not None:
                mine = dataclasses.replace(seen, jobs=seen.jobs + mine.jobs,
                                           loaded=tuple(dict.fromkeys(seen.loaded
                                                                      + mine.loaded)))
            reports[group.ds.reg.identity] = mine
        return reports

    async def apply(self, cycles: dict[str, CycleView], version: int) -> None:
        """Act on the coordinator's answer: load shares, drop evicted chunks, refill."""
        for group in list(self.registry.groups.values()):
            view = cycles.get(group.ds.reg.identity)
            if view is None:
                continue
            try:
                await self._apply(group, view, version)
            except Exception:
                self._failed(group, "acting on the coordinator's answer",
                             "the next answer is acted on as usual")
            else:
                self._succeeded(group, "acting on the coordinator's answer")

    def _failed(self, group: DatasetJobs, step: str, then: str) -> None:
        """``step`` for ``group`` raised (called in its ``except``)."""
        self._failures.failed("dataset %s: %s failed; %s", group.ds.name, step, then,
                              key=(group.ds.name, step))

    def _succeeded(self, group: DatasetJobs, step: str) -> None:
        self._failures.succeeded((group.ds.name, step))

    async def _apply(self, group: DatasetJobs, view: CycleView, version: int) -> None:
        """Act on ``view``, the coordinator's answer for ``group``'s dataset."""
        me = self.cluster.me
        before = group.cycle_key()
        previous, group.view = group.view, view
        if (group.cycle_key() != before or previous is None
                or previous.users != view.users):  # who is alone may have changed
            group.poke()
        group.ds.cache_mode = view.mode
        probes = False
        for job in group.jobs.values():
            if not isinstance(job, Job):
                continue  # a view's job: those are not probed
            seq = view.probes.get(job.id)
            if seq is not None and seq > job.probe.seq:
                # where the cache holds the dataset, forced misses would read from
                # the bucket what it holds: the probe measures without them
                holds = view.mode is CacheMode.FULL or view.capacity >= view.chunks
                model = self._miss_model(group, job) if holds else None
                job.probe.begin(seq, view.probe_batches, model)
                probes = True
                log.info("job %s: probe %d of %d batches%s", job.id, seq,
                         view.probe_batches, " (no forced misses)" if holds else "")
        if probes:  # a lone job waiting for chunks stops: its probe holds their loads
            group.poke()
        for load in view.loads:
            new = group.cached.hold(group.plan.members[load.chunk])
            self.recency.wanted(group.ds.digest.hash(int(i)) for i in new)
            if me in load.loaders and load not in group.loaded:
                self._spawn(group, f"load {load.chunk}", load.chunk, load.loaders, load)
        if previous is not None:
            for chunk, (old, new) in enumerate(zip(previous.states, view.states)):
                if old is not ChunkState.EVICTED and new is ChunkState.EVICTED:
                    await self._evict_local(group, chunk)
        if version != group.version and view.active and me in view.users:
            if group.version >= 0:  # membership changed: owners moved, refill
                for chunk in view.active:
                    self._spawn(group, f"refill {version} {chunk}", chunk, view.users, None)
            group.version = version

    def _miss_model(self, group: DatasetJobs, job: Job) -> Callable[[float], float | None]:
        """t_hit -> the job's t_miss as modelled (``mountd.jobs.probing``): a batch's bytes at
        the bucket bandwidth this node's fetches get, overlapped with its step; None
        until a bandwidth is measured."""
        def t_miss(t_hit: float) -> float | None:
            rate = self.stats.bucket.rate()
            return None if rate is None else max(t_hit, job.batch_bytes() / rate)
        return t_miss

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
                limiter=self.limiter)
            # the load's failed fetches, counted as BulkFetch counts a sampler job's
            counters: collections.Counter[SamplerJobCounter] = collections.Counter()
            cause = FetchCause.REFILL if share is None else FetchCause.CHUNK_LOAD
            for start in range(0, len(mine), CHECK_BLOCK):
                await self._after_lone_probe(group)
                # ahead of its jobs, a load waits while a dataset allotted full fills
                reg = group.ds.reg
                await self.bulk.reader.demand.wait_for_others(reg.uid, reg.identity)
                await self.bulk.load(group.ds, mine[start:start + CHECK_BLOCK], counters, cause)
                self._tell_users(group)
            if share is not None:
                group.loaded.append(share)
                del group.loaded[:-4 * MAX_LOADING]  # the coordinator asks about current ones
                self.cluster.poke()
            log.info("dataset %s: %s done (%d items of chunk %d)", group.ds.name, name,
                     len(mine), chunk)
        except Exception:
            self._failed(group, name, "a later answer starts it again")
        else:
            self._succeeded(group, name)
        finally:
            group.busy.discard(name)

    def _tell_users(self, group: DatasetJobs) -> None:
        """Tell the other nodes with jobs on the dataset that this node stored more of
        a share they may wait for (the planner counts other nodes' shares once they hold
        them); a node that cannot be told looks again when the cycle moves."""
        peers, view = self.cluster.peers, group.view
        if peers is None or view is None or self._nursery is None:
            return
        for node in view.users:
            if node != self.cluster.me:
                self._nursery.start_soon(self._tell, peers, node, group.ds.reg.identity)

    @staticmethod
    async def _tell(peers: PeerSet, node: str, identity: str) -> None:
        with contextlib.suppress(Unavailable):
            await peers.loaded(node, identity)

    async def _after_lone_probe(self, group: DatasetJobs) -> None:
        """Wait while the dataset's one job in the cluster is a job here whose benefit
        is being probed. Without the cache whose benefit the probe measures, no chunk
        load would share the bucket with the job's misses. A load running beside the
        probe puts each of the job's misses behind a loader process's fetches in
        flight, so the probe would measure t_miss far above what the job's misses cost
        it without a cache, and keep a cache worth nothing to the job."""
        while isinstance(job := group.alone(self.cluster.me), Job) and job.probe.active:
            await group.changed.wait()  # poked as the probe ends, or jobs come or go

    async def _evict_local(self, group: DatasetJobs, chunk: int) -> None:
        """Drop this node's copies of an evicted chunk, keeping items whose content a
        resident chunk shares, hits that manifests promised and were not read yet, and
        (up to half the chunk) items that view jobs released it with and still need in
        their passes: the store's LRU drops those later."""
        view, digest, store = group.view, group.ds.digest, self.store
        members = group.plan.members[chunk]
        kept = members[group.kept_at_eviction(members)][:len(members) // 2]
        group.cached.forget(members[~np.isin(members, kept)])

        def drop() -> None:
            keep = {digest.hash(int(i)) for c in view.resident for i in group.plan.members[c]}
            keep.update(digest.hash(int(i)) for i in kept)
            for h in (digest.hash(int(i)) for i in members):
                if h not in keep and not self.staging.awaiting_read(h):
                    store.discard(h)

        await trio.to_thread.run_sync(drop, limiter=self.limiter)
        log.info("dataset %s: chunk %d evicted here", group.ds.name, chunk)


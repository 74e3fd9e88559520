"""The batch planner: each read of a job's batch file ``eE-bI`` returns the manifest of
mini-batch I of epoch E, planned by an EpochSampler over the items the job's ImageFolder
sees. Misses the sampler picks are fetched before the manifest is returned, so the
job's workers read cache hits.

A manifest is a ``quiverfs.job_protocol.Manifest`` in JSON. While the job's dataset is
allotted ``full`` and the items it visits next are all cached, there is nothing to
substitute: the reply for batch I then also carries ``segment``, the ``paths`` of the
batches I + 1, I + 2, ... (up to SEGMENT_BATCHES in all, in the job's exact shuffled
order), already planned. A reader
may take them without reading their files (whose manifests are kept, without a
``segment``, for readers that do) and asks again for the first batch after them.

Batch 0 of any epoch other than the job's current one starts that epoch afresh: a
sampler handed the rest of an epoch asks for the next epoch's first manifest ahead of
time, and its loader may then run an epoch again instead (a later batch of an earlier
epoch is an error). A job that says how many epochs it runs (its config's ``epochs``)
is planned none after them: the sampler asks for no manifest past its last epoch, and
one asked for is refused (else its segment would be planned, and its pages pushed, for
no one).
"""
from __future__ import annotations

import logging
import math

import numpy as np
import trio

from mountd.fetch.services import ReadServices
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.jobs.epoch_plan import EpochPlan
from mountd.jobs.registry import Job, JobConfig, JobError
from mountd.jobs.substitution import Batch, EpochSampler, advance, epoch_shard
from quiverfs.background import BackgroundTasks
from quiverfs.chunk_cycle import EpochRef
from quiverfs.counters import FetchCause, SamplerJobCounter
from quiverfs.digest import Digest
from quiverfs.heartbeat import CacheMode
from quiverfs.job_protocol import Manifest, encode_manifest

log = logging.getLogger(__name__)

# Seconds a coop job waits for the chunk cycle to bring it cached items before it
# fetches misses outside the resident chunks (each of those is a bucket read that no
# other job shares). A wait that times out is not repeated until the cycle moves.
CHUNK_WAIT = 20.0
PROBE_LOOKUPS = 1024  # pending items of a chunk looked up before a probe run, at most
# Batches one reply may hand out as a segment. The job asks again only after them (and
# QuiverBatchSampler reads the next segment as one starts), so an allotment that leaves
# ``full``, or a probe the coordinator asks for, reaches it up to two segments later (a
# segment planned ahead and not yet handed out is handed out batch by batch instead).
# Or up to SEGMENT_ITEMS items, where that is more batches: each manifest costs a write
# and a read through the ``.quiver`` process and a planning call, which batches of a
# few items would otherwise pay every few hundred items. More saves little: a reply
# stays around 0.5 MB for batches of 256.
SEGMENT_BATCHES = 64
SEGMENT_ITEMS = 4096
# A segment is at most as long as the batches of the epoch planned before it, and at
# least this: the job waits for an epoch's first segment, so that one is short (its
# planning time is the job's wait), and each later one is planned while the job reads
# the one before (the sampler reads it as that one starts), so it must not take longer
# to plan than that one to read. An epoch asked for ahead (the sampler reads its first
# manifest while it reads the epoch before) is planned while the job reads, so its
# first segment is as long as any.
FIRST_SEGMENT_BATCHES = 8
# A segment of up to this many items is looked up (``ContentStore.leading_known``) and
# its reply made on mountd's loop: a job waits for an epoch's first segment, and a
# worker hop for the look-up and another for the reply would add to that wait, and the
# segment's pushes are queued after the reply so they do not delay it. A longer
# segment would hold the loop from every other request: the same look, and its reply,
# are made in a worker.
LOOP_SEGMENT_ITEMS = 512
MIN_SEGMENT = 2  # fewer cached batches ahead are planned one at a time


class BatchPlanner:
    """Plans each job's batches in order, one ahead of the job's reads."""

    def __init__(self, services: ReadServices) -> None:
        self.reader = services.reader
        self.bulk = services.bulk
        self.cluster = services.cluster
        self.store = services.store
        self.limiter = services.limiter
        self.staging = services.staging
        self.push = services.push
        self.probed = services.probed
        self.tasks = BackgroundTasks()  # where plans ahead run

    async def manifest(self, job: Job, epoch: int, index: int, ahead: bool = False) -> bytes:
        """The manifest of batch ``index`` of ``epoch`` (planning earlier ones first);
        ``ahead``: the job asks while it still reads the batches before."""
        async with job.lock:
            group = job.group
            if job.config is None or group is None:
                raise JobError(job.error or "the job has no config: write its config first")
            last = job.config.epochs
            if last is not None and epoch >= last:  # nothing past them is planned
                raise JobError(f"the job runs {last} epochs (0 to {last - 1}): epoch "
                               f"{epoch} is not one of them")
            plan = job.plan
            if plan is not None and epoch < plan.epoch and index > 0:
                raise JobError(f"epoch {epoch} is over (the job is at epoch {plan.epoch})")
            if plan is None or epoch != plan.epoch:
                plan = self._start_epoch(job, job.config, group, epoch, ahead and index == 0)
            sampler = plan.sampler
            if index >= sampler.n_batches:
                raise JobError(f"epoch {epoch} has {sampler.n_batches} batches")
            self.push.asked(job.id, (epoch, index))
            while sampler.planned <= index:
                await self._plan(job, group, plan)
            reply, handed = plan.manifests[index], 1
            segment = plan.segments.get(index)
            if segment is not None and self._segments_allowed(job, group):
                reply, handed = segment
                job.counters[SamplerJobCounter.SEGMENTS] += 1
            elif isinstance(reply, Batch):  # a segment's batch, read on its own
                reply = plan.manifests[index] = encode_manifest(self._manifest(
                    job, plan.epoch, group.ds.digest, reply, len(reply.items)))
            job.counters[SamplerJobCounter.MANIFESTS] += 1
            if sampler.planned == index + handed < sampler.n_batches:
                # plan the next batch while the job's workers read this one
                self.tasks.start_soon(self._plan_ahead, job, plan)
            return reply

    def left(self, job: Job) -> None:
        """``job`` unregistered: what was pushed for it no longer counts."""
        self.push.left(job.id)

    def _push(self, job: Job, group: DatasetJobs, plan: EpochPlan, indices: list[int],
              batch: int) -> None:
        """Push the items planned for ``job``'s batch ``batch`` (and those after it in a
        segment), unless the job left while they were planned: ``left`` has released
        its pushes, and these would hold the budget until they expired."""
        if job.group is not None:
            self.push.enqueue(group.ds, indices, job.id, (plan.epoch, batch))

    async def _plan_ahead(self, job: Job, plan: EpochPlan) -> None:
        async with job.lock:
            if job.plan is not plan or job.group is None or (
                    plan.sampler.planned >= plan.sampler.n_batches):
                return  # the job moved on, or left
            try:
                await self._plan(job, job.group, plan)
            except Exception:  # the job's own request for the batch will meet it again
                log.exception("job %s: planning batch %d ahead failed", job.id,
                              plan.sampler.planned)

    @staticmethod
    def _start_epoch(job: Job, cfg: JobConfig, group: DatasetJobs, epoch: int, ahead: bool
                     ) -> EpochPlan:
        """The job's plan of ``epoch``, begun (a chunk wait that timed out carries over:
        it is not repeated until the cycle moves); ``ahead``: its first batch was asked
        for ahead, so its first segment may be as long as any."""
        order = epoch_shard(job.universe, cfg.seed, epoch, cfg.rank, cfg.world_size)
        sampler = EpochSampler(order, cfg.batch_size, seed=cfg.seed + epoch,
                               scan_factor=cfg.scan_factor, chunk_of=group.plan.chunk_of)
        generation = group.view.generation if group.view is not None else 0
        ref = EpochRef(generation, np.bincount(group.plan.chunk_of[order],
                                               minlength=group.plan.n_chunks))
        first = _max_segment(cfg.batch_size) if ahead else FIRST_SEGMENT_BATCHES
        job.plan = EpochPlan(epoch, sampler, ref, first,
                             gave_up_on=job.plan.gave_up_on if job.plan is not None else None)
        return job.plan

    def _segments_allowed(self, job: Job, group: DatasetJobs) -> bool:
        """Whether the job may be handed segments: its dataset is allotted full, no
        probe of it runs or is asked for (a probe needs its batches one at a time), and
        this node is the cluster's only live one (else the items are spread over the
        members' stores, none holds them all)."""
        view = group.view
        return (view is not None and view.mode is CacheMode.FULL and not job.probe.active
                and view.probes.get(job.id, 0) <= job.probe.seq
                and len(self.cluster.live()) == 1)

    async def _plan(self, job: Job, group: DatasetJobs, plan: EpochPlan) -> None:
        """Plan the job's next batch, or a segment of batches where it may have one, and
        keep what was planned until it is asked for."""
        segment = (await self._plan_segment(job, group, plan)
                   if plan.sampler.all_hits and self._segments_allowed(job, group) else None)
        if segment is None:
            index, manifest = await self._plan_next(job, group, plan)
            plan.manifests[index] = manifest
            return
        reply, batches = segment
        # each batch's own manifest is made only if a reader asks for it
        plan.manifests.update((batch.index, batch) for batch in batches)
        plan.segments[batches[0].index] = (reply, len(batches))

    async def _plan_segment(self, job: Job, group: DatasetJobs, plan: EpochPlan
                            ) -> tuple[bytes, list[Batch]] | None:
        """Place the next batches of the job's pending items in its exact order, as many
        (up to ``_max_segment``) as the cache holds from the first on: the reply that
        hands them out, and the batches; None, placing nothing, where that is fewer than
        MIN_SEGMENT."""
        sampler, ref, size = plan.sampler, plan.ref, plan.sampler.batch_size
        most = min(_max_segment(size), max(plan.first_segment, sampler.planned))
        items = sampler.pending_in_order(min(most * size, sampler.remaining)).tolist()
        digest = group.ds.digest
        hashes = digest.hashes_of(items)
        # segments are planned on a lone node only (_segments_allowed): its store is
        # where every item is, and a miss near the head ends the look (what the loop
        # cannot tell at once is looked up in a worker)
        store = self.store
        cached = (store.leading_known(hashes) if len(hashes) <= LOOP_SEGMENT_ITEMS
                  else await trio.to_thread.run_sync(store.leading_known, hashes,
                                                     limiter=self.limiter))
        if cached < len(hashes):
            cached += await trio.to_thread.run_sync(store.leading_held, hashes[cached:],
                                                    limiter=self.limiter)
        n = math.ceil(cached / size) if cached == len(items) else cached // size
        if n < MIN_SEGMENT:
            return None
        batches = sampler.place_in_order(n)
        placed = items[:n * size]
        for batch in batches:
            job.probe.plan(plan.epoch, batch.index, sampler.n_batches, cached=True)
        self._account(job, group, ref, placed, len(placed))
        if n * size <= LOOP_SEGMENT_ITEMS:
            reply = self._segment_reply(job, plan.epoch, digest, batches)
        else:
            reply = await trio.to_thread.run_sync(self._segment_reply, job, plan.epoch, digest,
                                                  batches, limiter=self.limiter)
        self.staging.planned(hashes[:n * size])
        self._push(job, group, plan, placed, batches[0].index)
        return reply, batches

    @classmethod
    def _segment_reply(cls, job: Job, epoch: int, digest: Digest, batches: list[Batch]
                       ) -> bytes:
        """The reply that hands out a segment: its first batch's manifest, with the
        other batches' paths as its ``segment``."""
        segment = [cls._paths(job, digest, batch.items) for batch in batches[1:]]
        return encode_manifest(cls._manifest(job, epoch, digest, batches[0],
                                             len(batches[0].items), segment))

    async def _plan_next(self, job: Job, group: DatasetJobs, plan: EpochPlan
                         ) -> tuple[int, bytes]:
        """Plan the job's next batch: its index and manifest."""
        sampler, ref = plan.sampler, plan.ref
        digest = group.ds.digest
        chunk_of = group.plan.chunk_of
        need = min(sampler.batch_size, sampler.remaining)
        # A probe batch takes misses the cycle reads anyway, and a run of them begins
        # only where there are enough of those for the whole run (``_uncached_ahead``);
        # a lone job's probe takes them anywhere: its chunk loads wait until its misses
        # are measured (ChunkLoader), and what it does not cache is kept for them
        # (Staging.keep_for_load).
        run = need * job.probe.run
        cooperative = (not job.probe.may_wait(plan.epoch, sampler.planned)
                       or group.mode is not CacheMode.COOP
                       or group.alone(self.cluster.me) is job
                       or await self._uncached_ahead(plan, group, run) >= run)
        probing = job.probe.plan(plan.epoch, sampler.planned, sampler.n_batches,
                                 group.mode is not CacheMode.NONE, cooperative)

        def usable_mask() -> np.ndarray:
            mask = np.zeros(group.plan.n_chunks, dtype=bool)
            mask[group.usable(ref)] = True
            return mask

        async def is_cached(items: np.ndarray) -> np.ndarray:
            # Hits come from the usable chunks. A probe's misses must be real ones: it
            # looks up every item, and takes one in hand (being fetched, or kept for its
            # chunk's load) as held.
            held = np.zeros(len(items), dtype=bool)
            asked = (np.ones(len(items), dtype=bool) if probing
                     else usable_mask()[chunk_of[items]])
            if asked.any():
                held[asked] = await self.bulk.held([digest.hash(int(i)) for i in items[asked]])
            if probing:
                held |= [self.reader.in_hand(digest.hash(int(i))) for i in items]
            return held

        def plan_here(answer: np.ndarray | None) -> tuple[np.ndarray | None, Batch | None]:
            # The steps from ``answer`` on, each block looked up in this node's store
            # while it owns every item asked about: one thread hop a batch (a hop a
            # block cost more CPU than the planning). A probe's blocks, and a block with
            # an item another node owns, go back to the loop (is_cached).
            items, batch = advance(steps, answer)
            while batch is None and not probing:
                asked = usable[chunk_of[items]]
                found = self.bulk.held_here([digest.hash(int(i)) for i in items[asked]])
                if found is None:
                    break
                held = np.zeros(len(items), dtype=bool)
                held[asked] = found
                items, batch = advance(steps, held)
            return items, batch

        if not probing:
            await self._wait_for_chunks(job, group, plan, need)
        upcoming = group.upcoming()
        ahead = group.probe_ahead() if probing else []
        others = await self._others_loading(group)
        loading = group.view.loading if group.view is not None else ()

        def prefer(items: np.ndarray) -> np.ndarray:
            # Misses in the resident chunks first: this node's share of the loading
            # chunks, and items of loaded chunks that were culled (refilling them lets
            # those chunks be consumed, released and replaced). Then the chunk that loads
            # next: its loader will find them held, and other jobs will hit them. Then
            # other nodes' shares of the loading chunks. A probe takes the chunk that
            # loads next first, then the loading chunks, then the chunk after the next:
            # their loaders leave what a probe planned to the job's read, a real miss,
            # whereas a loading chunk's loader may have the item in hand already and
            # make the miss look cheap.
            chunks = chunk_of[items]
            rank = 3 * usable[chunks] + 2 * (chunks == upcoming)
            if probing:
                rank += 3 * np.isin(chunks, loading) + 5 * np.isin(chunks, ahead)
            if others is not None:
                rank[others[items]] = 1
            return rank
        # The sampler's steps run in a worker, with the usable chunks as the planning
        # begins; a block only a peer or the loop can answer is looked up from here,
        # between two steps, so no worker waits for another's token.
        usable = usable_mask()
        steps = sampler.planning(prefer, group.oldest_usable(ref), probe=probing)
        items, batch = await trio.to_thread.run_sync(plan_here, None, limiter=self.limiter)
        while batch is None:
            items, batch = await trio.to_thread.run_sync(plan_here, await is_cached(items),
                                                         limiter=self.limiter)
        resident = {*group.usable(ref), upcoming, *ahead}
        if probing:
            await self.probed.mark(group.ds, batch.hits, batch.fetch, [
                group.mode is not CacheMode.NONE and int(chunk_of[i]) in resident
                for i in batch.items], self.push)
        elif group.mode is not CacheMode.NONE:
            await self.bulk.fetch_all(group.ds, batch.fetch, job.counters, FetchCause.COOP_MISS,
                                      (chunk_of, resident) if group.mode is CacheMode.COOP
                                      else None)
            # misses too: fetched now, a chunk's eviction must not drop them before
            # their read (with two chunks marked at once, it could)
            self.staging.planned([digest.hash(i) for i in batch.items])
            self._push(job, group, plan, batch.hits, batch.index)
            if self.cluster.peers is not None:
                await self.bulk.stage_from_peers(group.ds, batch.hits)
        hits = 0 if probing else len(batch.hits)
        if not probing:
            job.probe.planned_hits(plan.epoch, batch.index, hits, len(batch.items))
        self._account(job, group, ref, batch.items, hits)
        return batch.index, encode_manifest(self._manifest(job, plan.epoch, digest, batch, hits))

    def _account(self, job: Job, group: DatasetJobs, ref: EpochRef, items: list[int],
                 hits: int) -> None:
        """Take planned items (a batch's, or a segment's) off the job-epoch's per-chunk
        counts (poking the heartbeat if that released a marked chunk), and count the
        hits among them."""
        if group.take(ref, items):
            self.cluster.poke()  # this job-epoch released a marked chunk
        job.counters[SamplerJobCounter.HITS] += hits
        job.counters[SamplerJobCounter.FETCHED] += len(items) - hits

    @staticmethod
    def _paths(job: Job, digest: Digest, items: list[int]) -> list[str]:
        """The items' paths relative to the job's prefix."""
        prefix = job.config.prefix.strip("/")
        cut = len(prefix) + 1 if prefix else 0
        paths = digest.paths_of(items)
        return [p[cut:] for p in paths] if cut else paths

    @staticmethod
    def _manifest(job: Job, epoch: int, digest: Digest, batch: Batch, hits: int,
                  segment: list[list[str]] | None = None) -> Manifest:
        items = batch.items
        return Manifest(epoch=epoch, batch=batch.index, hits=hits,
                        paths=BatchPlanner._paths(job, digest, items),
                        labels=[digest.label(i) for i in items],
                        hashes=[h.hex() for h in digest.hashes_of(items)],
                        segment=segment or [])

    async def _uncached_ahead(self, plan: EpochPlan, group: DatasetJobs, need: int) -> float:
        """About how many of the job's pending items in the loading chunks, and the two
        that load next, are neither cached nor in hand (``ItemReader.in_hand``), up to
        ``need``: a run of probe batches from those reads what the cycle brings in
        anyway. (Its planning takes items in hand as held, as it must, and where a run
        runs short of misses it reads what others already fetched, a second bucket read
        of each.) The first PROBE_LOOKUPS of each chunk's pending items, in the job's
        random order, are looked up, and the share of them found uncached stands for
        the rest. Asked only where the probe may wait (``BenefitProbe.may_wait``)."""
        view, found = group.view, 0.0
        if view is None:
            return 0.0
        for chunk in (*view.loading, *group.probe_ahead()):
            pending = plan.sampler.pending_in(chunk)
            if not len(pending):
                continue
            hashes = [group.ds.digest.hash(int(i)) for i in pending[:PROBE_LOOKUPS]]
            held = await self.bulk.held(hashes)
            uncached = sum(not h and not self.reader.in_hand(d) for h, d in zip(held, hashes))
            found += uncached * len(pending) / len(hashes)
            if found >= need:
                break
        return found

    async def _others_loading(self, group: DatasetJobs) -> np.ndarray | None:
        """``group.others_loading``: its mask over every item is built in a worker."""
        if group.others_loading_known(self.cluster.me):
            return group.others_loading(self.cluster.me)
        return await trio.to_thread.run_sync(group.others_loading, self.cluster.me,
                                             limiter=self.limiter)

    async def _wait_for_chunks(self, job: Job, group: DatasetJobs, plan: EpochPlan,
                               need: int) -> None:
        """In coop mode, wait (at most CHUNK_WAIT) until the usable chunks hold ``need``
        of the job's pending items: cached, or for this node to load. Until then its
        batch would be filled with misses that no other job shares now (or that another
        node is loading), so the bucket's bandwidth is better left to the loaders. A
        job with items left in a marked chunk never waits: its batches release it.
        Before the coordinator's first view, every job waits for it: batches planned
        then would all be misses, read again when their chunks load. Nor does a lone
        job being probed: the dataset's loads wait for its probe (``ChunkLoader``), so
        the chunks it would wait for come only after its next batches end the probe."""
        started = trio.current_time()
        key = group.cycle_key()
        with trio.move_on_after(CHUNK_WAIT) as scope:
            while (group.mode is CacheMode.COOP and key != plan.gave_up_on
                   and not (job.probe.active and group.alone(self.cluster.me) is job)):
                changed = group.changed  # before the look, which may await: see ViewJobs
                if group.view is None:
                    await changed.wait()
                    key = group.cycle_key()
                    continue
                usable = group.usable(plan.ref)
                supply = int(plan.ref.remaining_chunks[usable].sum())
                others = await self._others_loading(group)
                if others is not None:  # other nodes' shares count once they hold them
                    for chunk in set(group.view.loading) & set(usable):
                        pending = plan.sampler.pending_in(chunk)
                        theirs = pending[others[pending]]
                        held = await self.bulk.held([group.ds.digest.hash(int(i))
                                                     for i in theirs])
                        supply -= len(theirs) - sum(held)
                marked = [c for c in group.view.marked if c in usable]
                if supply >= need or plan.ref.remaining_chunks[marked].any():
                    break  # enough to plan from, or the job holds back a marked chunk
                await changed.wait()  # the cycle moved, or another node loaded more
                key = group.cycle_key()
        if scope.cancelled_caught:
            plan.gave_up_on = key
            log.info("job %s: no chunk came in %.0f s; fetching misses", job.id, CHUNK_WAIT)
        job.counters[SamplerJobCounter.CHUNK_WAIT_S] += trio.current_time() - started


def _max_segment(batch_size: int) -> int:
    """The most batches of ``batch_size`` items one segment hands out."""
    return max(SEGMENT_BATCHES, SEGMENT_ITEMS // batch_size)

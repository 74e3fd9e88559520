"""The coordinator's state and decisions, as plain synchronous logic.

Nodes join with their peer address and capacity and then send a heartbeat every
fraction of a second, reporting per dataset (by digest identity) their jobs' epoch
references and which chunk shares they finished loading. The answer is the live
membership and each dataset's chunk cycle with the nodes that load the current
chunk. A node whose heartbeats stop for ``heartbeat_timeout`` seconds is dead: its
keys move to the survivors and its jobs stop pinning chunks. One not heard from for
``forget_after`` seconds is forgotten: gone from the membership and from every dataset.
A dataset no node has reported for ``forget_datasets_after`` seconds is forgotten too.
These silences are counted while the coordinator runs (``coordinator.run_clock``): after
it was stopped, stalled or down, every node that was live gets a full heartbeat timeout.

The same class runs inside ``quiver coordinator`` and, for a single node without
``--coordinator``, inside mountd. It is saved in its state directory, and resumed from
there at a start, by ``coordinator.state_store``.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from coordinator import state_store
from coordinator.allocation import DatasetDemand, JobBenefit, allocate, resident_chunks
from coordinator.run_clock import MAX_GAP, RunClock
from coordinator.state_records import DatasetState, Node
from quiverfs.chunk_cycle import FORCE_EVICT_AFTER, ChunkCycle
from quiverfs.heartbeat import (PROBE_BATCHES, CacheMode, CycleView, Heartbeat, HeartbeatReply,
                                LoadedShare, Member)

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT = 5.0  # seconds without a heartbeat before a node is dead
REPROBE_AFTER = 600.0  # seconds between probes of a job
FORGET_AFTER = 600.0  # seconds without a heartbeat before a node is forgotten, at least
FORGET_DATASETS_AFTER = 86400.0  # seconds no node reports a dataset before it is forgotten


class CoordinatorState:
    """Membership, datasets and chunk cycles; persisted in ``state_dir``, or by its owner
    where that is None (``coordinator.etcd_store``)."""

    def __init__(self, state_dir: str | None, heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
                 force_after: float = FORCE_EVICT_AFTER, budget: int | None = None,
                 probe_batches: int = PROBE_BATCHES, reprobe_after: float = REPROBE_AFTER,
                 forget_after: float | None = None,
                 forget_datasets_after: float = FORGET_DATASETS_AFTER) -> None:
        self.heartbeat_timeout = heartbeat_timeout
        # A gap shorter than a heartbeat timeout: one the clock counts cannot kill a node
        # that beat just before it.
        self.clock = RunClock(min(MAX_GAP, heartbeat_timeout / 2))
        self.tick = self.clock.max_gap / 4  # the owner reads the clock at least this often
        # None: FORGET_AFTER, or the heartbeat timeout where longer (a node is dead first)
        self.forget_after = (max(FORGET_AFTER, heartbeat_timeout) if forget_after is None
                             else forget_after)
        self.forget_datasets_after = forget_datasets_after
        self.force_after = force_after
        self.budget = budget  # bytes of cache cluster-wide; None: the nodes' capacities
        self.probe_batches = probe_batches
        self.reprobe_after = reprobe_after
        self.nodes: dict[str, Node] = {}
        self.datasets: dict[str, DatasetState] = {}
        self.bandwidth: dict[str, float] = {}  # node -> what its bucket fetches get
        self.version = 0  # bumped when membership changes
        self._alive: set[str] = set()
        self._saved_at = 0.0  # the clock's reading at the last snapshot
        self.dirty = False  # changed since ``pending()`` last gave the state to save
        self.store = None if state_dir is None else state_store.StateStore(state_dir)
        if self.store is not None:
            saved = self.store.load(self.force_after, self.now())
            if saved is not None:
                self.resume(saved)

    # -- persistence (the file is coordinator.state_store's) --------------------------
    def resume(self, saved: state_store.Saved) -> None:
        """Go on from ``saved`` (restored at ``now()``): at a start, or when a standby
        takes over; the membership version moves past the saved one."""
        now = self.now()
        self.nodes, self.datasets, self.bandwidth = saved.nodes, saved.datasets, {}
        self.version = saved.version + 1
        log.info("resumed: %d nodes, %d datasets", len(self.nodes), len(self.datasets))
        self.forget(now)
        # The time it was down is no node's silence: the live ones beat on meanwhile.
        self._alive = self._renew(now)

    def snapshot(self) -> bytes:
        """The state file's contents (whose silences count as saved)."""
        now = self._saved_at = self.now()
        return state_store.encode(self.version, self.nodes.values(), self.datasets.values(),
                                  now)

    def pending(self) -> bool:
        """Whether the state changed since the last call (which the caller then saves)."""
        if not self.dirty:
            return False
        self.dirty = False
        self._saved_at = self.now()
        return True

    def changes(self) -> bytes | None:
        """The state file's contents if the state changed since the last call: the
        caller writes them with ``write``, off the event loop (it fsyncs)."""
        return self.snapshot() if self.pending() else None

    def save(self) -> None:
        """Write the state file now (atomically); raises OSError or QuietError."""
        self.store.save(self.snapshot())

    def write(self, data: bytes) -> None:
        """Write ``data`` as the state file, or log why not (``StateStore.write``)."""
        self.store.write(data)

    # -- membership -------------------------------------------------------------------
    def now(self) -> float:
        """The clock silences are counted on: seconds this coordinator has run. Read
        after a gap in which it did not run, it gives every live node a full heartbeat
        timeout again."""
        now, gap = self.clock.read()
        if gap:
            renewed = self._renew(now)
            # Past a heartbeat timeout, counting the gap would have killed every node.
            log.log(logging.WARNING if gap > self.heartbeat_timeout else logging.DEBUG,
                    "the coordinator did not run for %.1f s (stopped or stalled): not "
                    "counted as silence; %d live node(s) get a full heartbeat timeout",
                    gap, len(renewed))
        return now

    def _renew(self, now: float) -> set[str]:
        """Count the live nodes as heard from ``now``; their ids."""
        live = self.live(now)
        for node in live:
            node.last_seen = now
        return {n.id for n in live}

    def live(self, now: float | None = None) -> list[Node]:
        now = self.now() if now is None else now
        return sorted((n for n in self.nodes.values()
                       if now - n.last_seen <= self.heartbeat_timeout), key=lambda n: n.id)

    def join(self, node: str, peer: str, capacity: int, now: float | None = None
             ) -> HeartbeatReply:
        now = self.now() if now is None else now
        known = self.nodes.get(node)
        if known is None or known.peer != peer or known.capacity != capacity:
            self.nodes[node] = Node(node, peer, capacity, now)
            self.version += 1
            log.info("node %s joined (peer %s, capacity %d)", node, peer, capacity)
            self.dirty = True
        else:
            was_dead = now - known.last_seen > self.heartbeat_timeout
            known.last_seen = now
            if was_dead:
                self.version += 1
                log.info("node %s is back", node)
        return self._view(now)

    def _view(self, now: float) -> HeartbeatReply:
        return HeartbeatReply(self.version, tuple(Member(n.id, n.peer, n.capacity)
                                                  for n in self.live(now)))

    def _expire(self, now: float) -> None:
        """Bump the version when a node's heartbeats stopped (its keys move)."""
        alive = {n.id for n in self.live(now)}
        if alive != self._alive:
            self.version += 1
            gone = self._alive - alive
            if gone:
                log.warning("node(s) %s declared dead", ", ".join(sorted(gone)))
        self._alive = alive

    def forget(self, now: float | None = None) -> list[str]:
        """Forget the nodes not heard from for ``forget_after`` seconds, and the datasets
        no node reported for ``forget_datasets_after``; the nodes' ids."""
        now = self.now() if now is None else now
        silent = sorted(n.id for n in self.nodes.values()
                        if now - n.last_seen > self.forget_after)
        for node in silent:
            quiet = now - self.nodes[node].last_seen
            self.drop(node, f"not heard from for {quiet:.0f} s" if math.isfinite(quiet)
                      else "the time of its last heartbeat is not known")
        for ds in [d for d in self.datasets.values()
                   if now - d.last_reported > self.forget_datasets_after]:
            # Its cycle, loaders, allocation and probes all live in its record.
            del self.datasets[ds.identity]
            self.dirty = True
            log.info("forgot dataset %s (%s): no node reported it for %.0f s", ds.name,
                     ds.identity, now - ds.last_reported)
        return silent

    def drop(self, node: str, why: str) -> None:
        """Remove ``node`` from the membership and from every dataset: its report, its
        jobs and their probes, and its shares of loading chunks."""
        del self.nodes[node]
        self.bandwidth.pop(node, None)
        for ds in self.datasets.values():
            ds.leave(node)
            for key in [k for k in ds.probes if k.partition("/")[0] == node]:
                del ds.probes[key]
                ds.probed_at.pop(key, None)
        self.dirty = True
        log.warning("forgot node %s: %s", node, why)

    def _check(self, beat: Heartbeat, now: float) -> None:
        """Refuse (ValueError) a heartbeat whose chunk counts disagree with another live
        node's for the same dataset: the nodes' --chunk-size differ."""
        live = {n.id for n in self.live(now)}
        for identity, report in beat.datasets.items():
            ds = self.datasets.get(identity)
            if ds is None:
                continue
            for other, theirs in ds.reports.items():
                if other != beat.node and other in live and theirs.chunks != report.chunks:
                    raise ValueError(
                        f"dataset {report.name}: node {beat.node} plans {report.chunks} "
                        f"chunks, node {other} {theirs.chunks}: give every node the same "
                        "--chunk-size")

    # -- heartbeats -------------------------------------------------------------------
    def heartbeat(self, beat: Heartbeat, now: float | None = None) -> HeartbeatReply:
        """Record a node's report; advance the cycles; return what the node should do.
        A refused heartbeat (ValueError) changes nothing."""
        now = self.now() if now is None else now
        self._check(beat, now)
        view = self.join(beat.node, beat.peer, beat.capacity, now)
        if beat.bucket_bps is not None:
            self.bandwidth[beat.node] = beat.bucket_bps
        self.forget(now)
        self._expire(now)
        alive = {n.id for n in view.nodes}
        # Silences are saved at least once a heartbeat timeout, so a restart after a
        # crash finds them about that recent.
        changed = now - self._saved_at >= self.heartbeat_timeout
        for identity, report in beat.datasets.items():
            ds = self.datasets.get(identity)
            if ds is not None and ds.cycle.n_chunks != report.chunks:
                # No live node plans the old count (_check): the plan changed, e.g. a
                # lone node restarted with another cache size.
                log.info("dataset %s: %d chunks now, not %d: its cycle starts afresh",
                         report.name, report.chunks, ds.cycle.n_chunks)
                ds = None
            if ds is None:
                ds = self.datasets[identity] = DatasetState(
                    identity, report.name, ChunkCycle(report.chunks, self.force_after))
                changed = True
            ds.reports[beat.node] = report
            ds.last_reported = now
        for ds in self.datasets.values():
            # A node reports every dataset it has jobs on: one it leaves out has none
            # there now, and would pin chunks and take a share of the budget for them.
            if ds.identity not in beat.datasets:
                changed |= ds.leave(beat.node)
            for gone in [n for n in ds.reports if n not in alive]:
                del ds.reports[gone]
        changed |= self._allocate(now)
        cycles = {}
        for ds in self.datasets.values():
            changed |= self._advance(ds, alive, now)
            if beat.node in ds.reports:
                cycles[ds.identity] = self._cycle_view(ds, beat.node)
        self.dirty |= changed
        return dataclasses.replace(view, cycles=cycles)

    def _cycle_view(self, ds: DatasetState, node: str) -> CycleView:
        """The cycle of ``ds`` as ``node`` acts on it, with the probes of its jobs."""
        cycle = ds.cycle
        jobs = {j.id for j in ds.reports[node].jobs}
        probes = {}
        for key, seq in ds.probes.items():
            on, _, job = key.partition("/")
            if on == node and job in jobs:
                probes[job] = seq
        return CycleView(
            chunks=cycle.n_chunks, states=tuple(cycle.states), resident=tuple(cycle.resident),
            marked=dict(cycle.marks), generation=cycle.generation, next=cycle.next,
            capacity=cycle.capacity, max_resident=cycle.max_resident,
            loads=tuple(LoadedShare(c, tuple(ds.loaders.get(c, ()))) for c in cycle.loading),
            users=tuple(_users(ds)), mode=ds.mode, probe_batches=self.probe_batches,
            probes=probes)

    def _allocate(self, now: float) -> bool:
        """Ask for probes where due, then decide every dataset's mode and chunk depth;
        True on a change."""
        demands = []
        for ds in self.datasets.values():
            self._ask_for_probe(ds, now)
            jobs = tuple(JobBenefit(j.gpus, j.t_miss, j.t_hit, j.batch_bytes)
                         for report in ds.reports.values() for j in report.jobs)
            reports = ds.reports.values()
            demands.append(DatasetDemand(
                ds.identity, max((r.size for r in reports), default=0),
                max((r.chunk_bytes for r in reports), default=0), jobs,
                max((r.chunks for r in reports), default=1)))
        budget = self.budget if self.budget is not None else sum(
            n.capacity for n in self.live(now))
        bandwidth = self.bucket_bandwidth(now)
        modes = allocate(demands, budget, bandwidth)
        depths = resident_chunks(demands, modes, budget)
        changed = False
        for d in demands:
            ds = self.datasets[d.identity]
            ds.gain = d.gain
            depth = depths.get(d.identity, ds.cycle.capacity)
            if d.jobs and depth != ds.cycle.capacity:
                log.info("dataset %s: %d chunks may be resident (was %d)", ds.name, depth,
                         ds.cycle.capacity)
                ds.cycle.capacity = depth
                changed = True
            if d.jobs and modes[d.identity] != ds.mode:
                log.info("dataset %s: %s -> %s (G %.2f over %d jobs; needs %d bytes for two "
                         "chunks, %d in full; budget %d; bucket %s B/s)", ds.name, ds.mode,
                         modes[d.identity], d.gain, len(d.jobs), d.coop_cost, d.size, budget,
                         bandwidth and round(bandwidth))
                ds.mode = modes[d.identity]
                changed = True
        return changed

    def bucket_bandwidth(self, now: float) -> float | None:
        """Bytes per second the bucket gives the cluster: the sum of what the live
        nodes' fetches get (each measures its own); None before any has measured it."""
        rates = [self.bandwidth[n.id] for n in self.live(now) if n.id in self.bandwidth]
        return sum(rates) if rates else None

    def _advance(self, ds: DatasetState, alive: set[str], now: float) -> bool:
        """Move one dataset's cycle forward; True if anything changed."""
        cycle = ds.cycle
        if ds.mode is CacheMode.NONE and cycle.resident_count():
            cycle.evict_all()
            ds.loaders, ds.done = {}, {}
            return True
        users = _users(ds)
        changed = False
        for chunk in cycle.loading:
            loaders = [n for n in ds.loaders.get(chunk, ()) if n in alive] or users
            if loaders != ds.loaders.get(chunk):  # a loader died: survivors split it anew
                ds.loaders[chunk], ds.done[chunk] = loaders, set()
                changed = True
            share = LoadedShare(chunk, tuple(loaders))
            done = ds.done.setdefault(chunk, set())
            done.update(n for n, r in ds.reports.items() if share in r.loaded)
            if loaders and set(loaders) <= done:
                cycle.loaded(chunk)
                del ds.loaders[chunk], ds.done[chunk]
                changed = True
        if not users:
            return changed
        refs = [j.epoch_ref() for r in ds.reports.values() for j in r.jobs]
        while (victim := cycle.evictable(refs, now)) is not None:
            cycle.evicted(victim)
            changed = True
        if ds.mode is CacheMode.COOP:
            # The cycle follows what the jobs still need: in ring order it would load
            # chunks at an epoch's end that are evicted before anyone reads them.
            for chunk in cycle.start_loading(refs):
                ds.loaders[chunk], ds.done[chunk] = users, set()
                changed = True
            at_once = _marks_at_once(ds)
            while cycle.mark(refs, at_once) is not None:
                changed = True
        return changed

    def _ask_for_probe(self, ds: DatasetState, now: float) -> None:
        """Ask for the probe of at most one job of ``ds`` at a time, cluster-wide, among
        those never probed or probed ``reprobe_after`` seconds ago: probes of several
        jobs at once would each force their own bucket reads, which nothing shares."""
        jobs = [(f"{node}/{j.id}", j) for node, r in ds.reports.items() for j in r.jobs
                if j.probeable]
        if any(j.probing or ds.probes.get(key, 0) > j.probe_seq for key, j in jobs):
            return
        for key, _ in jobs:
            if key not in ds.probes or now - ds.probed_at[key] > self.reprobe_after:
                ds.probes[key] = ds.probes.get(key, 0) + 1
                ds.probed_at[key] = now
                return

    def status(self, now: float | None = None) -> dict[str, Any]:
        now = self.now() if now is None else now
        live = {n.id for n in self.live(now)}
        return {
            "version": self.version,
            "not_running_s": round(self.clock.left_out, 1),
            "nodes": [{"id": n.id, "peer": n.peer, "capacity": n.capacity,
                       "alive": n.id in live, "last_seen_s": round(now - n.last_seen, 1)}
                      for n in sorted(self.nodes.values(), key=lambda n: n.id)],
            "budget": self.budget if self.budget is not None else sum(
                n.capacity for n in self.live(now)),
            "bucket_bandwidth": self.bucket_bandwidth(now),
            "datasets": [{"identity": d.identity, "name": d.name, **d.cycle.snapshot(),
                          "loading": d.cycle.loading, "active": d.cycle.active,
                          "loaders": {str(c): n for c, n in d.loaders.items()},
                          "mode": d.mode, "gain": round(d.gain, 3),
                          "jobs": [{"node": n, "id": j.id, "gen": j.gen, "gpus": j.gpus,
                                    "probe_seq": j.probe_seq, "t_miss": j.t_miss,
                                    "t_hit": j.t_hit, "probing": j.probing,
                                    "benefit": j.benefit}
                                   for n, r in d.reports.items() for j in r.jobs],
                          "timeline": d.cycle.timeline[-200:]}
                         for d in self.datasets.values()]}


def _marks_at_once(ds: DatasetState) -> int:
    """Chunks of ``ds`` to mark at once: as many as the largest batch its jobs report
    spans at the mean chunk's size, so that one round of releases makes room for a
    batch of each (ChunkCycle)."""
    batch = max((j.batch_bytes for r in ds.reports.values() for j in r.jobs), default=0)
    spans = [batch * r.chunks / r.size for r in ds.reports.values() if r.size]
    return max(1, math.ceil(max(spans, default=0)))


def _users(ds: DatasetState) -> list[str]:
    """The nodes with jobs on ``ds``."""
    return sorted(n for n, r in ds.reports.items() if r.jobs)
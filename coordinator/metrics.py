"""The coordinator's Prometheus metrics: members, chunk states, allocation, benefits.

Served by quiverfs.metrics_server. The coordinator's state changes only on its trio
loop, so the families are built there, in one plain function (``TrioLoop.run_sync``
from the scrape's thread), and every scrape sees one consistent moment.
"""
from __future__ import annotations

import logging
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from coordinator.leadership import Leadership
from coordinator.state import CoordinatorState
from quiverfs.chunk_cycle import ChunkState
from quiverfs.metrics_server import LoopUnavailable, TrioLoop

log = logging.getLogger(__name__)

MODES = ("coop", "full", "none")


class CoordinatorCollector:
    """Metric families read from the coordinator's state at scrape time, on its loop."""

    def __init__(self, state: CoordinatorState, leadership: Leadership | None = None,
                 loop: TrioLoop | None = None) -> None:
        self.state = state
        self.leadership = leadership  # with --etcd
        self.loop = loop or TrioLoop()

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self.loop.run_sync(self._families)
        except LoopUnavailable as exc:  # everything here is the loop's
            log.warning("metrics: %s: exporting no coordinator numbers", exc)

    def _families(self) -> list[Metric]:
        """Every family, built at one moment (runs on the loop): a standby's are its
        role's alone."""
        role = self._role()
        if self.leadership is not None and not self.leadership.leading():
            return role
        return role + self._state()

    def _role(self) -> list[Metric]:
        """Whether this coordinator leads, its lease, its takeovers, its etcd writes."""
        lead = self.leadership
        leader = GaugeMetricFamily("quiver_coordinator_leader", "1 while this coordinator "
                                   "leads, 0 while it stands by")
        leader.add_metric([], 1.0 if lead is None or lead.leading() else 0.0)
        if lead is None:
            return [leader]
        ttl = GaugeMetricFamily("quiver_coordinator_lease_ttl_seconds", "The TTL of the "
                                "leader's lease in etcd")
        ttl.add_metric([], lead.ttl)
        takeovers = CounterMetricFamily("quiver_coordinator_takeovers", "Times this "
                                        "coordinator became the leader")
        takeovers.add_metric([], lead.takeovers)
        last = GaugeMetricFamily("quiver_coordinator_last_takeover_timestamp_seconds",
                                 "Wall-clock time this coordinator last became the leader "
                                 "(0: never)")
        last.add_metric([], lead.last_takeover or 0.0)
        writes = CounterMetricFamily("quiver_coordinator_etcd_writes", "State transactions "
                                     "etcd applied for this coordinator")
        writes.add_metric([], lead.store.transactions)
        keys = CounterMetricFamily("quiver_coordinator_etcd_keys_written", "Keys put or "
                                   "deleted by those transactions")
        keys.add_metric([], lead.store.keys_written)
        written = CounterMetricFamily("quiver_coordinator_etcd_written_bytes", "Bytes of the "
                                      "values those transactions put")
        written.add_metric([], lead.store.bytes_written)
        return [leader, ttl, takeovers, last, writes, keys, written]

    def _state(self) -> list[Metric]:
        """The state's families."""
        state, now = self.state, self.state.now()
        live = {n.id for n in state.live(now)}
        nodes = GaugeMetricFamily("quiver_coordinator_nodes", "Members, live or dead",
                                  labels=["state"])
        nodes.add_metric(["live"], len(live))
        nodes.add_metric(["dead"], len(state.nodes) - len(live))
        stopped = CounterMetricFamily("quiver_coordinator_not_running_seconds",
                                      "Seconds the coordinator was stopped or stalled, "
                                      "counted as no node's silence")
        stopped.add_metric([], state.clock.left_out)
        budget = GaugeMetricFamily("quiver_coordinator_budget_bytes",
                                   "Cache bytes the allocation shares out")
        budget.add_metric([], state.budget if state.budget is not None else sum(
            n.capacity for n in state.nodes.values() if n.id in live))
        chunks = GaugeMetricFamily("quiver_coordinator_chunks", "Chunks of a dataset in "
                                   "each state", labels=["dataset", "state"])
        resident = GaugeMetricFamily("quiver_coordinator_max_resident_chunks",
                                     "Most chunks of a dataset resident at once",
                                     labels=["dataset"])
        depth = GaugeMetricFamily("quiver_coordinator_resident_chunk_limit", "K: chunks of a "
                                  "dataset its allotment lets be resident at once",
                                  labels=["dataset"])
        mode = GaugeMetricFamily("quiver_coordinator_dataset_mode", "The dataset's cache "
                                 "allocation (1 for the mode in force)",
                                 labels=["dataset", "mode"])
        gain = GaugeMetricFamily("quiver_coordinator_dataset_gain", "G: GPU shares the "
                                 "dataset's jobs save with the cache", labels=["dataset"])
        benefit = GaugeMetricFamily("quiver_coordinator_job_benefit", "b = t_miss / t_hit "
                                    "of a probed job", labels=["dataset", "node", "job"])
        for ds in state.datasets.values():
            for s in ChunkState:
                chunks.add_metric([ds.name, s.value],
                                  sum(st is s for st in ds.cycle.states))
            resident.add_metric([ds.name], ds.cycle.max_resident)
            depth.add_metric([ds.name], ds.cycle.capacity)
            for m in MODES:
                mode.add_metric([ds.name, m], float(ds.mode == m))
            gain.add_metric([ds.name], ds.gain)
            for node, report in ds.reports.items():
                for job in report.jobs:
                    if job.benefit is not None:
                        benefit.add_metric([ds.name, node, job.id], job.benefit)
        return [nodes, stopped, budget, chunks, resident, depth, mode, gain, benefit]

"""mountd's Prometheus collectors, served by quiverfs.metrics_server on ``--metrics``.

The read counters, the mount table, the jobs and the chunk cycles are only changed by
tasks on mountd's trio loop, so their families are built there, in one plain function
(``TrioLoop.run_sync`` from the scrape's thread): one consistent moment, with no locks.
The store's numbers (a blocking SQLite read for its size and item count) are read in
the scrape's own thread.
"""
from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mountd.fetch.read_stats import ReadStats
from quiverfs.chunk_cycle import ChunkState
from quiverfs.counters import ReadCounter, SamplerJobCounter
from quiverfs.metrics_server import LoopUnavailable, TrioLoop

if TYPE_CHECKING:
    from mountd.cluster.coordinators import RemoteCoordinators
    from mountd.fetch.loader_pool import LoaderPool
    from mountd.fetch.services import ReadServices
    from mountd.jobs.registry import JobRegistry
    from mountd.datasets.mount_table import MountTable

log = logging.getLogger(__name__)

# The ReadStats counters behind the per-tier families. An exact read ends as one of
# local_hits, peer_hits or misses, and every miss as a bucket fetch or a bucket error.
HITS = {"local": ReadCounter.LOCAL_HITS, "peer": ReadCounter.PEER_HITS,
        "bucket": ReadCounter.BUCKET_FETCHES}
BYTES = {"local": ReadCounter.LOCAL_BYTES, "peer": ReadCounter.PEER_BYTES,
         "bucket": ReadCounter.BUCKET_BYTES}
ERRORS = {"local": ReadCounter.STORE_ERRORS, "peer": ReadCounter.PEER_ERRORS,
          "bucket": ReadCounter.BUCKET_ERRORS}
# The gauges of each loader pool (serving: misses readers wait on; ahead: chunk loads),
# by their key in LoaderPool.status.
LOADER_GAUGES = {
    "processes": ("quiver_loader_processes", "Loader processes the pool keeps"),
    "running": ("quiver_loader_processes_running", "The pool's processes running (they "
                "start with the pool's first use of a GCS bucket)"),
    "ready": ("quiver_loader_processes_ready", "The pool's processes ready for requests"),
    "slots": ("quiver_loader_request_slots", "Requests the pool's processes hold at once"),
    "in_flight": ("quiver_loader_requests_in_flight", "Requests the pool's processes "
                  "hold now"),
    "waiting": ("quiver_loader_requests_waiting", "Requests waiting for a slot of the pool"),
}
# The native data plane's counters (mountd/native/plane.h) that no other family holds
# (its hits, and its requests by opcode, are counted with Python's), by their key in
# Plane.counters.
NATIVE_COUNTERS = {
    "reads": ("quiver_native_reads", "READs the native data plane answered"),
    "read_bytes": ("quiver_native_read_bytes", "Bytes the native data plane's READs "
                   "returned"),
    "copied": ("quiver_native_copied_reads", "READs whose bytes the native data plane "
               "copied through its thread rather than splicing them from the store's file"),
    "hits": ("quiver_native_hits", "Files the native data plane served (READs at offset 0)"),
    "forwarded": ("quiver_native_forwarded_requests", "Requests the native data plane "
                  "handed to Python"),
    "fallbacks": ("quiver_native_fallback_reads", "READs of served items the native data "
                  "plane handed to Python: the store's file was gone or short"),
    "hits_dropped": ("quiver_native_dropped_hits", "Native hits never reported: Python "
                     "drained them too slowly"),
    "backing_failures": ("quiver_native_backing_failures", "Passthrough OPENs of served "
                         "items the kernel gave no backing file"),
    "store_drops": ("quiver_native_store_drops", "Store files whose pages a native READ "
                    "brought into the page cache and dropped after the file's last byte"),
    "view_opens": ("quiver_native_view_opens", "View files the native data plane opened "
                   "with an item queued for the opener's job"),
    "view_reads": ("quiver_native_view_reads", "READs of those files the plane answered"),
    "view_read_bytes": ("quiver_native_view_read_bytes", "Bytes those READs returned"),
    "view_returned": ("quiver_native_view_returned", "Items queued for a view job that the "
                      "plane gave back to mountd (withdrawn, or their file gone or short)"),
    "view_forwarded": ("quiver_native_view_forwarded_requests", "Requests of ROOT/.quiver's "
                       "connection the plane handed to the process that serves it"),
    "view_events_dropped": ("quiver_native_view_dropped_events", "View opens not reported "
                            "to mountd: Python drained them too slowly"),
    "view_waits": ("quiver_native_view_waits", "View OPENs that found their job's queue "
                   "empty and waited for mountd to queue an item"),
    "view_declined": ("quiver_native_view_declined", "Of those, the OPENs that went to "
                      "mountd's Python: declined, or what was queued taken by another"),
}


class MountdCollector:
    """Metric families of a running mountd: its live state read on the trio loop
    through ``loop``, its store read in the scrape's thread; ``loader_pools`` by name;
    ``coordinators``: those of --coordinator (None: the coordinator is embedded)."""

    def __init__(self, services: ReadServices, table: MountTable, jobs: JobRegistry,
                 loop: TrioLoop | None = None,
                 loader_pools: Mapping[str, LoaderPool] | None = None,
                 coordinators: RemoteCoordinators | None = None) -> None:
        self.stats = services.stats
        self.push = services.push
        self.store = services.store
        self.table = table
        self.jobs = jobs
        self.loader_pools = loader_pools or {}
        self.coordinators = coordinators
        self.loop = loop or TrioLoop()
        self._store_lock = threading.Lock()  # concurrent scrapes read the store in turn

    def collect(self) -> Iterator[Metric]:
        try:
            yield from self.loop.run_sync(self._loop_families)
        except LoopUnavailable as exc:  # the store's numbers need no loop
            log.warning("metrics: %s: exporting only the store's numbers", exc)
        yield from self._store()

    def _loop_families(self) -> list[Metric]:
        """Every family of the loop's state, built at one moment (runs on the loop)."""
        self.stats.gather()
        return [*self._reads(), *self.stats.latency.collect(), *self._datasets(),
                *self._chunks(), *self._jobs(), *self._loaders(), *self._native(),
                *self._coordinators()]

    def _reads(self) -> Iterator[Metric]:
        c = self.stats.counters
        hits = CounterMetricFamily("quiver_hits", "Reads served, by tier", labels=["tier"])
        misses = CounterMetricFamily("quiver_misses", "Reads a tier could not serve "
                                     "(local: went on to a peer or the bucket)", labels=["tier"])
        nbytes = CounterMetricFamily("quiver_bytes", "Bytes served, by tier", labels=["tier"])
        errors = CounterMetricFamily("quiver_read_errors", "Reads the local store failed "
                                     "(EIO), failed peer calls and bucket reads",
                                     labels=["tier"])
        for tier, key in HITS.items():
            hits.add_metric([tier], c[key])
            nbytes.add_metric([tier], c[BYTES[tier]])
        misses.add_metric(["local"], _local_misses(c))
        misses.add_metric(["peer"], _peer_misses(c))
        for tier, key in ERRORS.items():
            errors.add_metric([tier], c[key])
        yield from (hits, misses, nbytes, errors)
        yield CounterMetricFamily("quiver_integrity_failures", "Fetched items whose content "
                                  "did not match the digest (not cached, not served)",
                                  value=c[ReadCounter.INTEGRITY_FAILURES])
        yield CounterMetricFamily("quiver_coalesced_reads", "Reads that waited for a fetch "
                                  "already in flight", value=c[ReadCounter.COALESCED])
        requests = CounterMetricFamily("quiver_fuse_requests", "FUSE requests the kernel "
                                       "sent mountd, by opcode", labels=["op"])
        for op, n in sorted(self.stats.fuse_requests.items()):
            requests.add_metric([op], n)
        yield requests
        yield CounterMetricFamily("quiver_pushed_items", "Planned items pushed into the "
                                  "kernel's page cache ahead of their reads",
                                  value=c[ReadCounter.PUSHED])
        yield CounterMetricFamily("quiver_pushed_opened_items", "Pushed items opened "
                                  "(their reads served by the pushed pages)",
                                  value=c[ReadCounter.PUSHED_OPENS])
        yield CounterMetricFamily("quiver_pushed_passed_items", "Pushed items taken as read "
                                  "when their job asked for a later manifest (files "
                                  "served without OPEN)",
                                  value=c[ReadCounter.PUSHED_PASSED])
        yield CounterMetricFamily("quiver_pushed_dropped_items", "Pushed items whose pages "
                                  "were gone by their read (the read reached mountd)",
                                  value=c[ReadCounter.PUSHED_DROPPED])
        yield GaugeMetricFamily("quiver_pushed_unread_bytes", "Bytes pushed and not yet "
                                "read (bounded by --push-memory)",
                                value=self.push.held)

    def _datasets(self) -> Iterator[Metric]:
        datasets = list(self.table.by_name.values())
        yield GaugeMetricFamily("quiver_datasets", "Registered datasets", value=len(datasets))
        items = GaugeMetricFamily("quiver_dataset_items", "Items in the dataset's digest",
                                  labels=["dataset"])
        size = GaugeMetricFamily("quiver_dataset_size_bytes", "Bytes in the dataset's digest",
                                 labels=["dataset"])
        hits = CounterMetricFamily("quiver_dataset_hits", "Reads of the dataset served, by "
                                   "tier", labels=["dataset", "tier"])
        misses = CounterMetricFamily("quiver_dataset_misses", "Reads of the dataset a tier "
                                     "could not serve", labels=["dataset", "tier"])
        nbytes = CounterMetricFamily("quiver_dataset_bytes", "Bytes of the dataset served, "
                                     "by tier", labels=["dataset", "tier"])
        fetches = CounterMetricFamily("quiver_bucket_fetches", "Items of the dataset read "
                                      "from its bucket, by why they were read",
                                      labels=["dataset", "cause"])
        fetch_bytes = CounterMetricFamily("quiver_bucket_fetch_bytes", "Bytes of the "
                                          "dataset read from its bucket, by why they were "
                                          "read", labels=["dataset", "cause"])
        view = CounterMetricFamily("quiver_view_opens", "Opens of a substitutable view's "
                                   "files, by whether the item chosen was cached",
                                   labels=["dataset", "result"])
        for ds in datasets:
            items.add_metric([ds.name], len(ds.digest))
            size.add_metric([ds.name], ds.digest.total_bytes)
            for tier, key in HITS.items():
                hits.add_metric([ds.name, tier], ds.counters[key])
                nbytes.add_metric([ds.name, tier], ds.counters[BYTES[tier]])
            misses.add_metric([ds.name, "local"], _local_misses(ds.counters))
            misses.add_metric([ds.name, "peer"], _peer_misses(ds.counters))
            for cause, n in ReadStats.by_cause(ds.counters).items():
                fetches.add_metric([ds.name, cause], n["fetches"])
                fetch_bytes.add_metric([ds.name, cause], n["bytes"])
            if ds.pools is not None:
                view.add_metric([ds.name, "hit"], ds.counters[ReadCounter.VIEW_HITS])
                view.add_metric([ds.name, "miss"], ds.counters[ReadCounter.VIEW_MISSES])
        yield from (items, size, hits, misses, nbytes, fetches, fetch_bytes, view)

    def _chunks(self) -> Iterator[Metric]:
        chunks = GaugeMetricFamily("quiver_chunks", "Chunks of a dataset with jobs, by state "
                                   "(as the coordinator last said)", labels=["dataset", "state"])
        for name, group in self.jobs.groups.items():
            if group.view is None:
                continue
            counts = collections.Counter(group.view.states)
            for state in ChunkState:
                chunks.add_metric([name, state.value], counts[state.value])
        yield chunks

    def _jobs(self) -> Iterator[Metric]:
        stats = [job.stats() for job in self.jobs.jobs.values()]
        yield GaugeMetricFamily("quiver_jobs", "Registered jobs", value=len(stats))
        labels = ["job", "dataset"]
        hits = CounterMetricFamily("quiver_job_hits", "Batch items the job got as cache hits",
                                   labels=labels)
        fetched = CounterMetricFamily("quiver_job_fetched", "Batch items fetched for the job "
                                      "before its manifest", labels=labels)
        epoch = GaugeMetricFamily("quiver_job_epoch", "The job's current epoch", labels=labels)
        batch = GaugeMetricFamily("quiver_job_mean_batch_seconds", "Mean of the batch times "
                                  "the job reported (last 1000)", labels=labels)
        probed = GaugeMetricFamily("quiver_job_probed_batch_seconds", "Mean batch time "
                                   "measured with the job's reads all hits or all misses",
                                   labels=[*labels, "reads"])
        benefit = GaugeMetricFamily("quiver_job_benefit", "The job's speed-up from the "
                                    "cache: miss batch time over hit batch time",
                                    labels=labels)
        for s in stats:
            key = [s["job"], s["dataset"] or ""]
            hits.add_metric(key, s["counters"].get(SamplerJobCounter.HITS, 0))
            fetched.add_metric(key, s["counters"].get(SamplerJobCounter.FETCHED, 0))
            epoch.add_metric(key, s["epoch"])
            if s["mean_batch_s"] is not None:
                batch.add_metric(key, s["mean_batch_s"])
            for reads, measured in (("hit", s["t_hit"]), ("miss", s["t_miss"])):
                if measured is not None:
                    probed.add_metric([*key, reads], measured)
            if s["benefit"] is not None:
                benefit.add_metric(key, s["benefit"])
        yield from (hits, fetched, epoch, batch, probed, benefit)

    def _loaders(self) -> Iterator[Metric]:
        families = {key: GaugeMetricFamily(name, text, labels=["pool"])
                    for key, (name, text) in LOADER_GAUGES.items()}
        for pool_name, pool in self.loader_pools.items():
            status = pool.status()
            for key, family in families.items():
                family.add_metric([pool_name], status[key])
        yield from families.values()

    def _native(self) -> Iterator[Metric]:
        """The native data plane's counters; families without a sample where files are
        served by Python (--data-path python, or the plane could not start)."""
        native = self.stats.native
        for key, (name, text) in NATIVE_COUNTERS.items():
            family = CounterMetricFamily(name, text)
            if key in native:
                family.add_metric([], native[key])
            yield family

    def _coordinators(self) -> Iterator[Metric]:
        """The coordinators of --coordinator, which one is in use and the switches;
        families without a sample where the coordinator is embedded."""
        in_use = GaugeMetricFamily("quiver_coordinator_in_use", "1 for the coordinator "
                                   "whose answers the node follows (the leader, when it "
                                   "last answered), 0 for the others of --coordinator",
                                   labels=["address"])
        switches = CounterMetricFamily("quiver_coordinator_switches", "Heartbeats answered "
                                       "by another coordinator than the one before (a "
                                       "takeover or an outage followed)")
        if self.coordinators is not None:
            status = self.coordinators.status()
            for address in status["addresses"]:
                in_use.add_metric([address], int(address == status["in_use"]))
            switches.add_metric([], status["switches"])
        yield from (in_use, switches)

    def _store(self) -> Iterator[Metric]:
        """The store's families (blocking: runs in the scrape's thread)."""
        store = self.store
        with self._store_lock:
            used, limit, items = store.volume(), store.size_limit, len(store)
            corrupt, scrub, health = store.corrupt_dropped, store.scrub, store.health()
        yield GaugeMetricFamily("quiver_cache_used_bytes", "Bytes the local store uses on "
                                "disk", value=used)
        yield GaugeMetricFamily("quiver_cache_limit_bytes", "The store's bound "
                                "(--cache-size)", value=limit)
        yield GaugeMetricFamily("quiver_cache_items", "Items in the local store", value=items)
        yield CounterMetricFamily("quiver_cache_corrupt_dropped", "Store entries that failed "
                                  "their checksum or hash and were dropped", value=corrupt)
        yield CounterMetricFamily("quiver_cache_scrubbed_bytes", "Bytes of the store the "
                                  "scrubber hashed again", value=scrub.scrubbed_bytes)
        yield CounterMetricFamily("quiver_cache_scrub_passes", "Passes of the scrubber over "
                                  "every entry of the store", value=scrub.scrub_passes)
        yield CounterMetricFamily("quiver_cache_scrub_failures", "Store entries the scrubber "
                                  "found changed on disk (or unreadable) and dropped",
                                  value=scrub.scrub_failures)
        yield GaugeMetricFamily("quiver_store_writable", "1 if the store's last write "
                                "worked, 0 while it cannot write (reads served uncached)",
                                value=int(health.writable))
        yield CounterMetricFamily("quiver_store_write_failures", "Items the store could not "
                                  "write (a full or failing disk): served uncached",
                                  value=health.write_failures)


def _local_misses(counters: collections.Counter[ReadCounter]) -> int:
    """Reads the local store could not serve: those a peer served, and the misses."""
    return counters[ReadCounter.PEER_HITS] + counters[ReadCounter.MISSES]


def _peer_misses(counters: collections.Counter[ReadCounter]) -> int:
    """Reads the owning peer could not serve: it did not hold the item, or failed."""
    return counters[ReadCounter.PEER_MISSES] + counters[ReadCounter.PEER_ERRORS]

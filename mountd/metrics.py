"""mountd's Prometheus endpoint: ``GET /metrics`` on ``--metrics HOST:PORT``.

The endpoint is served from the trio loop, on purpose: the read counters, the mount
table, the jobs and the chunk cycles are only changed by tasks on that loop, so a
collector running there reads them between two steps of those tasks and sees one
consistent moment, with no locks and no copies. The one blocking read, the store's
size and item count (SQLite), goes to a worker thread before the text is rendered.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING, Protocol

import trio
from prometheus_client import CollectorRegistry, Histogram, ProcessCollector
from prometheus_client.exposition import choose_encoder
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from mountd.chunk_cycle import ChunkState
from quiverfs.errors import ExitCode, QuietError

if TYPE_CHECKING:
    from mountd.item_reader import ItemReader
    from mountd.jobs import JobManager
    from mountd.mount_table import MountTable

log = logging.getLogger(__name__)

# Seconds: from a tenth of a millisecond (a hot local hit) to a slow bucket.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# The ItemReader counters behind the per-tier families. An exact read ends as one of
# local_hits, peer_hits or misses, and every miss as a bucket fetch or a bucket error.
HITS = {"local": "local_hits", "peer": "peer_hits", "bucket": "bucket_fetches"}
BYTES = {"local": "local_bytes", "peer": "peer_bytes", "bucket": "bucket_bytes"}
ERRORS = {"local": "store_errors", "peer": "peer_errors", "bucket": "bucket_errors"}
REQUEST_TIMEOUT = 10.0  # seconds a client may take to send its request
MAX_REQUEST = 8192  # bytes of request line and headers
LISTEN_BACKLOG = 16


def read_latency() -> Histogram:
    """The read latency histogram an ItemReader observes (registered nowhere: the
    collector below exports it)."""
    return Histogram("quiver_read_seconds", "Seconds to serve a read, by the tier that "
                     "served it", ["tier"], buckets=LATENCY_BUCKETS, registry=None)


@dataclasses.dataclass
class CacheStats:
    """The store's numbers, read in a worker thread before each scrape."""

    used_bytes: int = 0
    limit_bytes: int = 0
    items: int = 0


class MountdCollector:
    """Metric families read from a running mountd's live state, on the trio loop."""

    def __init__(self, reader: ItemReader, table: MountTable, jobs: JobManager) -> None:
        self.reader = reader
        self.table = table
        self.jobs = jobs
        self.cache = CacheStats()
        self._limiter = trio.CapacityLimiter(1)  # scrapes never queue behind fetches

    async def refresh(self) -> None:
        store = self.reader.store
        self.cache = await trio.to_thread.run_sync(
            lambda: CacheStats(store.volume(), store.size_limit, len(store)),
            limiter=self._limiter)

    def collect(self) -> Iterator[Metric]:
        yield from self._reads()
        yield from self.reader.latency.collect()
        yield from self._cache()
        yield from self._datasets()
        yield from self._chunks()
        yield from self._jobs()

    def _reads(self) -> Iterator[Metric]:
        c = self.reader.counters
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
        misses.add_metric(["peer"], c["peer_misses"] + c["peer_errors"])
        for tier, key in ERRORS.items():
            errors.add_metric([tier], c[key])
        yield from (hits, misses, nbytes, errors)
        yield CounterMetricFamily("quiver_integrity_failures", "Fetched items whose content "
                                  "did not match the digest (not cached, not served)",
                                  value=c["integrity_failures"])
        yield CounterMetricFamily("quiver_coalesced_reads", "Reads that waited for a fetch "
                                  "already in flight", value=c["coalesced"])

    def _cache(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("quiver_cache_used_bytes", "Bytes the local store uses on "
                                "disk", value=self.cache.used_bytes)
        yield GaugeMetricFamily("quiver_cache_limit_bytes", "The store's bound "
                                "(--cache-size)", value=self.cache.limit_bytes)
        yield GaugeMetricFamily("quiver_cache_items", "Items in the local store",
                                value=self.cache.items)
        yield CounterMetricFamily("quiver_cache_corrupt_dropped", "Store entries that failed "
                                  "their checksum or hash and were dropped",
                                  value=self.reader.store.corrupt_dropped)
        health = self.reader.store.health()
        yield GaugeMetricFamily("quiver_store_writable", "1 if the store's last write "
                                "worked, 0 while it cannot write (reads served uncached)",
                                value=int(health.writable))
        yield CounterMetricFamily("quiver_store_write_failures", "Items the store could not "
                                  "write (a full or failing disk): served uncached",
                                  value=health.write_failures)

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
        for ds in datasets:
            items.add_metric([ds.name], len(ds.digest))
            size.add_metric([ds.name], ds.digest.total_bytes)
            for tier, key in HITS.items():
                hits.add_metric([ds.name, tier], ds.counters[key])
                nbytes.add_metric([ds.name, tier], ds.counters[BYTES[tier]])
            misses.add_metric([ds.name, "local"], _local_misses(ds.counters))
            misses.add_metric([ds.name, "peer"],
                              ds.counters["peer_misses"] + ds.counters["peer_errors"])
        yield from (items, size, hits, misses, nbytes)

    def _chunks(self) -> Iterator[Metric]:
        chunks = GaugeMetricFamily("quiver_chunks", "Chunks of a dataset with jobs, by state "
                                   "(as the coordinator last said)", labels=["dataset", "state"])
        for name, group in self.jobs.groups.items():
            if group.snap is None:
                continue
            counts = collections.Counter(group.snap["states"])
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
            hits.add_metric(key, s["counters"].get("hits", 0))
            fetched.add_metric(key, s["counters"].get("fetched", 0))
            epoch.add_metric(key, s["epoch"])
            if s["mean_batch_s"] is not None:
                batch.add_metric(key, s["mean_batch_s"])
            for reads, measured in (("hit", s["t_hit"]), ("miss", s["t_miss"])):
                if measured is not None:
                    probed.add_metric([*key, reads], measured)
            if s["benefit"] is not None:
                benefit.add_metric(key, s["benefit"])
        yield from (hits, fetched, epoch, batch, probed, benefit)


def _local_misses(counters: collections.Counter[str]) -> int:
    """Reads the local store could not serve: those a peer served, and the misses."""
    return counters["peer_hits"] + counters["misses"]


class Collector(Protocol):
    """A prometheus collector whose numbers may need a blocking read before a scrape."""

    async def refresh(self) -> None: ...

    def collect(self) -> Iterator[Metric]: ...


class MetricsEndpoint:
    """A minimal HTTP/1.1 responder: ``GET /metrics`` gets the exposition text."""

    def __init__(self, address: tuple[str, int], collector: Collector) -> None:
        self.collector = collector
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(collector)
        ProcessCollector(registry=self.registry)
        self._sock = _bind(*address)  # now, so that a taken port fails before mounting

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return host, port

    async def serve(self, *, task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED) -> None:
        host, port = self.address
        async with trio.SocketListener(trio.socket.from_stdlib_socket(self._sock)) as listener:
            log.info("metrics on http://%s:%d/metrics", host, port)
            task_status.started((host, port))
            await trio.serve_listeners(self._answer, [listener])

    async def _answer(self, stream: trio.SocketStream) -> None:
        async with stream:
            with trio.move_on_after(REQUEST_TIMEOUT):
                try:
                    head = await _read_head(stream)
                    if head is not None:
                        await stream.send_all(await self._response(head))
                except trio.BrokenResourceError:
                    log.debug("metrics client went away")

    async def _response(self, head: bytes) -> bytes:
        lines = head.decode("latin-1").splitlines()
        parts = lines[0].split() if lines else []
        if len(parts) != 3:
            return _http("400 Bad Request", b"bad request\n")
        method, target = parts[0], parts[1].split("?", 1)[0]
        if method != "GET":
            return _http("405 Method Not Allowed", b"only GET\n")
        if target not in ("/", "/metrics"):
            return _http("404 Not Found", b"try /metrics\n")
        # The text format Prometheus asks for (OpenMetrics or the classic one).
        accept = next((line.split(":", 1)[1].strip() for line in lines[1:]
                       if line.lower().startswith("accept:")), "")
        encode, content_type = choose_encoder(accept)
        await self.collector.refresh()
        try:
            body = encode(self.registry)
        except Exception:  # a bug in the metrics must not take the mount down with it
            log.exception("rendering metrics failed")
            return _http("500 Internal Server Error", b"rendering metrics failed\n")
        return _http("200 OK", body, content_type)


def _bind(host: str, port: int) -> socket.socket:
    where = f"{host}:{port}"
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except OSError as exc:
        raise QuietError(f"cannot serve metrics on {where}: {exc.strerror}",
                         ExitCode.USAGE) from None
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as exc:
        sock.close()
        raise QuietError(f"cannot serve metrics on {where}: {exc.strerror}: pick another "
                         "--metrics address", ExitCode.USAGE) from None
    return sock


async def _read_head(stream: trio.SocketStream) -> bytes | None:
    """The request line and headers, or None if the client closed or sent too much."""
    data = b""
    while b"\r\n\r\n" not in data and b"\n\n" not in data:
        if len(data) > MAX_REQUEST:
            return None
        chunk = await stream.receive_some(4096)
        if not chunk:
            return None
        data += chunk
    return data


def _http(status: str, body: bytes, content_type: str = "text/plain; charset=utf-8") -> bytes:
    head = (f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
    return head.encode("latin-1") + body

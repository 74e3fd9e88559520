"""The names of mountd's counters, one enum per family, as ``quiver status --json`` shows
them (docs/operations.md, "Counters"): the read counters of the node and of each dataset,
a sampler job's and a view job's, and the causes of bucket fetches.

mountd counts under these members and the readers of its status (``quiver status``, the
benchmarks) look them up by them: a misspelt name is an AttributeError where it is
first used, not a new counter. Each member's value is the name in the status.
"""
from __future__ import annotations

import enum


class FetchCause(enum.StrEnum):
    """Why an item was read from its storage location: each bucket fetch is counted
    under one (``BUCKET_FETCHES_BY_CAUSE`` and ``BUCKET_BYTES_BY_CAUSE``)."""

    CHUNK_LOAD = "chunk_load"  # this node's share of a loading chunk
    COOP_MISS = "coop_miss"  # a sampler job's miss within the resident chunks; a view's miss
    STAGED_MISS = "staged_miss"  # its miss outside them, staged for one read
    EXACT = "exact"  # an exact read that missed every cache tier
    PROBE = "probe"  # a probed job's forced miss
    REFILL = "refill"  # refilling the active chunk after a membership change
    PREFETCH = "prefetch"  # `quiver prefetch`
    VIEW_AHEAD = "view_ahead"  # the substitutable view's readahead


class ReadCounter(enum.StrEnum):
    """What the read path counts, for the node (``counters``) and for each dataset
    (``datasets[].counters``); the owner puts count for the node only."""

    LOCAL_HITS = "local_hits"  # reads served from the local store or pushed pages
    LOCAL_BYTES = "local_bytes"
    PAGE_CACHE_OPENS = "page_cache_opens"  # opens whose reads all the page cache served
    STAGED_HITS = "staged_hits"  # reads served by bytes staged for one read
    PEER_HITS = "peer_hits"  # reads, and items staged for one, the owning peer served
    PEER_BYTES = "peer_bytes"
    PEER_MISSES = "peer_misses"  # reads the owning peer did not hold
    PEER_ERRORS = "peer_errors"  # failed calls to the owning peer
    PEER_BATCH_GETS = "peer_batch_gets"  # batch look-ups of items at their owners
    PEER_PUTS = "peer_puts"  # items stored at their owners
    PEER_PUT_REQUESTS = "peer_put_requests"
    PEER_PUT_ERRORS = "peer_put_errors"  # items a failed put did not store
    MISSES = "misses"  # reads that no cache tier served
    PROBE_HITS = "probe_hits"  # planned probe misses that were cached after all
    PROBE_MISSES = "probe_misses"  # a probed job's forced misses
    COALESCED = "coalesced"  # reads that joined a fetch already in flight
    REFETCHES_SAVED = "refetches_saved"  # fetches the store had the item for since
    LOADER_PROCESS_MISSES = "loader_process_misses"  # misses fetched in a loader process
    LOADER_PROCESS_FETCHES = "loader_process_fetches"  # chunk-load items fetched there
    BUCKET_FETCHES = "bucket_fetches"  # items read from storage, for every cause
    BUCKET_BYTES = "bucket_bytes"
    BUCKET_ERRORS = "bucket_errors"  # failed storage reads
    STORE_ERRORS = "store_errors"  # reads the local store failed
    INTEGRITY_FAILURES = "integrity_failures"  # fetched content that failed its check
    SUSPENDED_READS = "suspended_reads"  # reads refused while the dataset is suspended
    PUSHED = "pushed"  # items pushed into the page cache ahead of their reads
    PUSHED_BYTES = "pushed_bytes"
    PUSHED_OPENS = "pushed_opens"  # pushed items opened
    PUSHED_PASSED = "pushed_passed"  # pushed items taken as read at a later manifest
    PUSHED_UNOPENED = "pushed_unopened"  # pushed items neither, within a minute
    PUSHED_DROPPED = "pushed_dropped"  # pushed items whose pages were gone by their read
    VIEW_HITS = "view_hits"  # opens of a view's files that chose a cached item
    VIEW_MISSES = "view_misses"  # opens that chose an uncached one
    # per FetchCause: the items read from storage for it, and their bytes
    BUCKET_FETCHES_CHUNK_LOAD = "bucket_fetches_chunk_load"
    BUCKET_FETCHES_COOP_MISS = "bucket_fetches_coop_miss"
    BUCKET_FETCHES_STAGED_MISS = "bucket_fetches_staged_miss"
    BUCKET_FETCHES_EXACT = "bucket_fetches_exact"
    BUCKET_FETCHES_PROBE = "bucket_fetches_probe"
    BUCKET_FETCHES_REFILL = "bucket_fetches_refill"
    BUCKET_FETCHES_PREFETCH = "bucket_fetches_prefetch"
    BUCKET_FETCHES_VIEW_AHEAD = "bucket_fetches_view_ahead"
    BUCKET_BYTES_CHUNK_LOAD = "bucket_bytes_chunk_load"
    BUCKET_BYTES_COOP_MISS = "bucket_bytes_coop_miss"
    BUCKET_BYTES_STAGED_MISS = "bucket_bytes_staged_miss"
    BUCKET_BYTES_EXACT = "bucket_bytes_exact"
    BUCKET_BYTES_PROBE = "bucket_bytes_probe"
    BUCKET_BYTES_REFILL = "bucket_bytes_refill"
    BUCKET_BYTES_PREFETCH = "bucket_bytes_prefetch"
    BUCKET_BYTES_VIEW_AHEAD = "bucket_bytes_view_ahead"


# Each cause's two counters; a cause without both members fails here, at import.
BUCKET_FETCHES_BY_CAUSE: dict[FetchCause, ReadCounter] = {
    cause: ReadCounter[f"BUCKET_FETCHES_{cause.name}"] for cause in FetchCause}
BUCKET_BYTES_BY_CAUSE: dict[FetchCause, ReadCounter] = {
    cause: ReadCounter[f"BUCKET_BYTES_{cause.name}"] for cause in FetchCause}


class SamplerJobCounter(enum.StrEnum):
    """What a sampler job's planning counts (``jobs[].counters``, and JOB/stats)."""

    HITS = "hits"  # batch items its manifests listed as cached
    FETCHED = "fetched"  # batch items fetched before their manifest
    FETCH_ERRORS = "fetch_errors"  # those fetches that failed (the item's read reports it)
    MANIFESTS = "manifests"  # manifests handed out
    SEGMENTS = "segments"  # segments (several batches' manifests at once) handed out
    CHUNK_WAIT_S = "chunk_wait_s"  # seconds its planning waited for a chunk
    REPORTED_BATCHES = "reported_batches"  # batch times it reported


class ViewJobCounter(enum.StrEnum):
    """What a view job's opens count (``view_jobs[].counters``)."""

    OPENS = "opens"
    HITS = "hits"  # opens that chose a cached item
    MISSES = "misses"  # opens that chose an uncached one
    PASSES = "passes"  # passes over a pool started

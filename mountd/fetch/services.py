"""The read path's shared services, built once per mountd and handed to each part.

``Mountd`` (and a test's lone reader) calls ``read_services``; every part above fetch
(the FUSE side, the control socket, views, jobs) takes this one frozen context and
keeps the services it uses, instead of reaching them through the item reader."""
from __future__ import annotations

import dataclasses

import trio

from mountd.cluster.membership import Cluster
from mountd.datasets.dataset import MountedDataset
from mountd.fetch.bulk_fetch import BulkFetch
from mountd.fetch.fair_share import FetchThreads, WaitingReads
from mountd.fetch.integrity_budget import IntegrityBudget
from mountd.fetch.item_reader import ItemReader
from mountd.fetch.loader_pool import LoaderPool
from mountd.fetch.owner_puts import OwnerPuts
from mountd.fetch.page_push import PagePush
from mountd.fetch.probed import ProbedReads
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from mountd.store.content_store import ContentStore
from mountd.store.recency import Recency


@dataclasses.dataclass(frozen=True)
class ReadServices:
    """One mountd's read path: the store and its workers, the cluster, what reads count,
    stage and push, and the readers of single items and of many."""

    store: ContentStore
    recency: Recency  # the store's: hits and spent marks
    limiter: trio.CapacityLimiter  # the workers of short blocking calls; no fetch holds one
    cluster: Cluster
    stats: ReadStats
    staging: Staging
    integrity: IntegrityBudget
    puts: OwnerPuts
    push: PagePush
    probed: ProbedReads
    reader: ItemReader
    bulk: BulkFetch


def read_services(store: ContentStore, limiter: trio.CapacityLimiter, cluster: Cluster,
                  push_budget: int = 0, serving: LoaderPool | None = None,
                  ahead: LoaderPool | None = None, waiting_per_uid: int | None = None
                  ) -> ReadServices:
    """The services of one mountd: misses readers wait on go to ``serving``'s loader
    processes, chunk loads to ``ahead``'s (None: fetched in fetch threads, as many as
    ``limiter`` has workers); each uid has at most ``waiting_per_uid`` reads waiting
    for a fetch (None: no bound)."""
    stats, staging, integrity, probed = ReadStats(), Staging(), IntegrityBudget(), ProbedReads()

    def left_to_its_read(ds: MountedDataset, digest: bytes) -> bool:
        """Whether a planned item is left to its read rather than pushed: a probed job's
        (its read must reach mountd), one a peer owns (this node's store does not hold
        it; a hit from the peer is staged in memory for its read), or a suspended
        dataset's."""
        return (probed.pending(digest) or cluster.other_owner(digest) is not None
                or integrity.suspended(ds))

    push = PagePush(store, limiter, stats, staging, push_budget, skip=left_to_its_read)
    puts = OwnerPuts(cluster, stats.counters)
    waiting = None if waiting_per_uid is None else WaitingReads(waiting_per_uid)
    reader = ItemReader(store, limiter, cluster, stats, staging, integrity, puts, probed,
                        serving, FetchThreads(int(limiter.total_tokens)), waiting)
    bulk = BulkFetch(reader, store, limiter, cluster, stats, staging, probed, ahead)
    return ReadServices(store, store.recency, limiter, cluster, stats, staging, integrity,
                        puts, push, probed, reader, bulk)

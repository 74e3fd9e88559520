"""Stopping a dataset's fetches when it is unmounted: in mountd's workers and in the
loader processes, so that a stalled bucket holds no thread, loader slot or connection
past the unmount."""
from __future__ import annotations

from collections.abc import Iterable

import trio

from mountd.datasets.dataset import MountedDataset
from mountd.fetch.loader_pool import LoaderPool, load_source


async def stop_fetches(ds: MountedDataset, mounted: Iterable[MountedDataset],
                       pools: Iterable[LoaderPool], limiter: trio.CapacityLimiter) -> None:
    """End the fetches of ``ds``, unmounted, and release its backend. Its reads under way
    in mountd's workers fail at once (their sockets are shut), and the loader processes
    drop its source, unless a dataset still ``mounted`` reads the same one."""
    ds.backend.abort()  # first: the workers it frees are those the close may wait for
    source = load_source(ds.backend)
    if source is not None and all(load_source(other.backend) != source for other in mounted):
        for pool in pools:
            await pool.drop(source)
    await trio.to_thread.run_sync(ds.backend.close, limiter=limiter)

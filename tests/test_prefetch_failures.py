"""A `quiver prefetch` item that fails on a bug below counts as a failed item, and a
failed look-up in the store ends that prefetch, reported as its remaining items failed;
neither ends the nursery the prefetches run in (left to propagate, it would end mountd
for every user)."""
from __future__ import annotations

import errno
import hashlib
import logging
import types

import pytest
import trio

from mountd.control.controller import PREFETCH_BATCH, Controller
from mountd.control.server import Peer
from mountd.datasets.dataset import PrefetchProgress
from mountd.datasets.memory_budget import MemoryBudget, MemoryLimits
from mountd.datasets.mount_table import MountTable
from mountd.datasets.registry import Registry
from mountd.fetch.item_reader import ReadFailed
from mountd.jobs.registry import JobRegistry
from mountd.store.content_store import ContentStore
from mountd.view.view_jobs import ViewJobs
from quiverfs import digest as digest_format
from quiverfs.counters import FetchCause
from tests.mountd_helpers import lone_services

ROOT = Peer(0, 0, 0, frozenset())
ITEM_BYTES = 10


@pytest.fixture
def controller(tmp_path) -> Controller:
    services = lone_services(ContentStore(str(tmp_path / "store"), 1 << 20),
                             str(tmp_path / "coordinator"))
    table = MountTable()
    jobs = JobRegistry(table, services.limiter)
    # one item fetched at a time: the order of the failures, and so their logs, is known
    return Controller(str(tmp_path / "mnt"), table, Registry(str(tmp_path / "state")),
                      services, jobs, ViewJobs(jobs, services), None, 1,
                      MemoryBudget(MemoryLimits(1 << 30, 1 << 30)), "open", {})


def _dataset(controller: Controller, items: int) -> types.SimpleNamespace:
    """A mounted dataset of ``items`` items, none of them in the store."""
    new = [digest_format.NewItem(f"c/{k}.jpg", hashlib.sha256(b"%d" % k).digest(),
                                 ITEM_BYTES) for k in range(items)]
    d = digest_format.decode(digest_format.encode("d", "file:///x", new))
    ds = types.SimpleNamespace(name="d", digest=d, prefetch=None,
                               reg=types.SimpleNamespace(uid=0))
    controller.table.by_name[ds.name] = ds
    return ds


async def _prefetched(controller: Controller, ds: types.SimpleNamespace) -> PrefetchProgress:
    """``quiver prefetch`` of ``ds`` in the controller's tasks, run in a nursery of their
    own as in mountd's; its progress once finished, with the tasks still running."""
    async with trio.open_nursery() as nursery:
        await nursery.start(controller.tasks.run)
        await controller.prefetch(ROOT, {"name": ds.name})
        with trio.fail_after(10):
            while not ds.prefetch.finished:  # nothing to wait on: status polls it too
                await trio.sleep(0.01)
        assert controller.tasks.running
        nursery.cancel_scope.cancel()
    return ds.prefetch


async def test_an_item_that_fails_on_a_bug_counts_as_failed(controller, monkeypatch, caplog):
    ds = _dataset(controller, 8)
    raising = {0, 1, 2, 5}

    async def fetch(ds: object, index: int, cause: FetchCause) -> bytes:
        await trio.lowlevel.checkpoint()
        if index in raising:
            raise RuntimeError(f"fetch bug {index}")
        if index == 3:
            raise ReadFailed("storage error")
        return b"x" * ITEM_BYTES

    monkeypatch.setattr(controller.reader, "fetch", fetch)
    caplog.set_level(logging.DEBUG, logger="mountd.control.controller")
    progress = await _prefetched(controller, ds)
    assert (progress.done_items, progress.failed) == (3, 5)
    assert progress.done_bytes == 3 * ITEM_BYTES
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    # two runs of failures (0-2 and 5): one log each, with the first one's traceback
    assert [str(r.exc_info[1]) for r in logged] == ["fetch bug 0", "fetch bug 5"]


async def test_a_failed_look_up_in_the_store_ends_that_prefetch(controller, caplog):
    items = PREFETCH_BATCH + 44
    ds = _dataset(controller, items)
    second = {ds.digest.hash(i) for i in range(PREFETCH_BATCH, items)}

    class Store:
        def __contains__(self, digest: bytes) -> bool:
            if digest in second:
                raise OSError(errno.EIO, "index unreadable")
            return True

    controller.store = Store()
    progress = await _prefetched(controller, ds)
    # the first batch was found stored; the second was never looked at
    assert (progress.done_items, progress.failed) == (PREFETCH_BATCH, 44)
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info[0] is OSError

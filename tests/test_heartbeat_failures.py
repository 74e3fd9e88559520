"""A step of the heartbeat that fails on a bug below (a dataset's report, acting on the
coordinator's answer for a dataset, a chunk load) or of the view readahead ends that
step, logged once, and never the heartbeat or the readahead: left to propagate, it
would end mountd for every user."""
from __future__ import annotations

import hashlib
import logging
import types

import pytest
import trio

from coordinator.embedded import EmbeddedCoordinator
from mountd.cluster.membership import Cluster
from mountd.datasets.mount_table import MountTable
from mountd.jobs.chunk_loader import ChunkLoader
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.jobs.registry import JobRegistry
from mountd.store.content_store import ContentStore
from mountd.view import readahead
from mountd.view.readahead import ViewReadahead
from quiverfs import digest as digest_format
from quiverfs.chunk_cycle import FORCE_EVICT_AFTER, ChunkState
from quiverfs.heartbeat import PROBE_BATCHES, CacheMode, CycleView, LoadedShare
from tests.mountd_helpers import lone_services

CHUNKS = 4


async def test_a_failing_beat_is_logged_once_and_the_next_ones_go_on(tmp_path, caplog):
    link = EmbeddedCoordinator(str(tmp_path), FORCE_EVICT_AFTER, PROBE_BATCHES,
                               trio.CapacityLimiter(1))
    cluster = Cluster("node", "local", 1500, link, None)
    calls = {"report": 0, "apply": 0}

    def report() -> dict:
        calls["report"] += 1
        if calls["report"] == 1:
            raise RuntimeError("report bug")
        return {}

    async def apply(cycles: dict, version: int) -> None:
        calls["apply"] += 1
        if calls["apply"] <= 2:
            raise RuntimeError("apply bug")

    caplog.set_level(logging.INFO, logger="mountd.cluster.membership")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(cluster.run, report, apply, lambda: None)
        with trio.fail_after(10):
            await cluster.synced.wait()  # set by the first beat that applied its answer
        nursery.cancel_scope.cancel()
    assert calls == {"report": 4, "apply": 3}
    failed = [r for r in caplog.records if "a heartbeat failed" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None  # three in a row: one log
    assert "report bug" in caplog.text and "heartbeats work again" in caplog.text


def _group(name: str) -> DatasetJobs:
    items = [digest_format.NewItem(f"c/{k}.jpg", hashlib.sha256(b"%s%d" % (name.encode(), k))
                                   .digest(), 10) for k in range(16)]
    d = digest_format.decode(digest_format.encode(name, "file:///x", items))
    ds = types.SimpleNamespace(digest=d, name=name, mean_item_bytes=10, cache_mode=None,
                               reg=types.SimpleNamespace(identity=f"ident-{name}"))
    return DatasetJobs(ds, 40, None)  # 16 items of 10 bytes: 4 chunks


def _view(loads: tuple[LoadedShare, ...] = ()) -> CycleView:
    return CycleView(CHUNKS, (ChunkState.ACTIVE,) * CHUNKS, tuple(range(CHUNKS)), {}, 0,
                     0, CHUNKS, CHUNKS, loads, ("node",), CacheMode.FULL, 100, {})


@pytest.fixture
def loader(tmp_path) -> tuple[ChunkLoader, DatasetJobs, DatasetJobs]:
    services = lone_services(ContentStore(str(tmp_path / "store"), 1 << 20),
                             str(tmp_path / "coordinator"))
    registry = JobRegistry(MountTable(), services.limiter)
    good, bad = _group("good"), _group("bad")
    for group in (good, bad):
        job = registry.create(f"job-{group.ds.name}", 0, 0)
        job.group = group
        group.add(job)
        registry.groups[group.ds.name] = group
    assert len(bad.plan.members) == CHUNKS
    return ChunkLoader(registry, services), good, bad


def test_a_datasets_failing_report_leaves_it_out_and_the_others_in(loader, caplog):
    chunk_loader, good, bad = loader

    def boom() -> None:
        raise RuntimeError("report bug")

    bad.report = boom
    for _ in range(2):  # a heartbeat repeats it: one traceback for the run of failures
        assert list(chunk_loader.report()) == ["ident-good"]
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and "dataset bad: its report failed" in logged[0].getMessage()
    del bad.report  # mended: back in the next heartbeat
    assert sorted(chunk_loader.report()) == ["ident-bad", "ident-good"]


async def test_a_datasets_answer_that_fails_leaves_the_others_acted_on(loader, caplog):
    chunk_loader, good, bad = loader
    # a load of a chunk this node's plan does not have: IndexError below
    cycles = {"ident-bad": _view((LoadedShare(CHUNKS + 5, ("node",)),)),
              "ident-good": _view()}
    async with trio.open_nursery() as nursery:
        chunk_loader._nursery = nursery
        await chunk_loader.apply(cycles, 0)
        await chunk_loader.apply(cycles, 0)
    assert good.view == cycles["ident-good"] and good.ds.cache_mode is CacheMode.FULL
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and logged[0].exc_info[0] is IndexError
    assert "dataset bad: acting on the coordinator's answer failed" in logged[0].getMessage()


class FailingBulk:
    loads = 0

    async def load(self, *args: object) -> None:
        self.loads += 1
        raise RuntimeError("load bug")


async def test_a_chunk_load_that_fails_ends_itself_only(loader, caplog):
    chunk_loader, good, _ = loader
    chunk_loader.bulk = FailingBulk()
    share = LoadedShare(1, ("node",))
    good.busy.add("load 1")
    await chunk_loader._load_share(good, "load 1", 1, ("node",), share)
    assert good.busy == set() and good.loaded == []  # not done: a later answer retries
    assert "dataset good: load 1 failed; a later answer starts it again" in caplog.text


async def test_a_readahead_look_or_round_that_fails_ends_itself_only(loader, caplog,
                                                                     monkeypatch):
    chunk_loader, good, _ = loader
    good.view = _view()
    looks = []

    def next_items(group: DatasetJobs, needs: list, n: int) -> list[int]:
        looks.append(n)
        if len(looks) == 1:
            raise RuntimeError("look bug")
        return [0, 1]

    monkeypatch.setattr(readahead, "next_items", next_items)
    bulk = FailingBulk()
    ahead = ViewReadahead(bulk, chunk_loader.recency, lambda: [(good, [])])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ahead.run)
        with trio.fail_after(10):
            while bulk.loads < 3:  # a look failed, then rounds failed: it goes on
                ahead.wake()
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert logged == [f"dataset good: a readahead {what} failed; its jobs' reads fetch "
                      "what it would have" for what in ("look", "round")]


class CountingBulk:
    loads = 0

    async def load(self, *args: object) -> None:
        self.loads += 1


@pytest.mark.parametrize("step", ["hold", "wanted"])
async def test_a_readahead_whose_bookkeeping_fails_ends_that_look_or_round_only(
        loader, caplog, monkeypatch, step):
    chunk_loader, good, _ = loader
    good.view = _view()
    monkeypatch.setattr(readahead, "next_items", lambda group, needs, n: [0, 1])
    # the in-memory calls around a round: marking its items held (in the look) and
    # wanted (in the round)
    owner = good.cached if step == "hold" else chunk_loader.recency
    real, calls = getattr(owner, step), []

    def failing_once(items: object) -> object:
        calls.append(items)
        if len(calls) == 1:
            raise RuntimeError(f"{step} bug")
        return real(items)

    monkeypatch.setattr(owner, step, failing_once)
    bulk = CountingBulk()
    ahead = ViewReadahead(bulk, chunk_loader.recency, lambda: [(good, [])])
    async with trio.open_nursery() as nursery:
        nursery.start_soon(ahead.run)
        with trio.fail_after(10):
            while bulk.loads < 2:  # a look or round failed: the next ones go on
                ahead.wake()
                await trio.sleep(0.05)
        nursery.cancel_scope.cancel()
    assert len(calls) >= 2 and not ahead._in_flight
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    what = "look" if step == "hold" else "round"
    assert [r.getMessage() for r in logged] == [
        f"dataset good: a readahead {what} failed; its jobs' reads fetch what it would have"]
    assert logged[0].exc_info[0] is RuntimeError

"""A chunk load waits while the same user's other datasets allotted full are filled by
their jobs' misses (mountd.fetch.demand), until they have been quiet a while, for at
most LIMIT and in turn with the dataset's other loads; never for its own dataset's
fetches, for loads, for datasets with chunks, or for another user's fetches."""
from __future__ import annotations

import pytest
import trio
import trio.testing

from mountd.fetch.demand import LIMIT, QUIET, Demand
from quiverfs.counters import FetchCause
from quiverfs.heartbeat import CacheMode

UID = 1000


def _run(main) -> None:
    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))


async def _fetch(demand: Demand, identity: str, cause: FetchCause, seconds: float,
                 uid: int = UID, mode: CacheMode = CacheMode.FULL) -> None:
    with demand.fetching(uid, identity, mode, cause):
        await trio.sleep(seconds)


async def _started(nursery: trio.Nursery, demand: Demand, *fetches: tuple) -> None:
    """Start ``fetches`` (``_fetch``'s arguments after ``demand``), let them begin."""
    for args in fetches:
        nursery.start_soon(_fetch, demand, *args)
    await trio.testing.wait_all_tasks_blocked()


async def _waited(demand: Demand, identity: str, uid: int = UID) -> float:
    started = trio.current_time()
    await demand.wait_for_others(uid, identity)
    return trio.current_time() - started


def test_a_load_waits_until_a_full_datasets_fill_is_quiet() -> None:
    async def main() -> None:
        demand = Demand()
        async with trio.open_nursery() as nursery:
            await _started(nursery, demand, ("a", FetchCause.COOP_MISS, 1.0),
                           ("a", FetchCause.EXACT, 2.0), ("c", FetchCause.PROBE, 1.5))
            assert demand.others(UID, "b") and demand.others(UID, "a")
            # the last of them ends at 2 s
            assert await _waited(demand, "b") == pytest.approx(2.0 + QUIET)
        assert not demand.inflight
    _run(main)


def test_a_load_waits_through_the_gaps_between_batches_fetches() -> None:
    async def main() -> None:
        demand = Demand()

        async def batches() -> None:  # 3 batches of 1 s, 0.2 s apart
            for _ in range(3):
                await _fetch(demand, "a", FetchCause.COOP_MISS, 1.0)
                await trio.sleep(0.2)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(batches)
            await trio.testing.wait_all_tasks_blocked()
            # the last batch's fetch ends at 3.4 s
            assert await _waited(demand, "b") == pytest.approx(3.4 + QUIET)
    _run(main)


def test_its_own_fetches_loads_and_datasets_with_chunks_do_not_hold_a_load() -> None:
    async def main() -> None:
        demand = Demand()
        async with trio.open_nursery() as nursery:
            await _started(nursery, demand, ("a", FetchCause.COOP_MISS, 3.0),
                           ("b", FetchCause.CHUNK_LOAD, 3.0), ("c", FetchCause.REFILL, 3.0),
                           ("d", FetchCause.COOP_MISS, 3.0, UID, CacheMode.COOP),
                           ("e", FetchCause.EXACT, 3.0, UID, CacheMode.NONE))
            assert await _waited(demand, "a") == 0.0
            assert dict(demand.inflight) == {(UID, "a"): 1}
    _run(main)


def test_another_users_fetches_do_not_hold_a_load() -> None:
    async def main() -> None:
        demand = Demand()
        async with trio.open_nursery() as nursery:
            await _started(nursery, demand, ("a", FetchCause.EXACT, 60.0, UID + 1))
            assert await _waited(demand, "b") == 0.0
            # its own user's do, for LIMIT at most
            assert await _waited(demand, "b", UID + 1) == LIMIT
            nursery.cancel_scope.cancel()
        assert not demand.inflight  # a cancelled fetch is no longer counted
    _run(main)


def test_a_datasets_loads_wait_in_turn() -> None:
    async def main() -> None:
        demand = Demand()
        waited: list[float] = []

        async def load() -> None:
            waited.append(await _waited(demand, "b"))

        async with trio.open_nursery() as nursery:
            await _started(nursery, demand, ("a", FetchCause.COOP_MISS, 60.0))
            async with trio.open_nursery() as loads:
                for _ in range(3):
                    loads.start_soon(load)
            assert sorted(waited) == [LIMIT, 2 * LIMIT, 3 * LIMIT]
            assert await _waited(demand, "c") == LIMIT  # another dataset's own turn
            nursery.cancel_scope.cancel()
        assert not demand._turns  # none left once no load waits
    _run(main)

"""The K-deep chunk cycle: as many chunks resident as the allotment holds, loads in
flight, two-step eviction of the oldest; and the coordinator driving it."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from coordinator.allocation import HEADROOM, DatasetDemand, JobBenefit, allocate, resident_chunks
from coordinator.state import CoordinatorState
from quiverfs.chunk_cycle import MAX_LOADING, ChunkCycle, ChunkState, EpochRef
from quiverfs.heartbeat import CacheMode, DatasetReport, Heartbeat, JobReport, LoadedShare


def ref(cycle: ChunkCycle, left: int = 0) -> EpochRef:
    """A job-epoch that began now, with ``left`` items in every chunk."""
    return EpochRef(cycle.generation, np.full(cycle.n_chunks, left))


def step(cycle: ChunkCycle, refs: list[EpochRef], at_once: int = 1) -> None:
    """What the coordinator does each heartbeat, with every loading chunk loaded."""
    for chunk in cycle.loading:
        cycle.loaded(chunk)
    while (victim := cycle.evictable(refs, now=0.0)) is not None:
        cycle.evicted(victim)
    cycle.start_loading(refs)
    while cycle.mark(refs, at_once) is not None:
        pass


def test_a_deep_cycle_keeps_k_resident_and_loads_ahead_in_ring_order():
    cycle = ChunkCycle(10, capacity=5)
    assert cycle.start_loading([]) == [0, 1]  # MAX_LOADING at once
    assert cycle.start_loading([]) == []
    cycle.loaded(1)  # loads may finish out of order
    assert cycle.start_loading([]) == [2] and cycle.loading == [0, 2]
    cycle.loaded(0)
    cycle.loaded(2)
    assert cycle.start_loading([]) == [3, 4]
    # full (loads count): the oldest is marked, so that its release makes room early;
    # where a batch spans two chunks, two at once (as many as may load at once, at most)
    assert cycle.mark([]) == 0 and cycle.states[0] is ChunkState.MARKED
    assert cycle.mark([]) is None  # one at a time
    assert cycle.mark([], at_once=3) == 1 and cycle.mark([], at_once=3) is None
    assert cycle.marked == [0, 1] and cycle.marks[1] == cycle.marks[0] + 1
    for chunk in (3, 4):
        cycle.loaded(chunk)
    assert cycle.resident == [0, 1, 2, 3, 4] and cycle.start_loading([]) == []
    assert cycle.active == [2, 3, 4]
    job = ref(cycle)
    assert cycle.evictable([job], now=0.0) == 0  # began after the marks: holds nothing
    cycle.evicted(0)
    assert cycle.start_loading([]) == [5] and cycle.resident == [1, 2, 3, 4, 5]
    assert cycle.evictable([job], now=0.0) == 1

    seen = set()
    for _ in range(40):  # around the ring, twice, for a job that needs every chunk
        step(cycle, [ref(cycle, left=1)])
        assert len(cycle.resident) <= 5 and len(cycle.loading) <= MAX_LOADING
        assert cycle.resident == sorted(cycle.resident, key=lambda c: (c - cycle.resident[0]) % 10)
        seen.update(cycle.resident)
    assert seen == set(range(10)) and cycle.max_resident == 5


def test_a_marked_chunk_waits_for_the_epochs_that_began_before_the_mark():
    cycle = ChunkCycle(6, capacity=3, force_after=30.0)
    for _ in range(2):
        step(cycle, [], at_once=2)
    # one loaded chunk stays unmarked: chunk 1 is not marked beside chunk 0
    assert cycle.resident == [0, 1, 2] and cycle.marked == [0]
    early = EpochRef(cycle.marks[0] - 1, np.full(6, 4))  # began before the mark
    assert cycle.evictable([early], now=10.0) is None
    late = ref(cycle, 4)
    assert cycle.evictable([early, late], now=10.0) is None  # `late` released it at 10 s
    assert cycle.evictable([early, late], now=39.9) is None
    assert cycle.evictable([early, late], now=40.0) == 0  # forced after 30 s
    early.remaining_chunks[0] = 0
    assert cycle.evictable([early], now=11.0) == 0


def test_double_buffering_is_k_equal_two():
    cycle = ChunkCycle(3, capacity=2)
    step(cycle, [])
    assert cycle.resident == [0, 1] and cycle.marked == []
    step(cycle, [])  # both loaded: the older is marked, the other stays usable
    assert cycle.active == [1] and cycle.marked == [0]
    step(cycle, [])  # released: evicted, the next one loads, nothing more is marked
    assert cycle.resident == [1, 2] and cycle.loading == [2] and cycle.marked == []


def test_the_cycle_loads_what_jobs_still_need_and_stops_while_they_need_nothing_else():
    cycle = ChunkCycle(8, capacity=2)
    left = np.zeros(8, dtype=np.int64)
    left[[0, 1, 5]] = 3  # a job-epoch has items left in chunks 0, 1 and 5 only
    job = EpochRef(cycle.generation, left)
    cycle.start_loading([job])
    assert cycle.resident == [0, 1]
    for chunk in (0, 1):
        cycle.loaded(chunk)
    assert cycle.mark([job]) == 0  # chunk 5 is needed: the cycle goes on
    job.started_generation = cycle.marks[0] - 1  # it began before the mark
    job.remaining_chunks[0] = 0
    assert cycle.evictable([job], now=0.0) == 0
    cycle.evicted(0)
    assert cycle.start_loading([job]) == [5]  # chunks 2 to 4 are passed over
    cycle.loaded(5)
    job.remaining_chunks[5] = 0
    assert cycle.mark([job]) is None  # nothing needed outside the resident chunks
    assert cycle.resident == [1, 5] and cycle.marked == []
    job.remaining_chunks[:] = 1  # the next epoch began: the cycle goes on
    assert cycle.mark([job]) == 1 and cycle.start_loading([job]) == []
    cycle.evicted(1)
    assert cycle.start_loading([job]) == [6]  # the ring from where it stood
    assert cycle.start_loading([]) == []  # (full: ring order without jobs is as before)


def test_a_dataset_that_fits_is_never_marked():
    cycle = ChunkCycle(3, capacity=5)
    for _ in range(4):
        step(cycle, [])
    assert cycle.active == [0, 1, 2] and cycle.marked == []
    single = ChunkCycle(1, capacity=2)
    step(single, [])
    step(single, [])
    assert single.active == [0] and single.start_loading([]) == []


def test_a_smaller_allotment_drains_the_cycle_a_chunk_at_a_time():
    cycle = ChunkCycle(10, capacity=6)
    for _ in range(4):
        step(cycle, [])
    assert len(cycle.resident) == 6
    cycle.capacity = 3
    sizes = []
    for _ in range(8):
        step(cycle, [])
        sizes.append(len(cycle.resident))
    assert sizes[:3] == [5, 4, 3] and set(sizes[3:]) == {3}  # one eviction per step


def test_snapshots_round_trip_and_two_chunk_snapshots_still_load():
    cycle = ChunkCycle(8, capacity=4)
    for _ in range(3):
        step(cycle, [], at_once=2)
    again = ChunkCycle.restore(cycle.snapshot(), 120.0)
    assert again.snapshot() == cycle.snapshot()
    old = {"chunks": 4, "loading": 2, "active": 1, "marked": 0, "generation": 3,
           "marked_generation": 3, "first_release": None, "next": 3, "max_resident": 2,
           "states": ["marked", "active", "loading", "evicted"]}
    restored = ChunkCycle.restore(old, 120.0)
    assert restored.resident == [0, 1, 2] and restored.loading == [2] and restored.capacity == 2
    assert restored.marks == {0: 3}
    first, second = cycle.marked
    one_marked = {**cycle.snapshot(), "marked": first, "marked_generation": 5,
                  "first_release": 7.0}  # written by a cycle with one marked chunk
    one_marked["states"] = ["active" if c == second else s
                            for c, s in enumerate(one_marked["states"])]
    assert ChunkCycle.restore(one_marked, 120.0).marks == {first: 5}
    with pytest.raises(ValueError):
        ChunkCycle.restore({**cycle.snapshot(), "resident": [7]}, 120.0)
    with pytest.raises(ValueError):  # a marked chunk the states do not mark
        ChunkCycle.restore({**cycle.snapshot(), "marked": [cycle.active[0]],
                            "marked_generations": [1], "first_release": [None]}, 120.0)


def test_spare_budget_deepens_pipelines_by_gain_within_the_headroom():
    io = DatasetDemand("io", 1000, 10, (JobBenefit(1, 3.0, 1.0),), n_chunks=100)
    mild = DatasetDemand("mild", 1000, 10, (JobBenefit(1, 1.5, 1.0),), n_chunks=100)
    budget = 200
    modes = allocate([io, mild], budget)
    assert modes == {"io": CacheMode.COOP, "mild": CacheMode.COOP}
    depth = resident_chunks([io, mild], modes, budget)
    spare = budget * (1 - HEADROOM) - 2 * 2 * 10
    assert (depth["io"] - 2 + depth["mild"] - 2) * 10 == spare  # all of it, in chunks
    assert depth["io"] > depth["mild"] >= 2  # in proportion to G (3 against 1.5)
    small = DatasetDemand("small", 50, 10, (JobBenefit(1, 3.0, 1.0),), n_chunks=5)
    modes = {"small": CacheMode.COOP}
    assert resident_chunks([small], modes, 10_000) == {"small": 5}  # never past its chunks


def test_spare_chunks_go_to_the_datasets_worth_caching_first():
    io = DatasetDemand("io", 1000, 10, (JobBenefit(1, 3.0, 1.0),), n_chunks=100)
    shared = DatasetDemand("shared", 1000, 10, (JobBenefit(1, 1.0, 1.0),) * 2, n_chunks=100)
    budget = 200  # 160 after the headroom: two chunks each, then 120 spare
    modes = allocate([io, shared], budget)
    assert modes == {"io": CacheMode.COOP, "shared": CacheMode.COOP}
    assert resident_chunks([io, shared], modes, budget) == {"io": 14, "shared": 2}
    few = dataclasses.replace(io, n_chunks=5)  # what it cannot hold goes to the other
    assert resident_chunks([few, shared], modes, budget) == {"io": 5, "shared": 11}
    assert resident_chunks([shared], {"shared": CacheMode.COOP}, budget) == {"shared": 16}


def beat(node: str, jobs: int, loaded: tuple[LoadedShare, ...] = (),
         probes: dict[str, tuple[int, bool]] | None = None, batch_bytes: int = 0
         ) -> Heartbeat:
    """``jobs`` jobs j0, j1, ...; ``probes``: job -> (the probe it began, whether it is
    in it)."""
    probes = probes or {}
    reports = tuple(JobReport(id=f"j{k}", gen=0, gpus=1, remaining=(5,) * 20,
                              probe_seq=probes.get(f"j{k}", (0, False))[0],
                              probing=probes.get(f"j{k}", (0, False))[1],
                              batch_bytes=batch_bytes)
                    for k in range(jobs))
    report = DatasetReport(name="ds", chunks=20, size=20_000, chunk_bytes=1000,
                           loaded=loaded, jobs=reports)
    return Heartbeat(node, f"127.0.0.1:{len(node)}", 8000, {"ident": report})


def test_the_coordinator_sizes_the_cycle_to_the_budget_and_loads_chunks_in_parallel(tmp_path):
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0, probe_batches=0)
    view = state.heartbeat(beat("a", 1), now=1.0).cycles["ident"]
    # budget 8000 less 20% of headroom, chunks of 1000: 6 resident
    assert view.mode is CacheMode.COOP and view.capacity == 6
    assert view.loading == (0, 1) and [s.loaders for s in view.loads] == [("a",), ("a",)]
    loaded = tuple(view.loads)
    for t in range(2, 12):
        view = state.heartbeat(beat("a", 1, loaded), now=float(t)).cycles["ident"]
        loaded = loaded + view.loads
    assert len(view.resident) == 6 and list(view.marked) == [view.resident[0]]
    assert state.status()["datasets"][0]["capacity"] == 6
    state.save()
    restarted = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0, probe_batches=0)
    assert restarted.datasets["ident"].cycle.resident == list(view.resident)


@pytest.mark.parametrize("batch_bytes, marked", [(0, 1), (1000, 1), (1500, 2), (9000, 2)])
def test_the_coordinator_marks_as_many_chunks_at_once_as_a_batch_spans(tmp_path, batch_bytes,
                                                                       marked):
    """Chunks of 1000 bytes: a batch of 1500 spans two, so two are marked at once (so
    that one round of releases frees a batch); never more than may load at once."""
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0, probe_batches=0)
    loaded: tuple[LoadedShare, ...] = ()
    for t in range(1, 12):
        view = state.heartbeat(beat("a", 1, loaded, batch_bytes=batch_bytes),
                               now=float(t)).cycles["ident"]
        loaded = loaded + view.loads
    assert len(view.resident) == 6 and list(view.marked) == list(view.resident[:marked])
    assert marked <= MAX_LOADING


def test_one_job_of_a_dataset_is_probed_at_a_time(tmp_path):
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0)

    def probes(now: float, **began: tuple[int, bool]) -> dict[str, int]:
        return state.heartbeat(beat("a", 3, probes=began), now=now).cycles["ident"].probes

    assert probes(1.0) == {"j0": 1}
    assert probes(2.0) == {"j0": 1}  # asked for, not begun yet: nobody else
    assert probes(3.0, j0=(1, True)) == {"j0": 1}  # in it
    assert probes(4.0, j0=(1, False)) == {"j0": 1, "j1": 1}  # over: the next one
    assert probes(5.0, j0=(1, False), j1=(1, False)) == {"j0": 1, "j1": 1, "j2": 1}
    assert probes(6.0, j0=(1, False), j1=(1, False), j2=(1, False)) == {
        "j0": 1, "j1": 1, "j2": 1}  # each probed once until REPROBE_AFTER


def test_the_coordinator_loads_only_chunks_jobs_still_need(tmp_path):
    """Once all the jobs need is resident, nothing is marked and the cycle waits,
    instead of loading chunks that would be evicted unread."""
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0, probe_batches=0)
    remaining = (5,) * 6 + (0,) * 14  # the job needs chunks 0 to 5 only

    def heartbeat(loaded: tuple[LoadedShare, ...], now: float):
        job = JobReport(id="j0", gen=0, gpus=1, remaining=remaining, probe_seq=0)
        report = DatasetReport(name="ds", chunks=20, size=20_000, chunk_bytes=1000,
                               loaded=loaded, jobs=(job,))
        beat = Heartbeat("a", "127.0.0.1:1", 8000, {"ident": report})
        return state.heartbeat(beat, now=now).cycles["ident"]

    cycle = heartbeat((), 1.0)
    loaded = tuple(cycle.loads)
    for t in range(2, 12):
        cycle = heartbeat(loaded, float(t))
        loaded = loaded + cycle.loads
    assert sorted(cycle.resident) == list(range(6)) and cycle.marked == {}

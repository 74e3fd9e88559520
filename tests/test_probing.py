"""Benefit probing's arithmetic against a model of a DataLoader's timing.

The model is torch's: at an epoch's start the loader asks for ``prefetch`` batches at
once, hands batch j to worker j % workers, and asks for the next batch each time its
training loop takes one. The end-to-end test (real mount, real DataLoader) is in
test_allocation.py.
"""
from __future__ import annotations

import hashlib
import types
from collections.abc import Callable

import pytest
import trio
import trio.testing

from coordinator.allocation import NO_BENEFIT, DatasetDemand, JobBenefit, allocate
from mountd.fetch.read_stats import METER_MIN_FETCHES, METER_WINDOW, PEAK_HALF_LIFE, BucketMeter
from mountd.jobs.chunk_loader import ChunkLoader
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.jobs.probing import PROBE_LIMIT, WINDOW_SECONDS, BenefitProbe
from mountd.jobs.registry import Job
from quiverfs import digest as digest_format
from quiverfs.chunk_cycle import ChunkState
from quiverfs.heartbeat import CacheMode, CycleView


def train(probe: BenefitProbe, *, epochs: int, n: int, compute: float, load_miss: float,
          load_hit: float, workers: int = 4, prefetch: int = 8, probe_batches: int = 32,
          probe_at: int = 0, startup: float = 2.0,
          misses_ahead: Callable[[int, bool], bool] = lambda seen, after_probe: True,
          cached: Callable[[], bool] = lambda: True) -> list[int]:
    """Run the model, reporting to ``probe`` as the helper does; a probe of
    ``probe_batches`` begins at global batch ``probe_at``. ``misses_ahead(i, p)`` says
    whether the cycle has misses for a probe batch at global batch i (p: batch i - 1 was
    one); ``cached()``, whether the dataset has a cache as each batch is planned. The
    global batches planned as probes."""
    now, probes, seen = 0.0, [], 0
    for epoch in range(epochs):
        now += startup  # the loader's new worker processes
        asked = [now] * min(prefetch, n)  # when the loader asked for each batch
        ready: list[float] = []  # when each batch's worker had it loaded
        free = [now] * workers  # when each worker is done with what it was handed
        done = now  # when the training loop finished its last step

        def take(k: int) -> float:
            nonlocal done
            got = max(ready[k], done)
            done = got + compute
            return got

        for j in range(n):
            if j >= prefetch:  # taking batch j - prefetch asks for batch j
                asked.append(take(j - prefetch))
            if seen == probe_at:
                probe.begin(1, probe_batches)
            has_cache = cached()
            probing = probe.plan(epoch, j, n, cached=has_cache,
                                 cooperative=misses_ahead(seen, seen - 1 in probes))
            if probing:
                probes.append(seen)
            seen += 1
            if j:
                probe.record(epoch, j, asked[j] - asked[j - 1])
            w = j % workers
            free[w] = max(asked[j], free[w]) + (load_miss if probing or not has_cache
                                                else load_hit)
            ready.append(free[w])
        for k in range(max(0, n - prefetch), n):
            take(k)
        now = done
    return probes


@pytest.fixture
def probe() -> BenefitProbe:
    return BenefitProbe()  # probes of 32 batches: settle 16 (twice the prefetch), windows of 16


def test_io_bound_job_benefits(probe):
    """Four workers hand its batches over in bursts (intervals of 0.85, 0.05, 0.05,
    0.05 s): the windows take their N/2 intervals, though 9 of them add up to
    WINDOW_SECONDS (a window cut there would end on a burst: t_miss 0.317 s)."""
    forced = len(train(probe, epochs=4, n=60, compute=0.05, load_miss=1.0, load_hit=0.1))
    t_miss, t_hit = probe.measured
    assert t_miss == pytest.approx(1.0 / 4, rel=0.05)  # four workers reading misses
    assert t_hit == pytest.approx(0.05, rel=0.05)  # its compute, the hits hidden
    assert forced <= 34 and not probe.active


def test_compute_bound_job_does_not(probe):
    train(probe, epochs=4, n=60, compute=1.0, load_miss=2.0, load_hit=0.1)
    t_miss, t_hit = probe.measured
    assert t_miss == pytest.approx(1.0, rel=0.02) and t_hit == pytest.approx(1.0, rel=0.02)
    assert t_miss / t_hit < NO_BENEFIT


@pytest.mark.parametrize(("probe_at", "run_at"),
                         [(20, 20), (50, 60), (100, 120), (170, 180)])
def test_a_probe_across_epoch_turns_measures_the_same(probe, probe_at, run_at):
    """Asked for late in an epoch (fewer than its 32 batches left), a probe runs from the
    next epoch's start; the burst at the epoch's start and the new workers' start are
    not measured."""
    probes = train(probe, epochs=6, n=60, compute=0.05, load_miss=1.0, load_hit=0.1,
                   probe_at=probe_at)
    assert probes == list(range(run_at, run_at + 32))
    t_miss, t_hit = probe.measured
    assert t_miss == pytest.approx(0.25, rel=0.05) and t_hit == pytest.approx(0.05, rel=0.05)


def test_a_steady_job_with_long_batches_is_measured_in_seconds_not_in_n_batches():
    """A job that computes 3 s a batch and hides its misses (one worker, 3 batches
    ahead), probed with N = 8: its windows end once their intervals add up to
    WINDOW_SECONDS and agree, so 2 miss intervals (the first, the pipeline's turn, does
    not agree) and 1 of hits measure it, 11 batches in, not 19 (then ~49 s)."""
    probe, seen, measured_at = BenefitProbe(), [0], []

    def cached() -> bool:
        if probe.measured is not None and not measured_at:
            measured_at.append(seen[0])
        seen[0] += 1
        return True

    probes = train(probe, epochs=2, n=40, compute=3.0, load_miss=0.5, load_hit=0.05,
                   workers=1, prefetch=3, probe_batches=8, cached=cached)
    assert probes == list(range(6)) and probe.miss == [3.0, 3.0] and probe.hit == [3.0]
    assert probe.measured == (3.0, 3.0) and measured_at == [11]
    assert 3.0 >= WINDOW_SECONDS


def test_probes_that_cannot_measure_end(probe):
    """Epochs no longer than the settling batches, a job that reports nothing, or one
    whose intervals can never be judged: the probe stops forcing misses instead of
    slowing the job for ever."""
    assert not train(probe, epochs=6, n=16, compute=0.05, load_miss=1.0, load_hit=0.1)
    assert probe.measured is None and not probe.active
    probe.begin(2, 32)  # a job that reads manifests but reports no times
    assert all(probe.plan(0, j, 10_000, cached=True) for j in range(33))
    assert not probe.plan(0, 33, 10_000, cached=True)  # ended after N + 1 batches
    probe.begin(3, 32)  # one that reports, but never an interval that can be judged
    for j in range(PROBE_LIMIT * 32):
        assert probe.plan(0, j, 10_000, cached=True)
        probe.record(0, 0, 0.5)  # an epoch's first interval is never judged
    assert not probe.plan(0, PROBE_LIMIT * 32, 10_000, cached=True)


def test_a_probe_short_of_misses_waits_before_its_run_not_within_it(probe):
    """The cycle has no misses for a probe before batch 20, nor right after a probe
    batch (it took them): the probe waits for them before its run, and once begun, the
    run goes on. (Waiting within it, it alternated and ended unmeasured.)"""
    probes = train(probe, epochs=4, n=60, compute=0.05, load_miss=1.0, load_hit=0.1,
                   misses_ahead=lambda seen, after_probe: seen >= 20 and not after_probe)
    assert probes[0] == 20 and probes == list(range(20, 20 + len(probes)))
    t_miss, t_hit = probe.measured
    assert t_miss == pytest.approx(0.25, rel=0.05) and t_hit == pytest.approx(0.05, rel=0.05)


def test_misses_ahead_matter_only_where_a_probe_may_wait(probe):
    """``may_wait`` is true exactly where ``plan`` heeds ``cooperative`` (the planner
    looks the chunks ahead over only then): between runs, until PROBE_LIMIT * N batches
    have waited; never within a run, nor without a probe."""
    assert not probe.may_wait(0, 0)
    probe.begin(1, 32)
    assert probe.may_wait(0, 0)
    assert not probe.plan(0, 0, 10_000, cached=True, cooperative=False)  # it waits
    assert probe.may_wait(0, 1) and probe.plan(0, 1, 10_000, cached=True)  # a run begins
    assert not probe.may_wait(0, 2)
    assert probe.plan(0, 2, 10_000, cached=True, cooperative=False)  # the run goes on
    probe.begin(2, 32)
    waited = 0
    while probe.may_wait(1, waited):
        assert not probe.plan(1, waited, 10_000, cached=True, cooperative=False)
        waited += 1
    assert waited == PROBE_LIMIT * 32
    assert probe.plan(1, waited, 10_000, cached=True, cooperative=False)


def test_batches_without_the_cache_measure_t_miss_again():
    """A probe measured no gain (the job's misses cost no more than its hits while the
    other jobs hit); then the dataset is allotted no cache and every job misses, and
    its batches take 2 s: t_miss becomes those batches' time, t_hit stays."""
    probe = BenefitProbe()
    probe.begin(1, 4)
    for j in range(40):
        probe.plan(0, j, 40, cached=True)
        probe.record(0, j, 0.5)
    assert probe.measured == (0.5, 0.5) and not probe.active
    for j in range(40):
        assert not probe.plan(1, j, 40, cached=False)
        probe.record(1, j, 2.0 if j >= 2 else 0.1)  # the epoch's first two never count
        if j == 2:
            assert probe.measured == (0.5, 0.5)  # after N/2 intervals, not one
    assert probe.measured == (2.0, 0.5)


def test_a_long_epoch_gives_t_hit_within_it(probe):
    """t_hit waits for the next epoch, or for N batches after the probe in a long one."""
    train(probe, epochs=1, n=200, compute=0.05, load_miss=1.0, load_hit=0.1)
    t_miss, t_hit = probe.measured
    assert t_miss == pytest.approx(0.25, rel=0.05) and t_hit == pytest.approx(0.05, rel=0.05)
    short = BenefitProbe()
    train(short, epochs=1, n=70, compute=0.05, load_miss=1.0, load_hit=0.1)
    assert short.measured is None and short.miss  # probe to 31, hits from 63: 16 need 79


def test_a_job_never_probed_has_no_times():
    assert BenefitProbe().times() == (None, None)


def test_a_probe_tells_no_times_until_its_misses_and_hits_are_measured(probe):
    train(probe, epochs=1, n=40, compute=0.05, load_miss=1.0, load_hit=0.1)
    assert probe.measured is None and not probe.active and probe.miss  # misses only
    assert probe.times() == (None, None)
    train(probe, epochs=2, n=40, compute=0.05, load_miss=1.0, load_hit=0.1)
    t_miss, t_hit = probe.times()
    assert t_miss == pytest.approx(0.25, rel=0.05) and t_hit == pytest.approx(0.05, rel=0.05)


def test_a_lone_jobs_probe_is_measured_though_its_misses_alone_measured_the_bucket(probe):
    """The coordinator allots the dataset a mode from what the probe tells, and the
    job's batches are planned with the cache only while it has one. A lone job whose
    misses alone gave the bucket meter its reading (no chunk load had run) reads as fast
    as loads would: told t_miss alone, the coordinator allotted it no cache, no batch
    had hits, and t_hit was never measured (the probe of
    tests/test_chunk_pipeline.py::test_a_lone_jobs_probe_misses_are_real_misses went
    unmeasured so, in 3 of 5 runs on a loaded machine, and 5 of 5 with the chunk loader
    waking the planner at every change of the cycle view)."""
    load_miss, batch_bytes = 0.4, 8 * 20_000
    misses_rate = batch_bytes / (load_miss / 4)  # 4 workers: a batch's misses each 0.1 s
    modes = []

    def cached() -> bool:
        t_miss, t_hit = probe.times()
        demand = DatasetDemand("d", 4_000_000, 160_000,
                               (JobBenefit(1, t_miss, t_hit, batch_bytes),), 25)
        modes.append(allocate([demand], 1_000_000, misses_rate)["d"])
        return modes[-1] is not CacheMode.NONE

    train(probe, epochs=3, n=40, compute=0.05, load_miss=load_miss, load_hit=0.06,
          cached=cached)
    assert probe.measured is not None, modes
    t_miss, t_hit = probe.measured
    assert t_miss == pytest.approx(0.1, rel=0.05) and t_hit == pytest.approx(0.05, rel=0.05)


def test_a_probe_without_forced_misses_models_t_miss_from_its_hits():
    """Where the cache holds the dataset a probe plans no batch without the cache: t_hit
    from the batches the job reads, t_miss from the model (here 2x t_hit); while the
    model has no bandwidth yet, the probe goes on measuring."""
    probe, bandwidth = BenefitProbe(), [None]
    probe.begin(1, 8, lambda t_hit: None if bandwidth[0] is None else 2 * t_hit)
    for j in range(40):
        assert not probe.plan(0, j, 40, cached=True)
        probe.record(0, j, 0.25)
        if j == 20:
            assert probe.measured is None and not probe.active
            bandwidth[0] = 1.0
    assert probe.measured == (0.5, 0.25) and probe.model is None


def test_a_probe_without_forced_misses_measures_t_miss_from_batches_that_missed():
    """A cold dataset allotted full: the job's batches that found nothing cached give
    t_miss; those that found some cached give nothing; only batches of hits give t_hit."""
    probe = BenefitProbe()
    probe.begin(1, 8, lambda t_hit: 100.0)
    for j in range(60):
        assert not probe.plan(0, j, 60, cached=True)
        hits = 0 if j < 20 else 8 if j < 40 else 16
        probe.planned_hits(0, j, hits, 16)
        probe.record(0, j, 2.0 if j < 20 else 1.0 if j < 40 else 0.5)
    assert probe.measured == (2.0, 0.5)


def test_the_bucket_meter_counts_only_time_with_a_fetch_in_flight():
    now = [0.0]
    meter = BucketMeter(lambda: now[0])
    for k in range(METER_MIN_FETCHES // 2):
        assert meter.rate() is None
        meter.begin()  # two at once: one second of fetching brings 2 MB
        meter.begin()
        now[0] += 1.0
        meter.end(1 << 20)
        meter.end(1 << 20)
        now[0] += 60.0  # idle: not counted
    assert meter.rate() == pytest.approx(2 << 20)
    peak_at = now[0] - 60.0
    for _ in range(int(METER_WINDOW)):  # a window of 1 MB/s now
        meter.begin()
        now[0] += 1.0
        meter.end(1 << 20)
    # the best window still counts, halved every PEAK_HALF_LIFE seconds
    decayed = (2 << 20) * 0.5 ** ((now[0] - peak_at) / PEAK_HALF_LIFE)
    assert meter.rate() == pytest.approx(decayed) and decayed > 1 << 20
    now[0] += 10 * PEAK_HALF_LIFE
    assert meter.rate() == pytest.approx(1 << 20)


def test_a_lone_jobs_chunk_loads_wake_when_its_probe_ends_without_polling():
    """ChunkLoader waits for a lone job's probe on its dataset's event: the probe's end
    (or a second job) wakes it at once, with a clock that never advances (a poll
    would never wake)."""
    items = [digest_format.NewItem(f"c/{k}.jpg", hashlib.sha256(b"%d" % k).digest(), 10)
             for k in range(16)]
    d = digest_format.decode(digest_format.encode("t", "file:///x", items))
    ds = types.SimpleNamespace(digest=d, name="t", mean_item_bytes=10)
    group = DatasetJobs(ds, 40, None)
    group.view = CycleView(4, (ChunkState.ACTIVE,) * 4, (0, 1, 2, 3), {}, 0, 0, 4, 4,
                           (), ("node",), CacheMode.COOP, 100, {})
    loader = object.__new__(ChunkLoader)
    loader.cluster = types.SimpleNamespace(me="node")
    woke: list[str] = []

    async def main() -> None:
        for end in ("probe", "another job"):
            job = Job(f"j-{end}", 0, 0)
            job.group = group
            group.add(job)
            job.probe.begin(1, 100)
            assert job.probe.active
            async with trio.open_nursery() as nursery:
                nursery.start_soon(lambda: _woken(loader, group, woke, end))
                await trio.testing.wait_all_tasks_blocked()
                assert woke == [] if end == "probe" else woke == ["probe"]
                if end == "probe":
                    job.probe.active = False  # as its measured misses end it
                else:
                    group.add(Job("second", 0, 0))
            group.jobs.clear()
        assert woke == ["probe", "another job"]

    trio.run(main, clock=trio.testing.MockClock())


async def _woken(loader: ChunkLoader, group: DatasetJobs, woke: list[str], end: str) -> None:
    await loader._after_lone_probe(group)
    woke.append(end)

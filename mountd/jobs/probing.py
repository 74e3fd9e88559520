"""Benefit probing of one job (paper §5.3): its mini-batch time without and with the cache.

The helper reports the time between the batches its DataLoader asks for. A DataLoader
asks for a few batches ahead of its workers (``prefetch_factor * num_workers``): at the
start of an epoch it asks for that many at once, and from then on once per batch its
training loop takes, so the interval reported for batch I measures the step of a batch
a few places before I. A probe of N batches therefore judges an interval only when the
N/2 batches up to it in the same epoch were all planned the same way (all probe misses,
or all with the cache): the epoch's first N/2 intervals (the burst, and a pipeline still
filling) and the turn from probe to cache are never measured. This assumes the loader
asks for at most N/2 batches ahead, which the default N = 100 leaves room for.

A probe plans batches without cache hits until a window of miss intervals is measured:
N/2 of them, or fewer that add up to WINDOW_SECONDS and agree (a steady job with 3-s
batches is measured in 1 or 2 of them, not 4, and its allocation settles sooner). Its
misses are items that are not cached, not being fetched, and not kept for their chunk's
load, from the chunk that loads next, then those loading now, where there are enough for
a whole run of N batches (so other jobs hit them afterwards; the chunk loader leaves
them to the probed job's read, so each is a real miss; a run that ran short would read
again what others fetched): while there are not, it waits, planning batches with the
cache, for up to PROBE_LIMIT * N batches, and only then reads what the cache holds or
cannot keep. It waits only before a run of probe batches begins: a batch with the cache
inside a run would leave the run unmeasured (each interval needs the N/2 batches before
it planned the same way), and when misses ran short after every probe batch, runs of one
batch each used up the probe with nothing measured; so once begun, a run reads what
misses it finds. Nor does a run begin after an epoch's first batch with fewer than N
batches left in it: the next epoch's first N/2 are never measured, so that run would
read its misses for little. A job that reads its dataset alone (the only job on it in
the cluster) takes its misses anywhere, and the dataset's chunk loads wait until its
misses are measured (``ChunkLoader``): without the cache, nothing would share the bucket
with its reads. It ends unmeasured after N + 1 batches if the job reported nothing (it
reads manifests without the helper's loop), after PROBE_LIMIT * N batches in any case,
and at once in epochs of N/2 batches or fewer. Then t_hit is the mean of a window of hit
intervals from the job's next epoch on, or in a long epoch from N batches, or 2 *
WINDOW_SECONDS, after the probe: right after it the cache is still warming (and, with
two chunks, the probe's random reads left the job's items spread over the chunk cycle).
The pair is kept until the next probe measures a new one, except that while the dataset
is allotted no cache, every window of intervals of batches planned without it (after N/2
such batches) replaces t_miss: a probe measures one job's misses while the dataset's
other jobs hit, and where they share a bucket that leaves to spare, its misses look
cheap (the job hides them behind its compute) although all of them missing at once are
not; without this a cache turned off on such a measure would stay off, and every job
would read the whole dataset from the bucket every epoch.

Where the cache holds the dataset (allotted ``full``, or every chunk may be resident), a
probe forces no misses: they would read from the bucket what the cache holds. It
measures the batches the job reads anyway: t_hit from a window of intervals of batches
that found all their items cached, and t_miss from a window of those that found none
(the job's epoch 0 on a cold dataset) or, without them, from a model: a batch's bytes at
the bandwidth this node's fetches get, overlapped with the job's step, max(t_hit, bytes
/ bandwidth). It is a lower bound on t_miss (jobs that miss together share the bucket),
so the benefit it gives is too.
"""
from __future__ import annotations

import logging
import statistics
from collections.abc import Callable

log = logging.getLogger(__name__)

PROBE_LIMIT = 4  # a probe that measured too little after this many times N batches ends
# A window of intervals ends at N/2 of them, or sooner once they add up to this many
# seconds and agree, with the interval before the last, within AGREE: each interval's
# noise (the bucket's latency, the scheduler) is about the same in seconds whatever the
# batch, so one 3-s batch of a steady job measures what four short ones do, and a job
# with long batches is measured in a time like any other's. A loader whose workers hand
# batches over in bursts (intervals of 0.85, 0.05, 0.05, 0.05 s) needs its N/2 intervals
# to average over them: a window cut by time would end on a burst and count it too often.
WINDOW_SECONDS = 2.5
AGREE = 1.1  # the longest of such intervals over the shortest, at most
# How a batch was planned; MISSED: with the cache, and it found nothing cached
HIT, PROBE, NO_CACHE, UNKNOWN, MISSED = 0, 1, 2, 3, 4


class BenefitProbe:
    """How one job's batches were planned, and its batch times measured from them."""

    def __init__(self, on_end: Callable[[], None] = lambda: None) -> None:
        self.seq = 0  # the last probe the coordinator asked for and this job began
        self.settle = self.window = 0
        self._active = False  # planning batches without cache hits
        self._on_end = on_end  # called when an active probe stops being so
        self.forced = 0  # batches this probe planned
        self.deferred = 0  # batches it waited for misses the cache needs anyway
        self.reported = False  # whether the job reported an interval during this probe
        self.miss: list[float] = []
        self.hit: list[float] = []
        self.ended_at: tuple[int, int] | None = None  # (epoch, batch) of the last miss interval
        self.since_end = 0.0  # seconds of intervals reported since, while t_hit is measured
        self._last: tuple[int, int, float] | None = None  # the last interval reported
        self._before = 0.0  # the interval before it in its epoch (0: none)
        self.measured: tuple[float, float] | None = None  # (t_miss, t_hit)
        self.uncached: list[float] = []  # intervals since, with the dataset allotted no cache
        # t_hit -> t_miss (None: not known yet), while a probe that forces no misses runs
        self.model: Callable[[float], float | None] | None = None
        self.missed: list[float] = []  # its intervals of batches that found nothing cached
        self.missed_whole = False  # whether those make a whole window
        self._plans: dict[int, bytearray] = {}  # epoch -> how each batch was planned

    @property
    def active(self) -> bool:
        """Whether batches are planned without cache hits (a probe forcing misses runs)."""
        return self._active

    @active.setter
    def active(self, active: bool) -> None:
        ended = self._active and not active
        self._active = active
        if ended:
            self._on_end()

    def begin(self, seq: int, batches: int,
              model: Callable[[float], float | None] | None = None) -> None:
        """Start probe number ``seq`` of ``batches`` batches (none when 0); with a
        ``model`` (t_hit -> t_miss), one that forces no misses."""
        self.seq = seq
        self.settle = self.window = max(1, batches // 2)
        self.active = batches > 0 and model is None
        self.model = model if batches > 0 else None
        self.forced, self.deferred, self.reported = 0, 0, False
        self.miss, self.hit, self.uncached, self.ended_at = [], [], [], None
        self.missed, self.missed_whole, self.since_end = [], False, 0.0

    def planned_hits(self, epoch: int, index: int, hits: int, items: int) -> None:
        """Batch ``index`` of ``epoch``, planned with the cache, found ``hits`` of its
        ``items`` cached. A probe that forces no misses measures t_hit only from
        batches of hits, and t_miss from those that found nothing cached."""
        plans = self._plans.get(epoch)
        if (self.model is not None and hits < items and plans is not None
                and len(plans) > index and plans[index] == HIT):
            plans[index] = MISSED if not hits else UNKNOWN

    def times(self) -> tuple[float | None, float | None]:
        """(t_miss, t_hit) as last measured by a whole probe, its misses and its hits;
        (None, None) before. A probe's misses alone are not told: on t_miss alone the
        coordinator may allot the dataset no cache (a lone job's misses measure the
        bucket's bandwidth themselves before any chunk load has, so loads look no
        faster), and then no batch is planned with the cache, t_hit is never measured,
        and the job stays off on half a measure. Whether that happened depended on
        when the bucket meter first read the loads, which timing (CPU load, extra
        wake-ups of the planner and loader) moves."""
        if self.measured is not None:
            return self.measured
        return None, None

    def _enough(self, intervals: list[float]) -> bool:
        """Whether ``intervals``, the last one just reported, make a whole window
        (WINDOW_SECONDS says when it ends early)."""
        if len(intervals) >= self.window:
            return True
        steady = [*intervals, self._before]
        return (sum(intervals) >= WINDOW_SECONDS and min(steady) > 0
                and max(steady) <= AGREE * min(steady))

    @property
    def run(self) -> int:
        """Batches of one run of probe batches: N/2 to settle, N/2 measured (at most)."""
        return self.settle + self.window

    def may_wait(self, epoch: int, index: int) -> bool:
        """Whether planning batch ``index`` of ``epoch`` may wait for misses (``plan``'s
        ``cooperative`` matters): the probe is active, between runs, and has waited
        less than PROBE_LIMIT * N batches."""
        return (self.active and not self._in_run(epoch, index)
                and self.deferred < PROBE_LIMIT * self.run)

    def _in_run(self, epoch: int, index: int) -> bool:
        """Whether batch ``index - 1`` of ``epoch`` was planned as a probe batch."""
        plans = self._plans.get(epoch)
        return index > 0 and plans is not None and len(plans) >= index and (
            plans[index - 1] == PROBE)

    def plan(self, epoch: int, index: int, n_batches: int, cached: bool,
             cooperative: bool = True) -> bool:
        """Record how batch ``index`` of ``epoch`` (of ``n_batches``) is planned: True for
        a probe batch (no cache hits), else with the cache if ``cached``. While a probe
        batch would have to read items the cache holds or cannot keep (not
        ``cooperative``), the probe waits, up to PROBE_LIMIT * N batches."""
        n = self.run
        if self.active and (n_batches <= self.settle or self.forced >= PROBE_LIMIT * n
                            or self.forced > n and not self.reported):
            self.active, self.miss = False, []
            log.info("probe %d ended unmeasured (%d batches, %s reported; epochs of %d)",
                     self.seq, self.forced, "some" if self.reported else "none", n_batches)
        plans = self._plans.setdefault(epoch, bytearray())
        for old in [e for e in self._plans if e < epoch - 1]:
            del self._plans[old]
        if len(plans) != index:  # an epoch planned anew (the job registered again)
            del plans[index:]
            plans.extend(bytes([UNKNOWN]) * (index - len(plans)))
        probe = self.active
        # It waits only between runs of probe batches, and begins none that the epoch's
        # end would cut short (the docstring says why).
        in_run = self._in_run(epoch, index)
        if probe and not in_run and index > 0 and n_batches - index < n:
            probe = False
        elif not cooperative and self.may_wait(epoch, index):
            self.deferred += 1
            probe = False
        plans.append(PROBE if probe else HIT if cached else NO_CACHE)
        self.forced += probe
        return probe

    def record(self, epoch: int, batch: int, seconds: float) -> None:
        """The interval the job reported for ``batch`` of ``epoch``."""
        self.reported = True
        last, self._last = self._last, (epoch, batch, seconds)
        self._before = last[2] if last is not None and last[:2] == (epoch, batch - 1) else 0.0
        plans = self._plans.get(epoch)
        if not self.settle or plans is None or not self.settle <= batch < len(plans):
            return
        if self.ended_at is not None and (epoch, batch) > self.ended_at:
            self.since_end += seconds
        kinds = set(plans[batch - self.settle:batch + 1])
        if self.model is not None:
            self._record_unforced(kinds, seconds)
        elif kinds == {PROBE} and self.active:
            self.miss.append(seconds)
            if self._enough(self.miss):
                self.active, self.ended_at = False, (epoch, batch)
                log.info("probe %d: misses measured over %d batches", self.seq,
                         len(self.miss))
        elif kinds == {HIT} and self._warm(epoch, batch):
            self.hit.append(seconds)
            if self._enough(self.hit):
                self.measured = (statistics.fmean(self.miss), statistics.fmean(self.hit))
                self.ended_at = None
                log.info("probe %d: t_miss %.4f s, t_hit %.4f s per batch", self.seq,
                         *self.measured)
        elif kinds == {NO_CACHE} and self.measured is not None and not self.active:
            self.uncached.append(seconds)
            if self._enough(self.uncached):
                self.measured = (statistics.fmean(self.uncached), self.measured[1])
                self.uncached = []
                log.info("t_miss %.4f s per batch with the dataset allotted no cache",
                         self.measured[0])

    def _warm(self, epoch: int, batch: int) -> bool:
        """Whether an interval of hits at ``batch`` of ``epoch`` measures t_hit: the
        probe's misses are measured, and the cache has warmed since (the job's next
        epoch, or N batches or 2 * WINDOW_SECONDS after its last miss interval)."""
        return self.ended_at is not None and (
            epoch > self.ended_at[0] or batch >= self.ended_at[1] + 2 * self.settle
            or self.since_end >= 2 * WINDOW_SECONDS)

    def _record_unforced(self, kinds: set[int], seconds: float) -> None:
        """An interval for a probe that forces no misses; it ends once t_hit and t_miss
        are known (with its window of hits measured, while the model cannot say t_miss,
        it measures hits afresh)."""
        if kinds == {HIT}:
            self.hit.append(seconds)
        elif kinds == {MISSED} and not self.missed_whole:
            self.missed.append(seconds)
            self.missed_whole = self._enough(self.missed)
        if kinds != {HIT} or not self._enough(self.hit):
            return
        assert self.model is not None
        t_hit = statistics.fmean(self.hit)
        missed = self.missed_whole
        t_miss = statistics.fmean(self.missed) if missed else self.model(t_hit)
        self.hit = []
        if t_miss is None:
            return
        self.measured, self.model = (t_miss, t_hit), None
        log.info("probe %d (no forced misses): t_miss %.4f s (%s), t_hit %.4f s per batch",
                 self.seq, t_miss, "measured" if missed else "modelled", t_hit)

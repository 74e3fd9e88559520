"""Benefit-aware cache allocation (paper §5.3).

Where the bucket's bandwidth is known (measured by the nodes' fetches), the allocation
is a search over every set of modes that fits the budget: none, two chunks (coop) or
full per dataset, each judged by the GPU shares its jobs save in a model of their batch
times (``coordinator.batch_model``). It is exhaustive for up to MAX_SEARCH datasets with
jobs (3^6 = 729 sets, few enough to search on every heartbeat whose inputs changed);
any further ones then get, one at a time, the mode that does best beside the others'. Heartbeats
come several times a second and their inputs seldom change, so searches are memoized,
with the bandwidth rounded to two significant digits. Of the sets that save as much (to
rounding), the one that reads the least from the bucket wins, then the one that caches
the fewest bytes: a lone job's two chunks read from the bucket what its misses would,
so unless its misses are slower than loads they only take room from the others.

Before any node has measured the bucket, the rule below decides, from the probes alone.
Each job's benefit from the cache is b = t_miss / t_hit (its mean mini-batch time
without and with cache hits, measured by probing); with n GPUs it saves g = b * n GPU
shares, and a dataset's jobs together G = sum(g). Given a cluster-wide budget S, each
dataset gets a CacheMode: COOP (chunks cycling through the cache, with cooperative miss
handling: as good as a full cache for substitutable jobs), FULL (the whole dataset: no
re-fetching every epoch), or NONE. Greedy by benefit per byte: every dataset worth
caching gets two chunks in order of G / cost while they fit, then leftover budget
upgrades datasets to full in order of G / extra bytes. What is still left caches
datasets whose jobs hide their I/O: in full where they fit, else in two chunks where
several jobs share them (their cooperative misses read each item once for all of them).
Finally the budget no mode uses deepens the cooperative datasets' chunk pipelines
(``resident_chunks``), in proportion to G, those worth caching first.

Either way, decisions start from a prior. A dataset with a job not measured yet, and
none known to hide its misses, is cached whole where it fits in its share, as LRU would
in effect hold it: its jobs read at hit speed from their second epoch instead of from
chunks while their probes run. Its share is the budget less what the allocation gives
the datasets worth caching that gain more (by G, then the smaller first); the datasets
after it are allotted what it leaves. Measurements move the decision from there: a job
that hides its misses takes its dataset out of the prior (a probe of a dataset held
whole measures its cold epoch's batches, ``mountd.jobs.probing``), and the space goes
where it gains. Where no dataset fits its share, the allocation is as without a prior.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Sequence

from coordinator.batch_model import NO_BENEFIT, BatchModel, ModelJob
from quiverfs.chunk_cycle import MIN_RESIDENT
from quiverfs.heartbeat import CacheMode

# Of the budget, kept free of extra chunks: the next chunk's early misses (a chunk is up
# to an eighth of a lone node's cache), and promised hits of an evicted chunk not read
# yet, live there. Less, and the store culls the resident chunks' items to make room.
HEADROOM = 0.2
MAX_SEARCH = 6  # datasets whose modes are searched together
TIE = 1e-6  # sets of modes within this fraction of the best gain are as good (rounding)


@dataclasses.dataclass(frozen=True)
class JobBenefit:
    """What probing measured for one job; None until measured."""

    gpus: int
    t_miss: float | None
    t_hit: float | None
    batch_bytes: int = 0  # bytes a batch reads; 0: not known (no bucket reads modelled)

    @property
    def benefit(self) -> float | None:
        if self.t_miss is None or self.t_hit is None or self.t_hit <= 0:
            return None
        return self.t_miss / self.t_hit


@dataclasses.dataclass(frozen=True)
class DatasetDemand:
    """A dataset's sizes and its jobs' benefits."""

    identity: str
    size: int  # bytes
    chunk_bytes: int
    jobs: tuple[JobBenefit, ...]
    n_chunks: int = 1

    @property
    def coop_cost(self) -> int:
        return min(self.size, MIN_RESIDENT * self.chunk_bytes)

    @property
    def gain(self) -> float:
        """G: GPU shares saved; an unmeasured job counts as benefiting (until probed)."""
        total = 0.0
        for job in self.jobs:
            b = job.benefit
            total += job.gpus * (NO_BENEFIT + 0.1 if b is None else b)
        return total

    @property
    def worth_caching(self) -> bool:
        return any(j.benefit is None or j.benefit >= NO_BENEFIT for j in self.jobs)

    @property
    def unproven(self) -> bool:
        """Whether a job of it is not measured yet and none is known to hide its misses:
        the prior caches it whole where it fits its share (the module docstring)."""
        benefits = [j.benefit for j in self.jobs]
        return None in benefits and all(b is None or b >= NO_BENEFIT for b in benefits)


def allocate(demands: list[DatasetDemand], budget: int, bandwidth: float | None = None
             ) -> dict[str, CacheMode]:
    """identity -> the dataset's CacheMode, within ``budget`` bytes: by the model where
    the bucket's ``bandwidth`` (bytes per second) is known, else by the probes alone,
    from the prior (the module docstring)."""
    rate = None if bandwidth is None or bandwidth <= 0 else float(f"{bandwidth:.2g}")
    modes = _decide(demands, budget, rate, {})
    ranked = sorted((d for d in demands if d.jobs and d.worth_caching),
                    key=lambda d: (-d.gain, d.size, d.identity))
    held: dict[str, CacheMode] = {}  # the modes of the datasets ranked so far
    for d in ranked:
        share = budget - sum(_cost(e, held[e.identity]) for e in ranked if e.identity in held)
        if d.unproven and modes[d.identity] is not CacheMode.FULL and d.size <= share:
            held[d.identity] = CacheMode.FULL
            modes = _decide(demands, budget, rate, held)
        else:
            held[d.identity] = modes[d.identity]
    return modes


def _decide(demands: list[DatasetDemand], budget: int, rate: float | None,
            held: dict[str, CacheMode]) -> dict[str, CacheMode]:
    """The modes within ``budget``, those of ``held`` as given there (they fit): by the
    model at the bucket's ``rate`` where known, else by the probes alone."""
    if rate is not None:
        return dict(_search(tuple(demands), budget, rate, tuple(held.items())))
    rest = [d for d in demands if d.identity not in held]
    spent = sum(_cost(d, held[d.identity]) for d in demands if d.identity in held)
    decided = {**_by_probes(rest, budget - spent), **held}
    return {d.identity: decided[d.identity] for d in demands}


def _cost(d: DatasetDemand, mode: CacheMode) -> int:
    return d.size if mode is CacheMode.FULL else d.coop_cost if mode is CacheMode.COOP else 0


def _options(d: DatasetDemand) -> tuple[CacheMode, ...]:
    """A dataset no bigger than two chunks is cached whole or not at all."""
    if d.size <= d.coop_cost:
        return CacheMode.NONE, CacheMode.FULL
    return CacheMode.NONE, CacheMode.COOP, CacheMode.FULL


@functools.lru_cache(maxsize=64)
def _search(demands: tuple[DatasetDemand, ...], budget: int, bandwidth: float,
            held: tuple[tuple[str, CacheMode], ...] = ()) -> dict[str, CacheMode]:
    """The best set of modes within ``budget`` in the model (the module docstring), with
    the datasets in ``held`` in the modes given there; memoized: callers copy it."""
    modes = {d.identity: CacheMode.NONE for d in demands}
    modes.update(held)
    model = BatchModel([ModelJob(d.identity, j.gpus, j.batch_bytes, j.t_miss, j.t_hit)
                        for d in demands for j in d.jobs], bandwidth)
    fixed = dict(held)
    with_jobs = [d for d in demands if d.jobs and d.identity not in fixed]

    def alone(d: DatasetDemand) -> float:  # the GPU shares it saves in full, per byte
        return model.gain({**modes, d.identity: CacheMode.FULL})[0] / max(1, d.size)

    ranked = sorted(with_jobs, key=alone, reverse=True)
    searched, rest = ranked[:MAX_SEARCH], ranked[MAX_SEARCH:]
    sets = [dict(zip((d.identity for d in searched), combo)) for combo in
            itertools.product(*(_options(d) for d in searched))]
    modes.update(_best(model, demands, modes, sets, budget))
    for d in rest:
        modes.update(_best(model, demands, modes, [{d.identity: m} for m in _options(d)],
                           budget))
    return modes


def _best(model: BatchModel, demands: Sequence[DatasetDemand], modes: dict[str, CacheMode],
          sets: Sequence[dict[str, CacheMode]], budget: int) -> dict[str, CacheMode]:
    """Of ``sets`` (modes of some datasets, the others' as in ``modes``), the best that
    fits ``budget``: within TIE of the most GPU shares saved, the least read from the
    bucket, then the fewest bytes cached."""
    judged = []
    for changed in sets:
        trial = {**modes, **changed}
        cost = sum(_cost(d, trial[d.identity]) for d in demands)
        if cost <= budget:
            saved, traffic = model.gain(trial)
            judged.append((saved, traffic, cost, changed))
    top = max(saved for saved, _, _, _ in judged)
    good = [j for j in judged if j[0] >= top * (1 - TIE)]
    return min(good, key=lambda j: (j[1], j[2]))[3]


def _by_probes(demands: list[DatasetDemand], budget: int) -> dict[str, CacheMode]:
    """identity -> the dataset's CacheMode, within ``budget`` bytes. Datasets worth
    caching come first. What they leave caches the others, since spare cache costs
    nothing and spares the bucket their reads: in full where they fit, else in two
    chunks where several jobs share the dataset. A lone job's chunks would only hold
    it back, but several jobs' probes each measured one job missing while the others
    hit: a bucket they all miss on is shared, and cooperative misses read each item
    once for all of them."""
    modes = {d.identity: CacheMode.NONE for d in demands}
    with_jobs = [d for d in demands if d.jobs]
    left = _fill([d for d in with_jobs if d.worth_caching], modes, budget)
    rest = [d for d in with_jobs if not d.worth_caching]
    for d in sorted(rest, key=lambda d: d.gain / max(1, d.size), reverse=True):
        if d.size <= left:
            modes[d.identity] = CacheMode.FULL
            left -= d.size
    shared = [d for d in rest if modes[d.identity] is CacheMode.NONE and len(d.jobs) > 1]
    _two_chunks(shared, modes, left)
    return modes


def _two_chunks(demands: list[DatasetDemand], modes: dict[str, CacheMode], left: int
                ) -> int:
    """Give ``demands`` two chunks each by G per byte while they fit; the budget left."""
    for d in sorted(demands, key=lambda d: d.gain / max(1, d.coop_cost), reverse=True):
        if d.coop_cost <= left:
            modes[d.identity] = CacheMode.COOP
            left -= d.coop_cost
    return left


def _fill(demands: list[DatasetDemand], modes: dict[str, CacheMode], left: int) -> int:
    """Give ``demands`` two chunks each by G per byte while they fit, then upgrade them to
    full by G per extra byte; the budget left."""
    left = _two_chunks(demands, modes, left)
    upgradable = [d for d in demands
                  if modes[d.identity] is CacheMode.COOP and d.size > d.coop_cost]
    for d in sorted(upgradable, key=lambda d: d.gain / (d.size - d.coop_cost), reverse=True):
        if d.size - d.coop_cost <= left:
            modes[d.identity] = CacheMode.FULL
            left -= d.size - d.coop_cost
    for d in demands:  # a dataset smaller than two chunks is simply cached whole
        if modes[d.identity] is CacheMode.COOP and d.size <= d.coop_cost:
            modes[d.identity] = CacheMode.FULL
    return left


def resident_chunks(demands: list[DatasetDemand], modes: dict[str, CacheMode], budget: int
                    ) -> dict[str, int]:
    """identity -> how many chunks each COOP dataset may keep resident (K >= 2): the
    budget no mode uses (less HEADROOM of the budget), shared in proportion to G among
    the datasets worth caching (among all, if none is), in whole chunks; what the shares
    leave goes a chunk at a time by G per byte, to any."""
    coop = [d for d in demands if modes[d.identity] is CacheMode.COOP]
    used = sum(_cost(d, modes[d.identity]) for d in demands)
    left = max(0, int(budget * (1 - HEADROOM)) - used)
    chunks = {d.identity: MIN_RESIDENT for d in coop}
    sharing = [d for d in coop if d.worth_caching] or coop
    total_gain, pool = sum(d.gain for d in sharing), left

    def room(d: DatasetDemand) -> int:
        return max(0, d.n_chunks - chunks[d.identity])

    for d in sharing:
        share = pool * d.gain / total_gain if total_gain else pool / len(sharing)
        extra = min(room(d), int(share // max(1, d.chunk_bytes)))
        chunks[d.identity] += extra
        left -= extra * d.chunk_bytes
    for d in sorted(coop, key=lambda d: d.gain / max(1, d.chunk_bytes), reverse=True):
        extra = min(room(d), left // max(1, d.chunk_bytes))
        chunks[d.identity] += extra
        left -= extra * d.chunk_bytes
    return chunks

"""Benefit-aware cache allocation (paper §5.3).

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
"""
from __future__ import annotations

import dataclasses

from quiverfs.chunk_cycle import MIN_RESIDENT
from quiverfs.heartbeat import CacheMode

NO_BENEFIT = 1.1  # a job whose t_miss / t_hit is below this hides its I/O
# Of the budget, kept free of extra chunks: the next chunk's early misses (a chunk is up
# to an eighth of a lone node's cache), and promised hits of an evicted chunk not read
# yet, live there. Less, and the store culls the resident chunks' items to make room.
HEADROOM = 0.2


@dataclasses.dataclass(frozen=True)
class JobBenefit:
    """What probing measured for one job; None until measured."""

    gpus: int
    t_miss: float | None
    t_hit: float | None

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


def allocate(demands: list[DatasetDemand], budget: int) -> dict[str, CacheMode]:
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
    used = sum(d.size if modes[d.identity] is CacheMode.FULL else d.coop_cost
               for d in demands if modes[d.identity] is not CacheMode.NONE)
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

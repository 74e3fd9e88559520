"""A model of each job's time per mini-batch under an allocation of cache modes (#35).

A job computes for ``compute`` seconds a batch and reads ``batch_bytes`` bytes; its
batch takes max(compute, the time its reads take from the bucket). With its dataset
allotted none, the job's own misses read the whole batch; in two chunks (coop), chunk
loads read a ``1 / n``-th of it for the dataset's n jobs (each load is read once for all
of them, and they take hits from it in any order); in full, nothing. The jobs share the
bucket's bandwidth max-min fairly: one that needs less than an equal share gets what
it needs, and the others split what is left (water filling).

Loads read many items at once, at the bandwidth; a job's own misses may be slower
(the bucket's latency, a few fetches at a time), so with its dataset allotted none a
batch takes at least the job's t_miss where measured. Where not, it takes DOUBT times
its share of the bandwidth: the benefit of the doubt, which gives an unmeasured job
some gain from the cache.

A job measured both ways whose t_miss is under NO_BENEFIT times its t_hit hides its
misses: the difference is noise, and its misses are taken to cost its t_hit (a gain
that small would keep a lone job's chunks loading from the bucket for nothing).

A job's compute time is its t_hit where measured (batches with the cache: compute plus
what a hit costs); else its misses' time / DOUBT: again the doubt, so a job no probe
has measured on hits gains a little from a full cache, no more. (t_miss far above what
its share of the bandwidth explains does not tell a job that computes meanwhile from
one whose misses wait on the bucket's latency: only t_hit does.)
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

from quiverfs.heartbeat import CacheMode

DOUBT = 1.2  # what an unmeasured job gains from a full cache, as the model takes it
NO_BENEFIT = 1.1  # a job whose t_miss / t_hit is below this hides its I/O
MIN_COMPUTE = 1e-4  # seconds a batch: a measured 0 would make the job's need infinite


@dataclasses.dataclass(frozen=True)
class ModelJob:
    """One job as the model sees it."""

    dataset: str
    gpus: int
    batch_bytes: float
    t_miss: float | None
    t_hit: float | None


def fair_shares(needs: Sequence[float], bandwidth: float) -> list[float]:
    """Bytes per second each job gets of ``bandwidth``, max-min fairly, for ``needs``
    (bytes per second each would read at its compute's pace; inf for no limit)."""
    shares = [0.0] * len(needs)
    left, waiting = bandwidth, sorted(range(len(needs)), key=lambda j: needs[j])
    while waiting:
        equal = left / len(waiting)
        j = waiting[0]
        if needs[j] > equal:
            for k in waiting:
                shares[k] = equal
            break
        shares[j] = needs[j]
        left -= needs[j]
        waiting.pop(0)
    return shares


def _miss_time(job: ModelJob, share_time: float) -> float:
    """What a batch of the job's own misses takes at least (the module docstring)."""
    if job.t_miss is None:
        return DOUBT * share_time
    if job.t_hit is not None and job.t_miss < NO_BENEFIT * job.t_hit:
        return job.t_hit
    return job.t_miss


class BatchModel:
    """Batch times of ``jobs`` under allocations, for a bucket of ``bandwidth``."""

    def __init__(self, jobs: Sequence[ModelJob], bandwidth: float) -> None:
        self.jobs = list(jobs)
        self.bandwidth = bandwidth
        self._sharing = {j.dataset: sum(1 for k in self.jobs if k.dataset == j.dataset)
                         for j in self.jobs}
        # each job's time per batch by its share of the bandwidth alone, with nothing
        # cached and no job held back by its compute
        share = self._shares({j.dataset: CacheMode.NONE for j in self.jobs},
                             [0.0] * len(self.jobs))
        self.miss_time = [_miss_time(j, t) for j, t in zip(self.jobs, share)]
        self.compute = [max(j.t_hit if j.t_hit is not None else miss / DOUBT, MIN_COMPUTE)
                        for j, miss in zip(self.jobs, self.miss_time)]
        self.uncached = self.times({j.dataset: CacheMode.NONE for j in self.jobs})

    def read_bytes(self, job: ModelJob, mode: CacheMode) -> float:
        """Bytes a batch of ``job`` reads from the bucket with its dataset in ``mode``."""
        if mode is CacheMode.FULL:
            return 0.0
        if mode is CacheMode.COOP:
            return job.batch_bytes / self._sharing[job.dataset]
        return job.batch_bytes

    def _shares(self, modes: Mapping[str, CacheMode], compute: Sequence[float]
                ) -> list[float]:
        """Seconds each job's batch takes to read from the bucket at its fair share of
        the bandwidth, each job reading at its ``compute``'s pace at most."""
        reads = [self.read_bytes(j, modes[j.dataset]) for j in self.jobs]
        needs = [r / c if c > 0 else math.inf for r, c in zip(reads, compute)]
        shares = fair_shares(needs, self.bandwidth)
        return [r / s if r else 0.0 for r, s in zip(reads, shares)]

    def times(self, modes: Mapping[str, CacheMode]) -> list[float]:
        """Seconds per batch of each job with each dataset in ``modes[dataset]``."""
        times = []
        for j, c, t, miss in zip(self.jobs, self.compute, self._shares(modes, self.compute),
                                 self.miss_time):
            if modes[j.dataset] is CacheMode.NONE:
                t = max(t, miss)
            times.append(max(c, t))
        return times

    def gain(self, modes: Mapping[str, CacheMode]) -> tuple[float, float]:
        """(GPU shares the jobs save: each job's GPUs times how many times faster its
        batches are than with nothing cached; bytes per second read from the bucket)."""
        times = self.times(modes)
        saved = sum(j.gpus * u / t for j, u, t in zip(self.jobs, self.uncached, times))
        traffic = sum(self.read_bytes(j, modes[j.dataset]) / t
                      for j, t in zip(self.jobs, times))
        return saved, traffic

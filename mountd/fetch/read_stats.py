"""What the read path counts: FUSE requests by opcode; reads, bytes and errors per tier,
their latency, and the bucket's bandwidth as this node's fetches see it."""
from __future__ import annotations

import collections
import time
from collections import Counter
from collections.abc import Callable, Mapping

from prometheus_client import Histogram

from mountd.datasets.dataset import MountedDataset
from quiverfs.counters import (BUCKET_BYTES_BY_CAUSE, BUCKET_FETCHES_BY_CAUSE, FetchCause,
                               ReadCounter)

# Seconds: from a tenth of a millisecond (a hot local hit) to a slow bucket.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


METER_WINDOW = 30.0  # seconds of fetching that the bucket's bandwidth is judged over
METER_MIN_FETCHES = 8  # fetches in that window before it is judged at all
PEAK_HALF_LIFE = 600.0  # seconds in which the best window's rate counts for half as much


class ReadStats:
    """Counters for the whole node and per dataset, and the latency of reads by tier
    (registered nowhere: mountd's metrics collector exports it)."""

    def __init__(self) -> None:
        self.counters: Counter[ReadCounter] = Counter()
        self.fuse_requests: Counter[str] = Counter()  # by opcode (the handler's name)
        self.latency = Histogram("quiver_read_seconds", "Seconds to serve a read, by the "
                                 "tier that served it", ["tier"], buckets=LATENCY_BUCKETS,
                                 registry=None)
        self._latency: dict[str, Histogram] = {}  # by tier: its labelled child
        self.bucket = BucketMeter()
        self.data_path = "python"  # how cached dataset files are served (--data-path)
        self.native: dict[str, int] = {}  # the native data plane's counters
        # what counts reads elsewhere (the native data plane), brought in by ``gather``
        self.sources: list[Callable[[], None]] = []

    def gather(self) -> None:
        """Bring in the reads counted elsewhere: before the counters are read."""
        for source in self.sources:
            source()

    def count(self, ds: MountedDataset, key: ReadCounter, n: int = 1) -> None:
        """Add ``n`` to ``key`` for the node and for ``ds``; a bare string is refused
        (TypeError), as a misspelt one would quietly start a counter of its own."""
        if not isinstance(key, ReadCounter):
            raise TypeError(f"a read counter is a ReadCounter, not {key!r}")
        self.counters[key] += n
        ds.counters[key] += n

    def fetched(self, ds: MountedDataset, cause: FetchCause, nbytes: int) -> None:
        """One item read from storage, for ``cause``."""
        self.count(ds, ReadCounter.BUCKET_FETCHES)
        self.count(ds, ReadCounter.BUCKET_BYTES, nbytes)
        self.count(ds, BUCKET_FETCHES_BY_CAUSE[cause])
        self.count(ds, BUCKET_BYTES_BY_CAUSE[cause], nbytes)

    @staticmethod
    def by_cause(counters: Mapping[ReadCounter, int]) -> dict[str, dict[str, int]]:
        """Bucket fetches and their bytes by cause, from counters ``fetched`` added to."""
        return {cause.value: {"fetches": counters.get(BUCKET_FETCHES_BY_CAUSE[cause], 0),
                              "bytes": counters.get(BUCKET_BYTES_BY_CAUSE[cause], 0)}
                for cause in FetchCause}

    def observe(self, tier: str, seconds: float) -> None:
        child = self._latency.get(tier)
        if child is None:  # labels() takes a lock and builds a key: once per tier
            child = self._latency[tier] = self.latency.labels(tier)
        child.observe(seconds)


class BucketMeter:
    """The bucket's bandwidth as this node's fetches see it: the bytes fetched per second
    during which at least one fetch was in flight, over the last METER_WINDOW such
    seconds, or the most that any such window saw, halved every PEAK_HALF_LIFE seconds,
    where that is more: misses alone, a few at a time, ask less of the bucket than it
    gives chunk loads. It counts no time without fetches."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._flying = 0
        self._since = 0.0  # the last begin or end while a fetch was in flight
        # per fetch in the window: the seconds with a fetch in flight since the one
        # before ended, and its bytes; and their sums
        self._fetches: collections.deque[tuple[float, int]] = collections.deque()
        self._busy = 0.0
        self._bytes = 0
        self._peak, self._peak_at = 0.0, 0.0

    def begin(self) -> None:
        """A fetch from the bucket started."""
        if not self._flying:
            self._since = self._clock()
        self._flying += 1

    def end(self, nbytes: int) -> None:
        """A fetch that ``begin`` started ended with ``nbytes`` (0 where it failed)."""
        now = self._clock()
        busy, self._since = now - self._since, now
        self._flying -= 1
        self._fetches.append((busy, nbytes))
        self._busy += busy
        self._bytes += nbytes
        while self._busy - self._fetches[0][0] >= METER_WINDOW:
            old_busy, old_bytes = self._fetches.popleft()
            self._busy -= old_busy
            self._bytes -= old_bytes
        current = self._window()
        if current is not None and current >= self._decayed(now):
            self._peak, self._peak_at = current, now

    def _window(self) -> float | None:
        if len(self._fetches) < METER_MIN_FETCHES or self._busy <= 0:
            return None
        return self._bytes / self._busy

    def _decayed(self, now: float) -> float:
        return self._peak * 0.5 ** ((now - self._peak_at) / PEAK_HALF_LIFE)

    def rate(self) -> float | None:
        """Bytes per second, or None before METER_MIN_FETCHES fetches were measured."""
        current = self._window()
        return None if current is None else max(current, self._decayed(self._clock()))

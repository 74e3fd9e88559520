"""What the read path counts: reads, bytes and errors per tier, and their latency."""
from __future__ import annotations

from collections import Counter

from prometheus_client import Histogram

from mountd.dataset import MountedDataset

# Seconds: from a tenth of a millisecond (a hot local hit) to a slow bucket.
LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                   0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ReadStats:
    """Counters for the whole node and per dataset, and the latency of reads by tier
    (registered nowhere: mountd's metrics collector exports it)."""

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self.latency = Histogram("quiver_read_seconds", "Seconds to serve a read, by the "
                                 "tier that served it", ["tier"], buckets=LATENCY_BUCKETS,
                                 registry=None)

    def count(self, ds: MountedDataset, key: str, n: int = 1) -> None:
        self.counters[key] += n
        ds.counters[key] += n

    def observe(self, tier: str, seconds: float) -> None:
        self.latency.labels(tier).observe(seconds)

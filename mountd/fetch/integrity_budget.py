"""Hash-check failures counted per uid, and the reads and registrations they stop.

A digest whose items keep failing their hash checks is guessing at content (a
byte-at-a-time oracle), not describing it. Failures are counted per uid since mountd
started, across all of its registrations (unmounting one does not take back its
count). Once a uid has spent its budget, its new registrations are refused and its
datasets that have failed a check are suspended: every read of them is ``EIO`` and
nothing of them is fetched, until mountd restarts. Root is trusted and never stopped.
"""
from __future__ import annotations

import collections
import logging

from mountd.datasets.dataset import MountedDataset
from quiverfs.counters import ReadCounter

log = logging.getLogger(__name__)

MAX_INTEGRITY_FAILURES_PER_USER = 1000


class IntegrityBudget:
    """Failed hash checks per uid, against ``limit``."""

    def __init__(self, limit: int = MAX_INTEGRITY_FAILURES_PER_USER) -> None:
        self.limit = limit
        self.failures: collections.Counter[int] = collections.Counter()

    def failed(self, ds: MountedDataset) -> None:
        """Count one failed hash check of an item of ``ds`` against its owner."""
        uid = ds.reg.uid
        self.failures[uid] += 1
        if self.failures[uid] == self.limit and uid != 0:
            log.warning("uid %d's datasets have failed %d hash checks: its new "
                        "registrations are refused and its failing datasets suspended "
                        "until mountd restarts", uid, self.limit)

    def spent(self, uid: int) -> bool:
        """Whether ``uid`` has used up its budget (root never does)."""
        return uid != 0 and self.failures[uid] >= self.limit

    def suspended(self, ds: MountedDataset) -> bool:
        """Whether reads of ``ds`` are stopped: its owner's budget is spent and it has
        failed a hash check itself."""
        return ds.counters[ReadCounter.INTEGRITY_FAILURES] > 0 and self.spent(ds.reg.uid)

"""Staging's bounds: bytes held for one read, and misses' bytes kept for their chunk's
load, each dropped oldest first past its limit; and the reads manifests promised."""
from __future__ import annotations

import hashlib

from mountd.fetch import staging
from mountd.fetch.staging import Staging


def item(n: int, size: int = 1000) -> tuple[bytes, bytes]:
    data = bytes([n % 256]) * size
    return hashlib.sha256(data).digest(), data


def test_bytes_kept_for_a_load_are_given_up_once():
    s = Staging()
    digest, data = item(1)
    s.keep_for_load(digest, data)
    assert s.kept_for_load(digest) and digest not in s  # not staged for a read
    assert s.take_for_load(digest) == data
    assert not s.kept_for_load(digest) and s.take_for_load(digest) is None


def test_bytes_kept_for_loads_drop_the_oldest_past_their_bound(monkeypatch):
    monkeypatch.setattr(staging, "MAX_FOR_LOAD", 2500)
    s = Staging()
    items = [item(n) for n in range(4)]
    for digest, data in items:
        s.keep_for_load(digest, data)
    assert [s.kept_for_load(d) for d, _ in items] == [False, False, True, True]
    s.keep(*items[0])  # the read's staging is bounded on its own
    assert items[0][0] in s and s.kept_for_load(items[3][0])


def test_an_item_promised_to_several_jobs_is_kept_until_each_has_read_it(monkeypatch):
    s = Staging()
    digest, _ = item(1)
    s.planned([digest])
    s.planned([digest])  # two jobs' manifests: two reads due
    assert s.awaiting_read(digest)
    assert s.take(digest) is None and s.awaiting_read(digest)  # one read came
    assert s.take(digest) is None and not s.awaiting_read(digest)
    assert s.take(digest) is None and not s.awaiting_read(digest)  # a read not promised
    clock = [100.0]
    monkeypatch.setattr(staging.time, "monotonic", lambda: clock[0])
    s.planned([digest])  # a read that never comes (the page cache served it)
    clock[0] += staging.PLANNED_GRACE
    assert not s.awaiting_read(digest)  # kept no longer than the grace
    s.planned([digest])  # promised anew: the stale count is not carried over
    assert s.take(digest) is None and not s.awaiting_read(digest)

"""The local content store: hash-checked puts, CRC-checked reads, LRU by recorded hits."""
from __future__ import annotations

import hashlib
import os

import diskcache
import pytest

from mountd.content_store import ContentStore, IntegrityError


def item(n: int, size: int = 40_000) -> tuple[bytes, bytes]:
    data = hashlib.sha256(str(n).encode()).digest() * (size // 32)
    return hashlib.sha256(data).digest(), data


@pytest.fixture
def store(tmp_path):
    s = ContentStore(str(tmp_path / "store"), 10 << 20)
    yield s
    s.close()
    with diskcache.Cache(str(tmp_path / "store")) as cache:
        assert cache.check() == []  # diskcache's own consistency check


def test_put_checks_the_hash(store):
    digest, data = item(1)
    with pytest.raises(IntegrityError):
        store.put(digest, data + b"x")
    assert digest not in store and store.get(digest) is None
    store.put(digest, data)
    assert store.get(digest) == data
    assert store.get(digest) == data  # second read: straight from the file


def test_corruption_on_disk_is_caught_on_the_fast_path(store, tmp_path):
    digest, data = item(2)
    store.put(digest, data)
    assert store.get(digest) == data
    (path,) = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "store") for f in fs
               if f.endswith(".val")]
    with open(path, "r+b") as f:
        f.seek(10)
        f.write(b"\x00\x01\x02")
    assert store.get(digest) is None
    assert store.corrupt_dropped == 1 and digest not in store


def test_an_entry_evicted_behind_the_store_is_a_miss(store, tmp_path):
    digest, data = item(3)
    store.put(digest, data)
    assert store.get(digest) == data
    with diskcache.Cache(str(tmp_path / "store")) as other:  # another process evicts it
        assert other.delete(digest)
    assert store.get(digest) is None


def test_lru_keeps_recorded_hits(tmp_path):
    limit = 1_500_000  # room for about 30 items
    store = ContentStore(str(tmp_path / "lru"), limit)
    try:
        items = [item(i) for i in range(25)]
        for digest, data in items:
            store.put(digest, data)
        assert store.get(items[0][0]) == items[0][1]  # item 0 is now the most recent
        assert store.record_hits() == 1
        for n in range(100, 120):  # push the older items out
            store.put(*item(n))
            assert store.volume() <= limit
        assert items[0][0] in store
        assert items[1][0] not in store
    finally:
        store.close()

"""The local content store: hash-checked puts, CRC-checked reads, LRU by recorded hits,
and what it does when the disk or the index fails."""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import random
import sqlite3
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import diskcache
import google_crc32c
import pytest

from mountd.control.metrics import MountdCollector
from mountd.datasets.mount_table import MountTable
from mountd.jobs.registry import JobRegistry
from mountd.store import background_writes, content_store, disk_cache, index
from mountd.store import health as store_health
from mountd.store import value_files as known_files
from mountd.store.content_store import VERIFY_ON_LOOP_MAX, ContentStore
from mountd.store.errors import IntegrityError, StoreError
from mountd.store.index import DAMAGED_SUFFIX, KEEP_DAMAGED
from mountd.store.writer import StoreWriter
from quiverfs.bench.read import drop_page_cache
from tests.mountd_helpers import lone_services

INDEX_LOGGER = "mountd.store.index"


def item(n: int, size: int = 40_000) -> tuple[bytes, bytes]:
    data = hashlib.sha256(str(n).encode()).digest() * (size // 32)
    return hashlib.sha256(data).digest(), data


def value_files(directory: str) -> list[str]:
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(directory) for f in fs
                  if f.endswith(".val"))


def index_rows(directory: str) -> int:
    """How many items are rows of the index (their value kept in SQLite, not a file)."""
    with contextlib.closing(sqlite3.connect(os.path.join(directory, "cache.db"))) as con:
        (rows,), = con.execute("SELECT COUNT(*) FROM Cache WHERE filename IS NULL")
    return rows


def settings(directory: str) -> dict[str, object]:
    """The diskcache settings the index holds (its Settings table)."""
    with contextlib.closing(sqlite3.connect(os.path.join(directory, "cache.db"))) as con:
        return dict(con.execute("SELECT key, value FROM Settings"))


OLD_MIN_FILE_SIZE = 4 << 10  # bytes: before #54, smaller items were rows of the index


def old_store(directory: str, items: list[tuple[bytes, bytes]]) -> None:
    """A closed store as versions before #54 left it: the store's own settings but
    for DISK_MIN_FILE_SIZE, so items under OLD_MIN_FILE_SIZE are rows of the index (and
    its Settings table says so), larger ones value files."""
    with pytest.MonkeyPatch.context() as older:
        older.setattr(disk_cache, "DISK_MIN_FILE_SIZE", OLD_MIN_FILE_SIZE)
        cache = disk_cache.open_cache(directory, 64 << 20)
    with cache:
        for digest, data in items:
            cache.set(digest, data, tag=google_crc32c.value(data))
    assert index_rows(directory) == sum(len(data) < OLD_MIN_FILE_SIZE for _, data in items)


def assert_consistent(directory: str) -> None:
    """diskcache's own check finds nothing, and every value file belongs to a row."""
    with diskcache.Cache(directory) as cache:
        assert cache.check() == []
        with contextlib.closing(sqlite3.connect(os.path.join(directory, "cache.db"))) as con:
            (rows,), = con.execute("SELECT COUNT(*) FROM Cache WHERE filename IS NOT NULL")
    assert len(value_files(directory)) == rows


def damage_pages(path: str, first_fraction: float, last_fraction: float) -> None:
    """Overwrite whole pages between the two fractions of an SQLite file with noise."""
    size = os.path.getsize(path)
    page = 4096
    start = max(1, int(size * first_fraction) // page) * page  # never the header page
    end = max(start + page, int(size * last_fraction) // page * page)
    with open(path, "r+b") as f:
        f.seek(start)
        f.write(random.Random(start).randbytes(end - start))


@contextlib.contextmanager
def mounted_tmpfs(path: str, size: str) -> Iterator[str]:
    """A tmpfs of ``size`` at ``path`` (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    os.makedirs(path, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path], check=True)
    try:
        yield path
    finally:
        busy = subprocess.run(["umount", path], capture_output=True, text=True)
        if busy.returncode != 0:
            subprocess.run(["umount", "-l", path], check=True)
            pytest.fail(f"descriptors left open on the tmpfs: {busy.stderr.strip()}")


def fill(directory: str) -> str:
    """Write a file in ``directory`` until its file system is full; the file's path."""
    path = os.path.join(directory, "filler")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as exc:
        assert exc.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return path


@pytest.fixture
def store(tmp_path):
    s = ContentStore(str(tmp_path / "store"), 10 << 20)
    yield s
    s.close()
    assert_consistent(str(tmp_path / "store"))


@pytest.fixture
def no_back_off(monkeypatch):
    monkeypatch.setattr(store_health, "WRITE_RETRY_INTERVAL", 0.0)


def test_put_checks_the_hash(store):
    digest, data = item(1)
    with pytest.raises(IntegrityError):
        store.put(digest, data + b"x")
    assert digest not in store and store.get(digest) is None
    assert store.put(digest, data)
    assert store.get(digest) == data
    assert store.get(digest) == data  # second read: straight from the file


def test_corruption_on_disk_is_caught_on_the_fast_path(store, tmp_path):
    digest, data = item(2)
    store.put(digest, data)
    assert store.get(digest) == data
    (path,) = value_files(str(tmp_path / "store"))
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


LRU_LIMIT = 1_500_000  # room for about 30 items


@pytest.fixture
def lru_store(tmp_path):
    """A store with room for about 30 items, holding items 0-24 stored in order."""
    store = ContentStore(str(tmp_path / "lru"), LRU_LIMIT)
    items = [item(i) for i in range(25)]
    for digest, data in items:
        store.put(digest, data)
    yield store, items
    store.close()


def test_lru_keeps_recorded_hits(lru_store):
    store, items = lru_store
    assert store.get(items[0][0]) == items[0][1]  # item 0 is now the most recent
    assert store.recency.record() == 1
    for n in range(100, 120):  # push the older items out
        store.put(*item(n))
        assert store.volume() <= LRU_LIMIT
    assert items[0][0] in store
    assert items[1][0] not in store


def test_the_recency_write_finds_the_diskcache_internals_it_uses(store):
    """mountd.store.recency writes access times through diskcache's own connection
    (``Cache._con``), as diskcache has no public way: this fails if diskcache drops it
    or the columns it updates."""
    hit, spent = item(60), item(61)
    assert store.put(*hit) and store.put(*spent)
    cache = store.index.current.cache
    assert isinstance(cache._con, sqlite3.Connection)
    columns = {row[1] for row in cache._con.execute("PRAGMA table_info(Cache)")}
    assert {"key", "raw", "access_time"} <= columns
    before = time.time()
    assert store.get(hit[0]) == hit[1]
    store.recency.spent([spent[0]])
    assert store.recency.record() == 1
    times = dict(cache._con.execute("SELECT key, access_time FROM Cache"))
    assert times[hit[0]] >= before and times[spent[0]] == 0.0


def test_spent_entries_are_evicted_first_even_when_read_or_stored_after_the_mark(lru_store):
    store, items = lru_store
    spent, rewritten, wanted_again, revived = items[20], items[21], items[22], items[23]
    assert not store.recency.pending()
    store.recency.spent([spent[0], rewritten[0], wanted_again[0], revived[0]])
    assert store.recency.pending()  # mountd writes the marks soon (SPENT_RECORD_INTERVAL)
    store.recency.record()
    assert not store.recency.pending()
    assert store.get(spent[0]) == spent[1]  # its last reader reads it after the mark
    store.put(*rewritten)  # a fetch begun before the mark stores it again
    store.recency.wanted([wanted_again[0]])  # a job's next pass needs it
    assert store.get(wanted_again[0]) == wanted_again[1]
    store.recency.wanted([revived[0]])  # needed again, and not read (yet): no longer evicted first
    assert store.recency.pending()
    store.recency.record()
    n = 100
    while 25 + n - 100 - len(store) < 3:  # until the third eviction
        store.put(*item(n))
        n += 1
    assert spent[0] not in store and rewritten[0] not in store
    assert wanted_again[0] in store and revived[0] in store
    # the third went to the least recently used
    assert items[0][0] not in store and all(d in store for d, _ in items[1:20])


def test_an_insert_at_the_bound_evicts_only_the_room_it_needs(tmp_path):
    """diskcache evicts CULL_LIMIT entries whenever an insert reaches the bound: a
    store of ten items would lose eight for one. The store evicts the least recently
    used one at a time, until the new item fits."""
    small = [item(i) for i in range(11)]
    store = ContentStore(str(tmp_path / "store"), 10 * len(small[0][1]))
    try:
        for digest, data in small:
            store.put(digest, data)
        assert len(store) == 10 and small[0][0] not in store  # one went for the 11th
        large = item(100, 3 * len(small[0][1]))
        store.put(*large)
        assert store.volume() == store.size_limit  # three went for it, no more
        assert [d in store for d, _ in small] == [False] * 4 + [True] * 7
        assert store.get(large[0]) == large[1]
    finally:
        store.close()


def test_what_a_put_evicts_is_known_gone_without_a_look(tmp_path, sqlite_statements):
    """Puts say what they evicted, mountd's and a loader process's (``StoreWriter``):
    the store then knows which entries it holds without asking the index, and keeps the
    news, in order, for the view."""
    directory = str(tmp_path / "store")
    small = [item(i) for i in range(12)]
    store = ContentStore(directory, 10 * len(small[0][1]))
    writer = StoreWriter(directory, 10 * len(small[0][1]))
    try:
        for digest, data in small[:11]:
            store.put(digest, data)  # the eleventh evicts the first
        file = writer.put(*small[11])  # and a loader process's put, the second
        culled = writer.take_culled()
        writer.release()
        assert culled == [small[1][0]] and writer.take_culled() == []
        store.stored_elsewhere(small[11][0], file)
        store.culled(culled)
        before = len(sqlite_statements)
        assert [store.files.holds(d) for d, _ in small] == [False] * 2 + [True] * 10
        assert len(sqlite_statements) == before
        assert [d in store for d, _ in small] == [False] * 2 + [True] * 10  # as the index says
        assert list(store.evictions) == [small[0][0], small[1][0]]  # the view's news
    finally:
        store.close()


def test_a_store_as_large_as_its_items_holds_them_all(tmp_path):
    """The bound counts the items' bytes (not the blocks of their files), and an item
    that fills it exactly is kept: a cache sized to a dataset holds the whole dataset."""
    directory = str(tmp_path / "store")
    items = [item(i, 27_000) for i in range(40)] + [item(i, 40_000) for i in range(40, 50)]
    limit = sum(len(data) for _, data in items)
    store = ContentStore(directory, limit)
    try:
        for digest, data in items:
            store.put(digest, data)
        assert store.volume() == limit and len(store) == len(items)
        assert all(store.get(digest) == data for digest, data in items)
        store.put(*item(100, 27_000))  # one more: the least recently used go
        assert store.volume() <= limit and items[0][0] not in store
        assert store.get(item(100, 27_000)[0]) is not None
    finally:
        store.close()
    assert_consistent(directory)


def test_a_store_that_counted_inline_items_as_nothing_counts_them_when_opened(tmp_path):
    """Versions before the bound counted items' bytes gave items kept in SQLite the
    size 0 (as diskcache does): opening such a store counts them, so it stays bounded."""
    directory = str(tmp_path / "store")
    items = [item(i, 1_000) for i in range(10)]
    old_store(directory, items)
    with contextlib.closing(sqlite3.connect(os.path.join(directory, "cache.db"))) as con:
        with con:
            con.execute("UPDATE Cache SET size = 0 WHERE filename IS NULL")
    store = ContentStore(directory, 1 << 20)
    try:
        assert store.volume() == sum(len(data) for _, data in items)
        assert all(store.get(digest) == data for digest, data in items)
    finally:
        store.close()
    assert_consistent(directory)


@pytest.mark.parametrize("by", ["mountd", "loader-process"])
def test_every_item_is_a_value_file_even_an_empty_one(store, tmp_path, by):
    """The native data plane serves a hit from its value file: every item has one, an
    empty item an empty file, whether mountd or a loader process stores it. Before,
    items under 4 KiB were rows of the index."""
    directory = str(tmp_path / "store")
    items = [item(70, 1_000), item(71, 32), item(72, 0)]
    if by == "mountd":
        assert all(store.put(digest, data) for digest, data in items)
    else:
        writer = StoreWriter(directory, 10 << 20)
        try:
            files = writer.put_many(items)
        finally:
            writer.release()
        for (digest, _), file in zip(items, files):
            store.stored_elsewhere(digest, file)
    assert index_rows(directory) == 0 and len(value_files(directory)) == 3
    for digest, data in items:
        path, _ = store.files.locate(digest)
        assert os.path.getsize(path) == len(data)
        assert store.get_nowait(digest, len(data)) == data
        assert store.get(digest) == data
    assert store.volume() == sum(len(data) for _, data in items) and len(store) == 3


def test_a_store_an_older_version_wrote_serves_its_rows_and_stores_files(tmp_path):
    """Before #54 the index kept items under 4 KiB as rows, and its Settings table said
    so: opened now, its rows are served (through the index) and kept, and every new
    item, however small, is a value file, whether mountd or a loader process stores it.
    Before, new small items were rows too."""
    directory = str(tmp_path / "store")
    rows, large = [item(i, 1_000) for i in range(80, 83)], item(83)
    old_store(directory, rows + [large])
    assert settings(directory)["disk_min_file_size"] == OLD_MIN_FILE_SIZE
    ours, theirs = item(84, 1_000), item(85, 2_000)
    store = ContentStore(directory, 64 << 20)
    writer = StoreWriter(directory, 64 << 20)
    try:
        assert settings(directory)["disk_min_file_size"] == 0
        for digest, data in rows:
            assert store.files.locate(digest) is None  # a row: read through the index
            assert store.files.holds(digest) is None  # nor can it tell without a look
            assert store.get(digest) == data
        assert store.get(large[0]) == large[1]
        assert store.put(*ours)
        store.stored_elsewhere(theirs[0], writer.put(*theirs))
        for digest, data in (ours, theirs):
            path, _ = store.files.locate(digest)
            assert os.path.getsize(path) == len(data)
            assert store.get_nowait(digest, len(data)) == data
    finally:
        writer.release()
        store.close()
    assert index_rows(directory) == len(rows) and len(value_files(directory)) == 3
    store = ContentStore(directory, 64 << 20)
    try:
        everything = rows + [large, ours, theirs]
        assert [store.get(digest) for digest, _ in everything] == [d for _, d in everything]
        assert store.corrupt_dropped == 0
        assert store.volume() == sum(len(data) for _, data in everything)
    finally:
        store.close()
    assert_consistent(directory)


# -- a full hash check on the first read after a start --------------------------------

@pytest.mark.parametrize("size, row", [(40_000, False), (VERIFY_ON_LOOP_MAX + 4096, False),
                                       (1_000, True)],
                         ids=["value-file", "value-file-hashed-in-a-worker", "old-index-row"])
def test_an_edit_with_a_matching_crc_is_not_served_after_a_restart(tmp_path, size, row):
    directory = str(tmp_path / "store")
    digest, data = item(4, size)
    other = item(5, size)
    if row:  # an item an older version kept in its index
        old_store(directory, [(digest, data), other])
    else:
        store = ContentStore(directory, 10 << 20)
        store.put(digest, data)
        store.put(*other)
        store.close()
    forged = b"forged!!" + data[8:]
    tag = content_store.google_crc32c.value(forged)
    with contextlib.closing(sqlite3.connect(os.path.join(directory, "cache.db"))) as con:
        (filename,), = con.execute("SELECT filename FROM Cache WHERE key = ?", (digest,))
        assert (filename is None) == row
        with con:  # the tag edited to match, so only a full hash can tell
            con.execute("UPDATE Cache SET tag = ? WHERE key = ?", (tag, digest))
            if filename is None:
                con.execute("UPDATE Cache SET value = ? WHERE key = ?", (forged, digest))
    if filename is not None:
        with open(os.path.join(directory, filename), "r+b") as f:
            f.write(forged[:8])

    store = ContentStore(directory, 10 << 20)
    try:
        assert store.get_nowait(digest, len(data)) is None
        assert store.corrupt_dropped == 0  # the loop leaves dropping it to ``get``
        assert store.get(digest) is None
        assert store.corrupt_dropped == 1 and digest not in store
        assert store.get(other[0]) == other[1]
        assert store.get(other[0]) == other[1]  # verified once: served again
        assert store.corrupt_dropped == 1
    finally:
        store.close()
    assert_consistent(directory)


# -- writes that fail -----------------------------------------------------------------

class HalfWriter:
    """A file that takes half of the first write, then says the disk is full."""

    def __init__(self, f) -> None:
        self.f = f

    def write(self, data: bytes) -> int:
        self.f.write(data[:len(data) // 2])
        self.f.flush()
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def __enter__(self) -> HalfWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.f.close()


def test_a_value_write_cut_short_leaves_no_file(store, tmp_path, monkeypatch):
    directory = str(tmp_path / "store")
    monkeypatch.setattr(diskcache.core, "open",
                        lambda path, mode, **kw: HalfWriter(open(path, mode, **kw)),
                        raising=False)
    digest, data = item(6)
    assert not store.put(digest, data)
    monkeypatch.undo()
    assert value_files(directory) == []
    assert digest not in store and len(store) == 0
    health = store.health()
    assert not health.writable and health.write_error == "No space left on device"
    assert health.write_failures == 1 and health.write_error_since is not None


def test_a_put_whose_row_cannot_be_written_leaves_no_file(store, tmp_path, monkeypatch):
    def full(*args: object) -> None:
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(diskcache.Cache, "_row_insert", full)
    digest, data = item(7)
    assert not store.put(digest, data)
    monkeypatch.undo()
    assert value_files(str(tmp_path / "store")) == []
    assert store.health().write_error == "database or disk is full"


def test_writes_wait_for_the_back_off_then_recover(store, monkeypatch):
    calls = []

    def full(*args: object, **kwargs: object) -> None:
        calls.append(1)
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(diskcache.Cache, "set", full)
    assert not store.put(*item(8))
    assert not store.put(*item(9))  # within the back-off: not even tried
    assert len(calls) == 1 and store.health().write_failures == 2
    monkeypatch.undo()
    monkeypatch.setattr(store_health, "WRITE_RETRY_INTERVAL", 0.0)
    assert not store.put(*item(10))  # still waiting out the first back-off (5 s)
    store.write_health.retry_at = 0.0  # the back-off has passed
    digest, data = item(11)
    assert store.put(digest, data)
    health = store.health()
    assert health.writable and health.write_error is None and health.write_error_since is None
    assert store.get(digest) == data


def test_hits_drops_and_clears_survive_index_errors(store, no_back_off, monkeypatch):
    items = [item(i) for i in range(12, 15)]
    for digest, data in items:
        store.put(digest, data)
        assert store.get(digest) == data

    def broken(*args: object, **kwargs: object) -> None:
        raise sqlite3.OperationalError("disk I/O error")

    for name in ("transact", "delete", "clear"):
        monkeypatch.setattr(diskcache.Cache, name, broken)
    assert store.recency.record() == 0
    store.discard(items[0][0])
    store.clear()
    monkeypatch.undo()
    assert store.health().write_error == "cannot clear the store: disk I/O error"
    assert len(store) == 3  # nothing was dropped
    assert store.get(items[1][0]) == items[1][1]


@pytest.mark.parametrize("code,kept", [(errno.EMFILE, True), (errno.EIO, False)])
def test_a_value_file_that_cannot_be_read_fails_the_read(store, monkeypatch, code, kept):
    digest, data = item(16)
    store.put(digest, data)
    assert store.get(digest) == data  # its path is now known: read without the index

    def failing_open(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(content_store, "open", failing_open, raising=False)
    with pytest.raises(StoreError, match=os.strerror(code)):
        store.get(digest)
    monkeypatch.undo()
    # out of descriptors: the entry is fine; a failing file: dropped, fetched again
    assert (digest in store) == kept


def test_an_index_that_cannot_be_read_fails_the_read(tmp_path, monkeypatch):
    directory = str(tmp_path / "store")
    digest, data = item(17, 1_000)  # a row of an older version's index: its read asks it
    old_store(directory, [(digest, data)])
    store = ContentStore(directory, 10 << 20)
    try:
        in_file = item(18)
        store.put(*in_file)

        def failing_get(*args: object, **kwargs: object) -> None:
            raise sqlite3.OperationalError("disk I/O error")

        for name in ("get", "__contains__", "__len__"):
            monkeypatch.setattr(diskcache.Cache, name, failing_get)
        monkeypatch.setattr(disk_cache.ContentBoundCache, "volume", failing_get)
        with pytest.raises(StoreError, match="disk I/O error"):
            store.get(digest)
        assert store.get(in_file[0]) == in_file[1]  # its file is known: no query
        # lookups answer (nothing), not raise: status, metrics and statfs ask them
        assert digest not in store and store.volume() == 0 and len(store) == 0
        monkeypatch.undo()
        assert store.get(digest) == data
    finally:
        store.close()
    assert_consistent(directory)


def test_a_full_disk_stores_nothing_more_and_recovers(tmp_path, no_back_off):
    with mounted_tmpfs(str(tmp_path / "fs"), "2m") as fs:
        directory = os.path.join(fs, "store")
        store = ContentStore(directory, 64 << 20)
        items = [item(i, 200_000) for i in range(20)]
        stored = [store.put(*it) for it in items]
        assert stored.index(False) > 0 and not any(stored[stored.index(False):])
        held = stored.index(False)
        assert len(store) == held
        assert len(value_files(directory)) == held  # no file written in part
        health = store.health()
        assert not health.writable and health.write_error == "No space left on device"
        assert [store.get(d) == v for d, v in items[:held]] == [True] * held
        subprocess.run(["mount", "-o", "remount,size=16m", fs], check=True)
        store.write_health.retry_at = 0.0  # the back-off has passed
        assert store.put(*items[held])
        assert store.health().writable and len(store) == held + 1
        store.close()
        assert_consistent(directory)


def test_a_store_on_a_full_disk_opens_later(tmp_path, no_back_off):
    with mounted_tmpfs(str(tmp_path / "fs"), "2m") as fs:
        directory = os.path.join(fs, "store")
        store = ContentStore(directory, 64 << 20)
        digest, data = item(18)
        store.put(digest, data)
        store.close()
        filler = fill(fs)
        store = ContentStore(directory, 64 << 20)  # does not raise
        health = store.health()
        assert not health.writable and health.write_error.startswith("cannot open the store")
        assert store.get(digest) is None and not store.put(*item(19))
        assert len(store) == 0 and store.volume() == 0 and digest not in store
        store.recency.record()
        store.discard(digest)
        os.remove(filler)
        assert store.get(digest) == data  # opened at this try
        assert store.health().writable
        store.close()
        assert_consistent(directory)


# -- a damaged index ------------------------------------------------------------------

ABSENT = item(999)[0]  # stored nowhere here: a read of it asks the index


def filled_store(directory: str, n: int = 30) -> list[tuple[bytes, bytes]]:
    """A closed store of ``n`` items of 2-6 KB, each a value file."""
    items = [item(i, 6144 if i % 2 else 2048) for i in range(n)]
    store = ContentStore(directory, 64 << 20)
    for digest, data in items:
        store.put(digest, data)
    store.close()
    return items


def garbage_header(path: str) -> None:
    with open(path, "r+b") as f:
        f.write(random.Random(1).randbytes(100))


def damaged_middle(path: str) -> None:
    damage_pages(path, 0.3, 0.7)


@pytest.mark.parametrize("damage", [garbage_header, damaged_middle])
def test_a_damaged_index_is_moved_aside(tmp_path, caplog, damage):
    directory = str(tmp_path / "store")
    items = filled_store(directory)
    damage(os.path.join(directory, "cache.db"))
    with caplog.at_level(logging.WARNING, logger=INDEX_LOGGER):
        store = ContentStore(directory, 64 << 20)
    try:
        (warning,) = [r.getMessage() for r in caplog.records if r.name == INDEX_LOGGER]
        assert "damaged" in warning and "30 value files removed" in warning
        assert len(store) == 0 and value_files(directory) == []
        assert len([n for n in os.listdir(directory) if DAMAGED_SUFFIX in n
                    and not n.endswith("-wal")]) == 1
        assert store.health().writable
        assert store.get(items[1][0]) is None
        assert store.put(*items[1]) and store.get(items[1][0]) == items[1][1]
    finally:
        store.close()
    assert_consistent(directory)


def test_a_damaged_index_whose_file_cannot_be_statted_is_rebuilt(tmp_path, monkeypatch,
                                                                 no_back_off):
    """SQLite says the index is damaged and the disk fails the stat of its file (a dying
    disk does both): the write gives up and the next use rebuilds the store. Before, the
    OSError of that stat left the write, and the task writing (mountd's hit recorder, a
    loader process's outcome) ended mountd."""
    directory = str(tmp_path / "store")
    store = ContentStore(directory, 64 << 20)
    try:
        store.put(*item(1))
        db_path, real_stat = store.index.db_path, os.stat

        def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
            if os.fspath(path) == db_path:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_stat(path, *args, **kwargs)

        def damaged(*args: object) -> int:
            exc = sqlite3.DatabaseError("database disk image is malformed")
            exc.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
            raise exc

        with monkeypatch.context() as failing_disk:
            failing_disk.setattr(os, "stat", stat)
            assert store.index.write(damaged, None, "test") == 0
            assert store.index.current is None
        assert store.put(*item(2)) and store.get(item(2)[0]) == item(2)[1]
        assert store.get(item(1)[0]) is None  # a new, empty index
    finally:
        store.close()


def test_a_truncated_index_leaves_no_orphaned_files(tmp_path, caplog):
    directory = str(tmp_path / "store")
    items = filled_store(directory)
    os.truncate(os.path.join(directory, "cache.db"), 0)
    with caplog.at_level(logging.WARNING, logger=INDEX_LOGGER):
        store = ContentStore(directory, 64 << 20)
    try:
        (warning,) = [r.getMessage() for r in caplog.records if r.name == INDEX_LOGGER]
        assert "removed 30 value files" in warning
        assert len(store) == 0 and value_files(directory) == []
        assert not [n for n in os.listdir(directory) if DAMAGED_SUFFIX in n]
        assert store.get(items[1][0]) is None
    finally:
        store.close()
    assert_consistent(directory)


def test_damaged_indexes_kept_are_bounded(tmp_path, monkeypatch):
    directory = str(tmp_path / "store")
    stamps = iter(f"2026010{i}T000000" for i in range(1, 10))
    monkeypatch.setattr(index.time, "strftime", lambda fmt: next(stamps))
    for _ in range(KEEP_DAMAGED + 2):
        filled_store(directory, 4)
        garbage_header(os.path.join(directory, "cache.db"))
        ContentStore(directory, 64 << 20).close()
    kept = sorted(n for n in os.listdir(directory) if DAMAGED_SUFFIX in n)
    assert [n.rsplit("-", 1)[-1] for n in kept] == ["20260103T000000", "20260104T000000"]


def test_damage_found_while_serving_rebuilds_the_store(tmp_path, no_back_off):
    directory = str(tmp_path / "store")
    items = filled_store(directory)
    store = ContentStore(directory, 64 << 20)
    served, done = threading.Event(), threading.Event()

    def worker() -> None:  # a worker thread with a connection of its own, alive but idle
        store.get(ABSENT)
        served.set()
        done.wait()

    other = threading.Thread(target=worker)
    other.start()
    try:
        served.wait()
        assert store.get(items[0][0]) == items[0][1]
        damage_pages(os.path.join(directory, "cache.db"), 0.0, 1.0)
        with pytest.raises(StoreError, match="malformed"):
            store.get(ABSENT)  # a miss asks the index: the hits before did not
        # moved aside once no connection has it open: closing one later would delete
        # the new index's WAL
        assert store.get(items[4][0]) is None
        assert store.health().writable
        assert len(store) == 0 and value_files(directory) == []
        assert len([n for n in os.listdir(directory) if DAMAGED_SUFFIX in n
                    and not n.endswith("-wal")]) == 1
        assert store.put(*items[4]) and store.get(items[4][0]) == items[4][1]
    finally:
        done.set()
        other.join()
        store.close()
    assert_consistent(directory)


@contextlib.contextmanager
def damaged_while_held(store: ContentStore, items: list[tuple[bytes, bytes]],
                       then: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Damage the open index of ``store`` (and call ``then``) while a worker thread holds
    a connection to it (as one mid-query does), until the block ends; a miss finds the
    damage."""
    held = store.index.current
    assert held is not None
    served, done = threading.Event(), threading.Event()

    def worker() -> None:
        held.reader.get(items[2][0])  # its connection lives as long as the thread
        served.set()
        done.wait()

    other = threading.Thread(target=worker)
    other.start()
    try:
        served.wait()
        damage_pages(store.index.db_path, 0.0, 1.0)
        then()
        with pytest.raises(StoreError, match="malformed"):
            store.get(ABSENT)
        yield
    finally:
        done.set()
        other.join()
        del held


def aside(directory: str) -> list[str]:
    return [n for n in os.listdir(directory) if DAMAGED_SUFFIX in n and not n.endswith("-wal")]


def test_a_damaged_index_replaced_by_another_file_is_not_moved_aside(tmp_path, no_back_off):
    """The damaged index, still open here, is replaced at its path by another index
    (root restoring one): that file is not the damaged one, so it is opened, not moved
    aside. Before, the file at the path was moved aside once the damaged one closed."""
    directory = str(tmp_path / "store")
    items = filled_store(directory)
    other_dir = str(tmp_path / "other")
    other = filled_store(other_dir, 2)
    store = ContentStore(directory, 64 << 20)
    try:
        with damaged_while_held(store, items):
            assert store.get(items[4][0]) is None and aside(directory) == []  # held open
            for suffix in ("-wal", "-shm"):  # the damaged index's, as its replacer does
                with contextlib.suppress(FileNotFoundError):
                    os.remove(store.index.db_path + suffix)
            os.replace(os.path.join(other_dir, "cache.db"), store.index.db_path)
            for path in value_files(other_dir):  # and the value files it names
                os.renames(path, os.path.join(directory, os.path.relpath(path, other_dir)))
        assert store.get(other[0][0]) == other[0][1]
        assert aside(directory) == []
        assert store.health().writable
    finally:
        store.close()


def test_a_damaged_index_is_not_moved_aside_while_held_though_its_stat_fails(
        tmp_path, monkeypatch, no_back_off):
    """The disk fails the stat of the damaged index while a connection of this process
    has it open: it stays where it is until that connection is gone (closing it after a
    rebuild would delete the new index's WAL). Before, a failed stat skipped the check
    and moved it aside at once."""
    directory = str(tmp_path / "store")
    items = filled_store(directory)
    store = ContentStore(directory, 64 << 20)
    try:
        db_path, real_stat = store.index.db_path, os.stat
        failing = threading.Event()

        def stat(path: object, *args: object, **kwargs: object) -> os.stat_result:
            if failing.is_set() and os.fspath(path) == db_path:
                raise OSError(errno.EIO, os.strerror(errno.EIO))
            return real_stat(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)
        with damaged_while_held(store, items, failing.set):
            assert store.get(items[4][0]) is None and aside(directory) == []
            failing.clear()
            assert store.get(items[4][0]) is None and aside(directory) == []  # held
        assert store.get(items[4][0]) is None and len(aside(directory)) == 1
        assert store.put(*items[4]) and store.get(items[4][0]) == items[4][1]
        assert store.health().writable
    finally:
        store.close()
    assert_consistent(directory)


# -- what metrics show ----------------------------------------------------------------

def test_metrics_show_a_store_that_cannot_write(store, monkeypatch, tmp_path):
    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    services = lone_services(store, str(tmp_path / "coordinator"))
    collector = MountdCollector(services, MountTable(), JobRegistry(MountTable(), services.limiter))

    def samples() -> dict[str, float]:
        return {s.name: s.value for family in collector.collect() for s in family.samples
                if s.name.startswith("quiver_store")}

    assert samples() == {"quiver_store_writable": 1, "quiver_store_write_failures_total": 0}
    monkeypatch.setattr(diskcache.Cache, "set", full)
    store.put(*item(20))
    store.put(*item(21))  # in the back-off: counted, not tried
    assert samples() == {"quiver_store_writable": 0, "quiver_store_write_failures_total": 2}


DROP_TRIES = 20


def test_get_nowait_serves_only_entries_whose_pages_are_cached(store):
    digest, data = item(7)
    store.put(digest, data)
    assert store.get_nowait(digest, len(data)) == data  # stored here: file known, hashed
    assert store.get_nowait(digest, len(data) - 1) is None  # not the item's size
    path, _ = store.files.locate(digest)
    # On disk only: a thread reads it. The kernel may keep a page that another CPU's
    # LRU batch still holds, so the pages are dropped until they are gone.
    for _ in range(DROP_TRIES):
        drop_page_cache([path])
        if store.get_nowait(digest, len(data)) is None:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"get_nowait still served {path} after {DROP_TRIES} drops of its pages")
    assert store.get(digest) == data
    with open(path, "r+b") as f:  # damaged in place: the CRC32C says so
        f.write(b"\0")
    assert store.get_nowait(digest, len(data)) is None
    assert store.get(digest) is None and store.corrupt_dropped == 1
    assert store.get_nowait(digest, len(data)) is None


def test_a_planners_look_up_trusts_entries_found_lately_and_opens_the_rest(store, tmp_path,
                                                                           monkeypatch):
    monkeypatch.setattr(known_files, "SEEN_LATELY_S", 0.2)
    read, unread, dropped, culled = items = [item(40 + i) for i in range(4)]
    for digest, data in items:
        assert store.put(digest, data)
    for digest, data in (read, dropped, culled):
        assert store.get(digest) == data
    opened: list[bytes] = []
    open_cached = content_store.open_cached
    monkeypatch.setattr(content_store, "open_cached",
                        lambda path: (opened.append(path), open_cached(path))[1])
    # past the one it opens, the look goes on with those read lately
    assert store.leading_known([read[0], unread[0], dropped[0]]) == 3
    assert opened == [store.files.locate(unread[0])[0]]  # the one not read lately
    store.discard(dropped[0])
    assert store.leading_known([dropped[0]]) == 0  # dropped here: vouched for no more
    with diskcache.Cache(str(tmp_path / "store")) as other:  # another process culls it
        assert other.delete(culled[0])
    assert store.leading_known([culled[0]]) == 1  # taken as held: its read is a miss
    assert store.get(culled[0]) is None
    time.sleep(2 * known_files.SEEN_LATELY_S)
    opened.clear()
    assert store.leading_known([read[0]]) == 1 and len(opened) == 1  # too old: opened


# -- hits without the index: where value files are is kept in memory ------------------

@pytest.fixture
def sqlite_statements(monkeypatch) -> list[str]:
    """Every SQL statement run on a connection opened from now on, in any thread (the
    store's own and diskcache's)."""
    statements: list[str] = []
    connect = sqlite3.connect

    def traced(*args: object, **kwargs: object) -> sqlite3.Connection:
        con = connect(*args, **kwargs)
        con.set_trace_callback(statements.append)
        return con

    monkeypatch.setattr(sqlite3, "connect", traced)
    return statements


def reopened(directory: str, items: list[tuple[bytes, bytes]]) -> ContentStore:
    """A store that held ``items`` (stored in this order), closed and opened again."""
    store = ContentStore(directory, 10 << 20)
    for digest, data in items:
        assert store.put(digest, data)
    store.close()
    return ContentStore(directory, 10 << 20)


def test_a_reopened_store_serves_hits_without_a_query(tmp_path, sqlite_statements):
    items = [item(30 + i, 20_000 + 1_000 * i) for i in range(4)]  # up to VERIFY_ON_LOOP_MAX
    store = reopened(str(tmp_path / "store"), items)
    try:
        at_open = len(sqlite_statements)
        for digest, data in items:  # first reads in this run: hashed in full, on the loop
            assert store.get_nowait(digest, len(data)) == data
        for digest, data in items:
            assert store.get_nowait(digest, len(data)) == data
        assert len(sqlite_statements) == at_open
        assert store.get(item(39)[0]) is None  # a miss asks the index: the trace sees it
        assert len(sqlite_statements) > at_open
    finally:
        store.close()


def test_a_large_item_is_first_hashed_in_a_worker_without_a_query(tmp_path,
                                                                  sqlite_statements):
    digest, data = item(35, VERIFY_ON_LOOP_MAX + 4096)
    store = reopened(str(tmp_path / "store"), [(digest, data)])
    try:
        at_open = len(sqlite_statements)
        assert store.get_nowait(digest, len(data)) is None  # not hashed in full yet
        assert store.get(digest) == data  # what the worker does: its file is known
        assert store.get_nowait(digest, len(data)) == data
        assert len(sqlite_statements) == at_open
    finally:
        store.close()


def test_an_item_a_loader_process_stored_is_served_without_a_query(tmp_path,
                                                                   sqlite_statements):
    directory = str(tmp_path / "store")
    store = ContentStore(directory, 10 << 20)
    writer = StoreWriter(directory, 10 << 20)
    items = [item(36), item(37, 1_000), item(38, 0)]  # however small: each a file
    try:
        files = [writer.put(digest, data) for digest, data in items]
        writer.release()
        assert [os.path.getsize(os.path.join(directory, f.name)) for f in files] == [
            len(data) for _, data in items]
        before = len(sqlite_statements)
        for (digest, _), file in zip(items, files):
            store.stored_elsewhere(digest, file)
        assert [store.get_nowait(d, len(data)) for d, data in items] == [
            data for _, data in items]
        assert len(sqlite_statements) == before
    finally:
        store.close()
    assert_consistent(directory)


def test_value_files_culled_or_stored_again_by_another_process_are_read_right(tmp_path):
    directory = str(tmp_path / "store")
    culled, stored_again = item(40), item(41)
    store = reopened(directory, [culled, stored_again])
    try:
        with diskcache.Cache(directory) as other:  # another process culls one
            assert other.delete(culled[0])
        writer = StoreWriter(directory, 10 << 20)  # and stores the other anew: a new file
        writer.put(*stored_again)
        writer.release()
        assert store.get_nowait(culled[0], len(culled[1])) is None
        assert store.get(culled[0]) is None
        assert store.get_nowait(stored_again[0], len(stored_again[1])) is None
        assert store.get(stored_again[0]) == stored_again[1]  # found through the index
        assert store.get_nowait(stored_again[0], len(stored_again[1])) == stored_again[1]
        assert store.corrupt_dropped == 0
    finally:
        store.close()
    assert_consistent(directory)


def test_membership_of_known_files_asks_no_query_and_a_culled_one_is_not_held(
        tmp_path, sqlite_statements):
    directory = str(tmp_path / "store")
    items = [item(50 + i) for i in range(3)] + [item(53, 1_000)]
    store = reopened(directory, items)
    try:
        digests = [d for d, _ in items]
        before = len(sqlite_statements)
        assert all(d in store for d in digests) and store.leading_held(digests) == 4
        assert len(sqlite_statements) == before
        assert item(54)[0] not in store and len(sqlite_statements) > before  # asked
        with diskcache.Cache(directory) as other:  # another process culls the third
            assert other.delete(digests[2])
        assert digests[2] not in store
        assert store.leading_held(digests) == 2
        assert store.leading_held([item(55)[0], *digests]) == 0
    finally:
        store.close()


def test_puts_and_drops_keep_the_index_of_value_files(store):
    large, small = item(42), item(43, 1_000)
    assert store.put(*large) and store.put(*small)
    assert store.get_nowait(large[0], len(large[1])) == large[1]
    assert store.get_nowait(small[0], len(small[1])) == small[1]  # a file too
    store.discard(large[0])
    assert store.files.locate(large[0]) is None
    assert store.get_nowait(large[0], len(large[1])) is None
    assert store.put(*large)
    assert store.get_nowait(large[0], len(large[1])) == large[1]
    store.clear()
    assert store.files.locate(large[0]) is None and store.files.locate(small[0]) is None
    assert store.get_nowait(large[0], len(large[1])) is None
    assert store.get(large[0]) is None and store.get(small[0]) is None


def test_the_index_of_value_files_is_bounded_and_keeps_the_most_recent(tmp_path,
                                                                       monkeypatch):
    monkeypatch.setattr(known_files, "MAX_KNOWN_FILES", 4)
    items = [item(i) for i in range(50, 56)]
    store = reopened(str(tmp_path / "store"), items)

    def known() -> list[bool]:
        files = store.files
        return [d in files._new or d in files._old for d, _ in items]

    try:
        assert known() == [False, False, True, True, True, True]
        # of those it let go, it cannot tell without a look
        assert [store.files.holds(d) for d, _ in items] == [None, None] + [True] * 4
        for digest, data in items:  # the others are read through the index
            assert store.get(digest) == data
            assert sum(known()) <= 4
        assert store.get_nowait(items[-1][0], len(items[-1][1])) == items[-1][1]
    finally:
        store.close()


@pytest.mark.skipif(tuple(map(int, os.uname().release.split(".")[:2])) < (5, 12),
                    reason="openat2's RESOLVE_CACHED came in Linux 5.12")
def test_a_path_not_in_the_dentry_cache_is_not_waited_for(tmp_path):
    path = os.fsencode(tmp_path / "never-looked-up")
    with pytest.raises(BlockingIOError):  # EAGAIN: the kernel would have to look
        known_files.open_cached(path)
    assert known_files._resolve_cached  # this kernel has RESOLVE_CACHED (5.12)


def test_hits_are_served_where_the_kernel_lacks_resolve_cached(store, monkeypatch):
    monkeypatch.setattr(known_files, "_resolve_cached", False)
    digest, data = item(44)
    store.put(digest, data)
    assert store.get_nowait(digest, len(data)) == data


def test_a_loader_process_stores_a_batch_in_one_transaction_or_none_of_it(
        tmp_path, sqlite_statements, monkeypatch):
    directory = str(tmp_path / "store")
    writer = StoreWriter(directory, 10 << 20)
    batch = [item(50 + i) for i in range(4)]
    writer.put(*item(49))  # the index is open
    before = len(sqlite_statements)
    files = writer.put_many(batch)
    commits = [s for s in sqlite_statements[before:] if s.strip().upper() == "COMMIT"]
    assert len(commits) == 1
    assert all(isinstance(f, known_files.ValueFile) for f in files)
    assert len({f.name for f in files}) == 4

    failing = [item(60 + i) for i in range(3)]
    written = 0
    store_value = disk_cache.TrackedDisk.store

    def full_on_the_third(self, value, read, key=disk_cache.UNKNOWN):
        nonlocal written
        written += 1
        if written == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return store_value(self, value, read, key=key)

    monkeypatch.setattr(disk_cache.TrackedDisk, "store", full_on_the_third)
    outcomes = writer.put_many(failing)
    assert written == 3
    assert all(isinstance(o, StoreError) for o in outcomes)
    assert "No space left" in str(outcomes[0])
    writer.release()
    store = ContentStore(directory, 10 << 20)
    try:  # the first batch whole, nothing of the second, and no file left of it
        assert [store.get(d) for d, _ in batch] == [data for _, data in batch]
        assert all(d not in store for d, _ in failing)
        assert len(value_files(directory)) == 5
    finally:
        store.close()
    assert_consistent(directory)


# -- writes no read waits for ----------------------------------------------------------

def test_a_put_for_a_read_does_not_wait_for_a_hung_writer(store, monkeypatch):
    """While another thread holds the store's write lock (a writer hung in SQLite), a
    read's put returns within STUCK_AFTER, at once once the writer is stuck, and its
    bytes are served from memory; puts beyond MAX_PENDING_BYTES are not made; all are
    stored once the lock is let go."""
    monkeypatch.setattr(background_writes, "MAX_PENDING_BYTES", 3 * 40_000)
    items = [item(n) for n in range(4)]
    with store.index.write_lock:
        took = []
        for digest, data in items:
            started = time.monotonic()
            store.put_soon(digest, data)
            took.append(time.monotonic() - started)
        assert took[0] < 2 * background_writes.STUCK_AFTER
        assert max(took[1:]) < background_writes.STUCK_AFTER  # the writer is stuck
        assert [store.get(d) for d, _ in items] == [data for _, data in items[:3]] + [None]
        assert store.health().write_failures == 1
    deadline = time.monotonic() + 10
    while store.writes.pending:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert len(store) == 3 and [d in store for d, _ in items] == [True] * 3 + [False]

"""Cached reads through a real mount: FUSE requests counted by opcode, one READ per item,
and hits served without a worker thread still exact and still checked."""
from __future__ import annotations

import concurrent.futures
import contextlib
import hashlib
import math
import os
import sqlite3
import subprocess
import time

import google_crc32c
import pytest

from mountd.fs.datasets_fs import ROOT_ENTRY_TIMEOUT
from mountd.fs.fuse_limits import FUSECTL, MAX_BACKGROUND, READAHEAD_KB
from mountd.store.content_store import VERIFY_ON_LOOP_MAX
from quiverfs.mount_point import mount_device
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory, tree_hashes  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

# What the reads find is the point of the tests that damage the store: no scrubber finds
# it first (tests/test_scrubber.py tests that)
NO_SCRUB = ("--scrub-mb-s", "0")


def _sha(rel: str, dir_fd: int) -> str:
    with open(os.open(rel, os.O_RDONLY, dir_fd=dir_fd), "rb", buffering=0) as f:
        return hashlib.sha256(f.read()).hexdigest()


@contextlib.contextmanager
def _dir(path: str):
    """``path`` opened, so that names under it are looked up from it: the dataset's own
    entry (1 s) is not looked up again however long the reads take."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def _read_all(root: str | int, rels: list[str], threads: int = 8) -> dict[str, str]:
    """The SHA-256 of each of ``rels`` under ``root`` (a path, or an open directory)."""
    if isinstance(root, str):
        with _dir(root) as fd:
            return _read_all(fd, rels, threads)
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return dict(zip(rels, pool.map(lambda r: _sha(r, root), rels)))


def _requests_after(m, before: dict[str, int], releases: int) -> dict[str, int]:
    """The requests since ``before``, once the kernel's ``releases`` RELEASEs (sent
    after close returns) have arrived."""
    deadline = time.monotonic() + 10
    while True:
        now = m.status()["fuse_requests"]
        diff = {op: n - before.get(op, 0) for op, n in now.items() if n != before.get(op, 0)}
        if diff.get("release", 0) >= releases or time.monotonic() > deadline:
            return diff
        time.sleep(0.05)


def _counted_read(m, root: int, rels: list[str], expected: dict[str, str], opens: int,
                  threads: int = 8) -> dict[str, int]:
    """The requests that reading ``rels`` under ``root`` sent, less the GETATTRs of the
    dataset's directory: its attributes last ROOT_ENTRY_TIMEOUT, so a slow machine's
    reads ask for them again, at most once per reading thread each time they lapse."""
    before = m.status()["fuse_requests"]
    start = time.monotonic()
    assert _read_all(root, rels, threads) == expected
    lapses = math.ceil((time.monotonic() - start) / ROOT_ENTRY_TIMEOUT)
    diff = _requests_after(m, before, opens)
    assert diff.pop("getattr", 0) <= threads * lapses
    return diff


@pytest.mark.parametrize("mode", ["no-open", "open"])
def test_requests_per_file_are_counted_and_each_item_is_one_read(mountd_factory,
                                                                 synthetic_tree, mode):
    m = mountd_factory(extra_args=("--fuse-opens",) if mode == "open" else ())
    assert m.status()["fuse_mode"] == mode
    data = make_digest(synthetic_tree.root, "syn")
    expected = tree_hashes(synthetic_tree.root)
    rels = sorted(expected)
    classes = {os.path.dirname(r) for r in rels}
    mount(m, data, "fill")
    assert _read_all(os.path.join(m.root, "fill"), rels) == expected  # now all cached

    device = mount_device(m.root)
    with open(f"/sys/class/bdi/{device}/read_ahead_kb", encoding="ascii") as f:
        assert int(f.read()) == READAHEAD_KB
    with open(f"/sys/fs/fuse/connections/{device.split(':')[1]}/max_background",
              encoding="ascii") as f:
        assert int(f.read()) == MAX_BACKGROUND

    mount(m, data, "syn")  # a fresh name: new inodes, nothing in the kernel's caches
    opens = len(rels) if mode == "open" else 0
    with _dir(os.path.join(m.root, "syn")) as root:  # the dataset's one LOOKUP
        # the class directories first, from one thread: two threads' first lookups of
        # one name may both reach mountd (the second can find the new entry before its
        # timeout is set, and looks it up again), which is the kernel's doing
        before = m.status()["fuse_requests"]
        for c in sorted(classes):
            os.stat(c, dir_fd=root)
        assert _requests_after(m, before, 0).get("lookup") == len(classes)
        first = _counted_read(m, root, rels, expected, opens)
        # a name and one READ per file (items are up to 300 KB), and, with opens, an open
        # and a release
        lookups = {"lookup": len(rels), "read": len(rels)}
        assert first == (lookups | {"open": opens, "release": opens} if opens else lookups)
        second = _counted_read(m, root, rels, expected, opens)
    # the kernel kept the pages, so no READ, and its attributes (a read-only mount's
    # reads leave them current), so no GETATTR at Python's fstat: without opens,
    # nothing reaches mountd at all. A few READs may come of a kernel that reclaims
    # page cache on its own (DAMON's pageout, on this project's machines: 2 of the 40
    # files once); pages the mount let go of would be every file's.
    assert second.pop("read", 0) <= len(rels) // 10, second
    assert second == ({"open": opens, "release": opens} if opens else {})


def test_a_hit_corrupted_on_disk_after_it_was_served_is_refetched(mountd_factory,
                                                                  synthetic_tree):
    """Through Python, every hit checks its CRC32C. (The native data plane serves a
    verified file without a check; the scrubber finds it: tests/test_scrubber.py.)"""
    m = mountd_factory(extra_args=("--data-path", "python", *NO_SCRUB))
    data = make_digest(synthetic_tree.root, "syn")
    expected = tree_hashes(synthetic_tree.root)
    rels = sorted(expected)
    mount(m, data, "a")
    for _ in range(2):  # fetched, then served from the store (its file known, verified)
        assert _read_all(os.path.join(m.root, "a"), rels, threads=1) == expected
    store = os.path.join(m.cache_dir, "store")
    value_files = sorted(os.path.join(d, f) for d, _, fs in os.walk(store)
                         for f in fs if f.endswith(".val"))
    assert value_files
    with open(value_files[0], "r+b") as f:  # in place: the page cache holds the bad byte
        byte = f.read(1)
        f.seek(0)
        f.write(bytes([byte[0] ^ 0xFF]))

    mount(m, data, "b")  # fresh inodes: every read reaches mountd
    assert _read_all(os.path.join(m.root, "b"), rels) == expected
    st = m.status()
    assert st["cache"]["corrupt_dropped"] == 1
    assert st["counters"]["bucket_fetches"] == len(rels) + 1


def _forge(store: str, order: str) -> int:
    """Edit the first bytes of the first value file by size in ``order`` (ASC or DESC),
    and its row's CRC32C tag to match, so that only a full hash tells; its size."""
    with contextlib.closing(sqlite3.connect(os.path.join(store, "cache.db"))) as con, con:
        (key, name, size), = con.execute("SELECT key, filename, size FROM Cache WHERE "
                                         f"filename IS NOT NULL ORDER BY size {order} LIMIT 1")
        path = os.path.join(store, name)
        with open(path, "r+b") as f:
            f.write(b"forged!!")
        with open(path, "rb") as f:
            con.execute("UPDATE Cache SET tag = ? WHERE key = ?",
                        (google_crc32c.value(f.read()), key))
    return size


def test_a_restarted_mountd_never_serves_an_item_forged_with_a_matching_crc(mountd_factory,
                                                                            synthetic_tree):
    """After a restart the store knows its value files from the start; an item's first
    read in the run hashes it in full, on the loop or in a worker by its size."""
    m = mountd_factory()
    data = make_digest(synthetic_tree.root, "syn")
    expected = tree_hashes(synthetic_tree.root)
    rels = sorted(expected)
    mount(m, data, "a")
    assert _read_all(os.path.join(m.root, "a"), rels) == expected  # now all cached
    assert m.stop() == 0
    store = os.path.join(m.cache_dir, "store")
    assert _forge(store, "ASC") <= VERIFY_ON_LOOP_MAX < _forge(store, "DESC")

    m = mountd_factory(cache_dir=m.cache_dir, extra_args=NO_SCRUB)
    assert _read_all(os.path.join(m.root, "a"), rels) == expected
    st = m.status()
    assert st["cache"]["corrupt_dropped"] == 2
    assert st["counters"]["bucket_fetches"] == 2
    assert st["counters"]["local_hits"] == len(rels) - 2


STORED_TIMEOUT = 60.0  # seconds for a job's first batch to be fetched and stored


def test_items_of_a_few_bytes_and_an_empty_one_are_value_files(mountd_factory, tmp_path):
    """A job's planned fetches store every item as a value file (what the native data
    plane reads), those of a few bytes and an empty one too; reads through the mount are
    then served from them, in this run and after a restart. Before, items under 4 KiB
    were rows of the index."""
    contents = {f"c/{n}.png": bytes([n]) * n for n in range(20)}  # 0 to 19 bytes
    src = tmp_path / "src"
    (src / "c").mkdir(parents=True)
    for rel, content in contents.items():
        (src / rel).write_bytes(content)
    data = make_digest(str(src), "tiny")
    expected = tree_hashes(str(src))
    rels = sorted(expected)
    m = mountd_factory()
    mount(m, data, "tiny")
    sampler = QuiverBatchSampler(os.path.join(m.root, "tiny"), len(rels), seed=1)
    try:
        sampler.manifest(0)  # its one batch holds every item: each fetched and stored
        deadline = time.monotonic() + STORED_TIMEOUT
        while m.status()["cache"]["items"] < len(rels):
            assert time.monotonic() < deadline, m.status()["cache"]
            time.sleep(0.05)
    finally:
        sampler.close()
    store = os.path.join(m.cache_dir, "store")
    with contextlib.closing(sqlite3.connect(os.path.join(store, "cache.db"))) as con:
        file_sizes = {key: name and os.path.getsize(os.path.join(store, name))
                      for key, name in con.execute("SELECT key, filename FROM Cache")}
    assert file_sizes == {hashlib.sha256(c).digest(): len(c) for c in contents.values()}
    assert _read_all(os.path.join(m.root, "tiny"), rels) == expected
    assert m.status()["counters"]["bucket_fetches"] == len(rels)  # the job's, no more
    assert m.stop() == 0

    m = mountd_factory(cache_dir=m.cache_dir)
    assert _read_all(os.path.join(m.root, "tiny"), rels) == expected
    st = m.status()
    assert st["counters"].get("bucket_fetches", 0) == 0
    assert st["cache"]["items"] == len(rels) and st["cache"]["corrupt_dropped"] == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting the FUSE control filesystem needs root")
def test_mountd_mounts_the_fuse_control_filesystem_where_nothing_has(mountd_factory):
    """max_background lives in /sys/fs/fuse/connections, which systemd mounts at boot; a
    machine without it (a container, this CI's VM) would keep the kernel's 12."""
    if os.path.ismount(FUSECTL):
        subprocess.run(["umount", FUSECTL], check=True)
    assert not os.path.ismount(FUSECTL)
    try:
        _check_control_filesystem_mounted(mountd_factory())
    finally:  # mounted again even if mountd failed to: other software may read it
        if not os.path.ismount(FUSECTL):
            subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL], check=False)


def _check_control_filesystem_mounted(m) -> None:
    setting = f"{FUSECTL}/{mount_device(m.root).split(':')[1]}/max_background"

    def max_background() -> int | None:
        try:
            with open(setting, encoding="ascii") as f:
                return int(f.read())
        except FileNotFoundError:
            return None

    deadline = time.monotonic() + 10
    while max_background() != MAX_BACKGROUND and time.monotonic() < deadline:
        time.sleep(0.05)  # mountd tunes the connection once the kernel's INIT is answered
    assert os.path.ismount(FUSECTL)
    assert max_background() == MAX_BACKGROUND

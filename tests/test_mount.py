"""mountd end to end: real mounts, real reads, real processes."""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import hashlib
import os
import random
import shutil
import sqlite3
import subprocess
import time

import diskcache
import pytest
import torch
import torchvision
from google.auth.credentials import AnonymousCredentials
from google.cloud import storage

from mountd.fs.datasets_fs import FAILED_HOLD
from quiverfs import digest as digest_format
from quiverfs.bench.processes import unmount
from tests.mountd_helpers import (call_as, dataset_counters, make_digest, mount,
                                  mountd_factory, tree_hashes)

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def imagefolder_epoch(root: str) -> tuple[list[str], dict[str, str]]:
    """One epoch of ImageFolder + DataLoader(num_workers=4): classes and path -> sha256."""
    ds = torchvision.datasets.ImageFolder(
        root, loader=lambda p: hashlib.sha256(read_bytes(p)).hexdigest())
    loader = torch.utils.data.DataLoader(
        [(ds.samples[i][0], i) for i in range(len(ds))], batch_size=64, num_workers=4,
        collate_fn=lambda batch: [(p, ds[i][0]) for p, i in batch])
    seen: dict[str, str] = {}
    for batch in loader:
        for path, digest in batch:
            seen[os.path.relpath(path, root)] = digest
    return ds.classes, seen


def test_imagefolder_file_source_and_cached_second_epoch(mountd_factory, digits_tree, tmp_path):
    src = str(tmp_path / "digits")
    shutil.copytree(digits_tree.root, src)
    m = mountd_factory()
    mount(m, make_digest(src, "digits"), "digits")
    root = os.path.join(m.root, "digits")

    classes, seen = imagefolder_epoch(root)
    expected = tree_hashes(src)
    assert classes == torchvision.datasets.ImageFolder(src).classes
    assert seen == expected and len(seen) == 1797

    shutil.rmtree(src)  # the second epoch can only come from the cache
    _, seen2 = imagefolder_epoch(root)
    assert seen2 == expected
    c = dataset_counters(m, "digits")
    assert c["bucket_fetches"] == 1797
    # each item once more, from the store or from the kernel's page cache of the mount
    # (which, without OPEN, mountd does not see): none missed again
    assert c["misses"] == 1797


def test_imagefolder_gcs_source_and_cached_second_epoch(mountd_factory, digits_tree, upload,
                                                        gcs_emulator, gcs_bucket, tmp_path):
    src = str(tmp_path / "digits")  # three classes: uploads to the emulator are slow
    for label in ("0", "1", "2"):
        shutil.copytree(os.path.join(digits_tree.root, label), os.path.join(src, label))
    uri = upload(src, "digits")
    m = mountd_factory()
    mount(m, make_digest(uri, "digits", gcs_emulator.host), "digits", gcs_emulator.host)
    root = os.path.join(m.root, "digits")

    classes, seen = imagefolder_epoch(root)
    expected = tree_hashes(src)
    n = len(expected)
    assert classes == ["0", "1", "2"] and n > 500
    assert seen == expected

    client = storage.Client(project="test", credentials=AnonymousCredentials(),
                            client_options={"api_endpoint": gcs_emulator.host})
    for blob in list(client.list_blobs(gcs_bucket)):
        blob.delete()  # the emulator now has nothing: epoch 2 must be all cache
    _, seen2 = imagefolder_epoch(root)
    assert seen2 == expected
    c = dataset_counters(m, "digits")
    assert c["bucket_fetches"] == n
    assert c["misses"] == n
    assert c.get("bucket_errors", 0) == 0


def test_real_image_decode_through_mount(mountd_factory, digits_tree):
    m = mountd_factory()
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    tf = torchvision.transforms.ToTensor()
    mounted = torchvision.datasets.ImageFolder(os.path.join(m.root, "digits"), transform=tf)
    local = torchvision.datasets.ImageFolder(digits_tree.root, transform=tf)
    for i in random.Random(0).sample(range(len(local)), 50):
        (a, la), (b, lb) = mounted[i], local[i]
        assert la == lb and torch.equal(a, b)


def test_hash_mismatch_at_source_is_eio_and_not_cached(mountd_factory, synthetic_tree, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(synthetic_tree.root, src)
    data = make_digest(src, "syn")
    victim = sorted(tree_hashes(src))[3]
    path = os.path.join(src, victim)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:  # same size, other content
        f.seek(size // 2)
        f.write(b"\xff" * 16)
    m = mountd_factory()
    mount(m, data, "syn")
    for _ in range(2):  # the second within mountd.fs.datasets_fs.FAILED_HOLD: no fetch again
        with pytest.raises(OSError) as info:
            read_bytes(os.path.join(m.root, "syn", victim))
        assert info.value.errno == errno.EIO
    time.sleep(FAILED_HOLD)
    with pytest.raises(OSError) as info:  # later, a read tries again
        read_bytes(os.path.join(m.root, "syn", victim))
    assert info.value.errno == errno.EIO
    st = m.status()
    assert st["cache"]["items"] == 0
    assert dataset_counters(m, "syn")["integrity_failures"] == 2
    assert victim in m.log_tail(50) and "does not match" in m.log_tail(50)


def test_a_size_that_is_not_the_contents_is_eio_never_a_prefix(mountd_factory, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    contents = {"large.bin": os.urandom(50_000), "small.bin": os.urandom(100)}
    for name, data in contents.items():
        (src / name).write_bytes(data)
    m = mountd_factory()
    mount(m, make_digest(str(src), "honest"), "honest")
    for name, data in contents.items():  # both now in the store, by their hashes
        assert read_bytes(os.path.join(m.root, "honest", name)) == data
    # known hashes under other sizes: shorter, longer, and not cached yet
    (src / "fresh.bin").write_bytes(b"f" * 8000)
    known = {**contents, "fresh.bin": b"f" * 8000}
    items = [digest_format.NewItem(path=f"{name}.{how}", digest=hashlib.sha256(data).digest(),
                                   size=size, key=name)
             for name, data in known.items()
             for how, size in (("short", len(data) // 2), ("long", len(data) + 1))]
    mount(m, digest_format.encode("sizes", f"file://{src}", items), "sizes")
    for item in items:
        with pytest.raises(OSError) as info:
            read_bytes(os.path.join(m.root, "sizes", item.path))
        assert info.value.errno == errno.EIO, item.path
    assert dataset_counters(m, "sizes")["integrity_failures"] == len(items)
    assert "is 25000 bytes in its digest" in m.log_tail(50)
    for name, data in contents.items():  # the honest dataset is untouched
        assert read_bytes(os.path.join(m.root, "honest", name)) == data


def as_user(uid: int, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), user=uid, group=uid, capture_output=True, timeout=60,
                          encoding="utf-8", errors="replace")


@pytest.mark.parametrize("mode", ["no-open", "open", "view"])
def test_other_uid_cannot_list_or_read(shared_workdir, mountd_factory, synthetic_tree, mode):
    # no-open: the kernel checks permissions at lookup (the mount's default_permissions),
    # with no OPEN for mountd to refuse; a view is served by ROOT/.quiver's connection
    src = os.path.join(shared_workdir, "src")
    shutil.copytree(synthetic_tree.root, src)
    subprocess.run(["chmod", "-R", "a+rX", src], check=True)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"),
                       extra_args=("--fuse-opens",) if mode == "open" else ())
    os.chmod(m.cache_dir, 0o755)  # the control socket lives there
    request = {"op": "mount", "name": "mine", "digest": make_digest(src, "mine")}
    if mode == "view":
        request["view"] = "substitutable"
    reply = call_as(1000, 1000, m.socket, request)
    assert reply["ok"], reply
    first = sorted(tree_hashes(src))[0]
    owner = as_user(1000, "cat", os.path.join(m.root, "mine", first))
    assert owner.returncode == 0
    for path in (os.path.join(m.root, "mine"), os.path.join(m.root, ".quiver", "views", "mine")):
        other_ls = as_user(1001, "ls", path)
        assert other_ls.returncode != 0, path
        assert ("Permission denied" if mode == "view" or ".quiver" not in path
                else "No such file") in other_ls.stderr
    other_cat = as_user(1001, "cat", os.path.join(m.root, "mine", first))
    assert other_cat.returncode != 0 and "Permission denied" in other_cat.stderr
    assert as_user(1001, "ls", m.root).stdout.split() == []
    assert as_user(1000, "ls", m.root).stdout.split() == ["mine"]
    views = os.path.join(m.root, ".quiver", "views")
    assert as_user(1001, "ls", views).stdout.split() == []
    assert as_user(1000, "ls", views).stdout.split() == (["mine"] if mode == "view" else [])
    # another user cannot unmount it either
    refused = call_as(1001, 1001, m.socket, {"op": "umount", "name": "mine"})
    assert not refused["ok"] and refused["code"] == 3


def test_registration_needs_read_access_to_local_source(shared_workdir, mountd_factory,
                                                        synthetic_tree):
    src = os.path.join(shared_workdir, "private")
    shutil.copytree(synthetic_tree.root, src)
    os.chmod(src, 0o700)  # root's own files
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"))
    os.chmod(m.cache_dir, 0o755)
    reply = call_as(1000, 1000, m.socket, {"op": "mount", "name": "stolen",
                                           "digest": make_digest(src, "stolen")})
    assert not reply["ok"] and reply["code"] == 6
    assert "cannot read" in reply["error"]
    assert m.status()["datasets"] == []


def test_datasets_with_shared_content_share_cache_entries(mountd_factory, synthetic_tree,
                                                          tmp_path):
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    shutil.copytree(synthetic_tree.root, a)
    shutil.copytree(synthetic_tree.root, b)
    m = mountd_factory()
    mount(m, make_digest(a, "a"), "a")
    mount(m, make_digest(b, "b"), "b")
    expected = tree_hashes(a)
    for name in ("a", "b"):
        got = {p: hashlib.sha256(read_bytes(os.path.join(m.root, name, p))).hexdigest()
               for p in expected}
        assert got == expected
    assert m.status()["cache"]["items"] == len(set(expected.values()))
    assert dataset_counters(m, "a")["bucket_fetches"] == len(expected)
    assert dataset_counters(m, "b").get("bucket_fetches", 0) == 0
    assert dataset_counters(m, "b")["local_hits"] == len(expected)


def test_cache_size_bound_holds_under_churn(mountd_factory, synthetic_tree):
    limit = 2 << 20
    m = mountd_factory(cache_size=str(limit))
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    paths = sorted(tree_hashes(synthetic_tree.root))
    rng = random.Random(7)
    for _ in range(3):
        rng.shuffle(paths)
        for p in paths:
            data = read_bytes(os.path.join(m.root, "syn", p))
            assert len(data) == os.path.getsize(os.path.join(synthetic_tree.root, p))
        assert m.status()["cache"]["used_bytes"] <= limit
    m.stop()
    store = os.path.join(m.cache_dir, "store")
    # the bound is on the items' bytes; the index is on top (docs/operations.md), and a
    # store that evicts one item at a time fills up to the bound
    with contextlib.closing(sqlite3.connect(os.path.join(store, "cache.db"))) as con:
        (held,), = con.execute("SELECT SUM(size) FROM Cache")
    assert 0 < held <= limit
    with diskcache.Cache(store) as cache:
        assert cache.check() == []


def test_kill9_restart_reuses_cache_and_clears_stale_mount(mountd_factory, synthetic_tree,
                                                           tmp_path):
    m = mountd_factory()
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    expected = tree_hashes(synthetic_tree.root)
    for p in expected:
        read_bytes(os.path.join(m.root, "syn", p))
    m.kill()
    with pytest.raises(OSError) as info:
        os.listdir(m.root)
    assert info.value.errno == errno.ENOTCONN  # the crash left a stale mount

    m2 = mountd_factory(cache_dir=m.cache_dir)  # same root and cache dir
    assert [d["name"] for d in m2.status()["datasets"]] == ["syn"]
    got = {p: hashlib.sha256(read_bytes(os.path.join(m2.root, "syn", p))).hexdigest()
           for p in expected}
    assert got == expected
    c = dataset_counters(m2, "syn")
    assert c["local_hits"] == len(expected) and c.get("bucket_fetches", 0) == 0


def test_corrupted_cache_file_is_detected_and_refetched(mountd_factory, synthetic_tree):
    m = mountd_factory()
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    expected = tree_hashes(synthetic_tree.root)
    for p in expected:
        read_bytes(os.path.join(m.root, "syn", p))
    assert m.stop() == 0
    value_files = sorted(os.path.join(d, f) for d, _, fs in
                         os.walk(os.path.join(m.cache_dir, "store")) for f in fs
                         if f.endswith(".val"))
    assert value_files
    with open(value_files[0], "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    # the read finds it: no scrubber first (tests/test_scrubber.py)
    m2 = mountd_factory(cache_dir=m.cache_dir, extra_args=("--scrub-mb-s", "0"))
    got = {p: hashlib.sha256(read_bytes(os.path.join(m2.root, "syn", p))).hexdigest()
           for p in expected}
    assert got == expected
    st = m2.status()
    assert st["cache"]["corrupt_dropped"] == 1
    assert dataset_counters(m2, "syn")["bucket_fetches"] == 1


def test_concurrent_readers_of_a_missing_item_cause_one_fetch(mountd_factory, synthetic_tree):
    m = mountd_factory()
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    target = os.path.join(m.root, "syn", sorted(tree_hashes(synthetic_tree.root))[0])
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda _: read_bytes(target), range(16)))
    assert len(set(results)) == 1
    assert dataset_counters(m, "syn")["bucket_fetches"] == 1


def test_prefetch_warms_the_whole_dataset(mountd_factory, synthetic_tree):
    m = mountd_factory()
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn", prefetch=True)
    import time
    deadline = time.monotonic() + 60
    while True:
        pf = next(d for d in m.status()["datasets"] if d["name"] == "syn").get("prefetch")
        if pf and pf["finished"]:
            break
        assert time.monotonic() < deadline, pf
        time.sleep(0.05)
    assert pf["done_items"] == pf["total_items"] == 40 and pf["failed"] == 0
    for p in tree_hashes(synthetic_tree.root):
        read_bytes(os.path.join(m.root, "syn", p))
    c = dataset_counters(m, "syn")
    assert c["local_hits"] == 40 and c["bucket_fetches"] == 40


def test_stat_and_readdir_need_no_backend(mountd_factory, synthetic_tree, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(synthetic_tree.root, src)
    m = mountd_factory()
    mount(m, make_digest(src, "syn"), "syn")
    shutil.rmtree(src)
    names = sorted(os.listdir(os.path.join(m.root, "syn")))
    assert len(names) == 10
    sizes = {os.path.relpath(os.path.join(d, f), m.root): os.path.getsize(os.path.join(d, f))
             for d, _, fs in os.walk(os.path.join(m.root, "syn")) for f in fs}
    assert len(sizes) == 40 and all(20_000 <= s <= 300_000 for s in sizes.values())
    assert dataset_counters(m, "syn").get("bucket_fetches", 0) == 0


def test_gcs_registration_by_a_user_must_bring_credentials(shared_workdir, mountd_factory,
                                                           synthetic_tree, upload,
                                                           gcs_emulator):
    uri = upload(synthetic_tree.root, "syn")
    data = make_digest(uri, "syn", gcs_emulator.host)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"),
                       extra_args=("--gcs-endpoint", gcs_emulator.host))
    os.chmod(m.cache_dir, 0o755)
    refused = call_as(1000, 1000, m.socket, {"op": "mount", "name": "theirs", "digest": data})
    assert not refused["ok"] and refused["code"] == 6 and "--credentials" in refused["error"]
    allowed = call_as(1000, 1000, m.socket, {"op": "mount", "name": "public", "digest": data,
                                             "anonymous": True,
                                             "emulator_host": gcs_emulator.host})
    assert allowed["ok"], allowed

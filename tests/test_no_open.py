"""Dataset files served without OPEN (mountd.fs.datasets_fs's no-open mode, by mountd's patched
pyfuse3): the patch is built and used, reads are exact under eviction and concurrency,
and the control area and views keep working on their own connection."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import signal
import subprocess
import time

import pyfuse3
import pytest

from mountd.fs.datasets_fs import no_open_available
from tests.mountd_helpers import (dataset_counters, make_digest, mount,  # noqa: F401
                                  mountd_factory, tree_hashes)

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


def _sha(path: str) -> str:
    with open(path, "rb", buffering=0) as f:
        return hashlib.sha256(f.read()).hexdigest()


def _drop_pages(paths: list[str]) -> None:
    """Drop the kernel's pages of these files of the mount: their next read reaches mountd."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def test_the_patched_pyfuse3_is_built_and_mountd_runs_without_opens(mountd_factory,
                                                                     synthetic_tree):
    # make's install step builds pyfuse3 with mountd/patches: without it this fails
    assert no_open_available() and pyfuse3.Operations.read_with_inode is False
    m = mountd_factory()
    assert m.status()["fuse_mode"] == "no-open"
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    root = os.path.join(m.root, "syn")
    expected = tree_hashes(synthetic_tree.root)
    assert {r: _sha(os.path.join(root, r)) for r in expected} == expected
    # the kernel answered every open itself after the first was refused with ENOSYS
    requests = m.status()["fuse_requests"]
    assert requests.get("open", 0) <= 1 and "release" not in requests


def test_an_evicted_item_is_fetched_again(mountd_factory, synthetic_tree):
    m = mountd_factory(cache_size="1M")  # the tree is several MB: most items are evicted
    mount(m, make_digest(synthetic_tree.root, "syn"), "syn")
    root = os.path.join(m.root, "syn")
    expected = tree_hashes(synthetic_tree.root)
    paths = [os.path.join(root, r) for r in sorted(expected)]
    for _ in range(2):
        assert {r: _sha(os.path.join(root, r)) for r in expected} == expected
        _drop_pages(paths)  # the second pass must come to mountd, whose store is small
    c = dataset_counters(m, "syn")
    assert c["bucket_fetches"] > len(expected)  # evicted items were fetched again
    assert c["misses"] == c["bucket_fetches"]
    assert m.status()["cache"]["used_bytes"] <= 1 << 20


def test_concurrent_readers_of_one_inode_each_get_its_bytes(mountd_factory, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    # several READs per file (the kernel reads at most 1 MiB at once); one item cached
    files = {f"big{i}.bin": os.urandom(3_000_000 + 4096 * i + 7) for i in range(3)}
    for name, data in files.items():
        (src / name).write_bytes(data)
    expected = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    m = mountd_factory()
    mount(m, make_digest(str(src), "big"), "big")
    paths = {name: os.path.join(m.root, "big", name) for name in files}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        for _ in range(4):  # the first round misses, the others hit the store
            jobs = [(name, pool.submit(_sha, path)) for name, path in paths.items()
                    for _ in range(8)]
            assert all(job.result() == expected[name] for name, job in jobs)
            _drop_pages(list(paths.values()))
    c = dataset_counters(m, "big")
    assert c["bucket_fetches"] == len(files)  # concurrent misses shared one fetch each


def test_the_control_area_and_views_are_their_own_mount(mountd_factory, digits_tree):
    m = mountd_factory()
    mount(m, make_digest(digits_tree.root, "digits"), "view", view="substitutable")
    control = os.path.join(m.root, ".quiver")
    assert os.path.ismount(control)
    assert sorted(os.listdir(control)) == ["jobs", "views"]
    assert os.readlink(os.path.join(m.root, "view")) == os.path.join(".quiver", "views", "view")
    assert sorted(os.listdir(os.path.join(m.root, "view"))) == sorted(
        os.listdir(digits_tree.root))
    with pytest.raises(OSError):  # the datasets' mount is read-only
        open(os.path.join(m.root, "new"), "wb")


def test_the_control_mount_comes_back_when_its_process_dies(mountd_factory):
    m = mountd_factory()
    control = os.path.join(m.root, ".quiver")
    found = subprocess.run(["pgrep", "-f",  # its mount point, then --forward or nothing
                            f"mountd.fs.control_mount_process [0-9]+ {control}( |$)"],
                           capture_output=True, text=True, check=True)
    (pid,) = found.stdout.split()
    os.kill(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while True:  # mountd detaches the dead mount and mounts it again
        try:
            os.mkdir(os.path.join(control, "jobs", "after"))
            break
        except OSError:
            assert time.monotonic() < deadline, m.log_tail(20)
            time.sleep(0.2)
    assert os.listdir(os.path.join(control, "jobs")) == ["after"]
    assert "mounting it again" in m.log_tail(50)
    assert m.status()["fuse_mode"] == "no-open"  # and the datasets' mount served on

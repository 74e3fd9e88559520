"""Planned items pushed into the kernel's page cache (mountd.fetch.page_push), through a real
mount: every byte read is the item's, while chunk eviction, store culling and probes'
page drops race with the pushes, and the unread pushed bytes stay within their bound."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading

import pytest

from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

PUSH_MEMORY = 16 << 10  # bytes: about 40 of the digits' items


def _sha(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _run_job(root: str, seed: int, epochs: int, pool: concurrent.futures.Executor) -> int:
    """Read every batch's files as the manifests name them; check each one's hash.
    Returns the items read."""
    sampler = QuiverBatchSampler(root, 32, seed=seed)
    read = 0
    try:
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            seen: list[str] = []
            for b in range(len(sampler)):
                m = sampler.manifest(b)
                paths = [os.path.join(root, p) for p in m.paths]
                assert list(pool.map(_sha, paths)) == m.hashes, (epoch, b)
                seen += m.paths
            assert len(seen) == len(set(seen)) == 1797  # exactly once per epoch
            read += len(seen)
    finally:
        sampler.close()
    return read


@pytest.mark.parametrize("mode", ["open", "no-open"])
def test_pushed_pages_hold_each_items_bytes_within_the_bound(mountd_factory, digits_tree,
                                                            mode):
    # a cache of 100K holds a few chunks of the 220K digits: chunks load and are
    # evicted, and the store culls, while two jobs' planned hits are pushed; a push
    # stops counting when its file is opened, or (no OPEN) when its job has moved past it
    opens = ("--fuse-opens",) if mode == "open" else ()
    m = mountd_factory(cache_size="100K", extra_args=("--push-memory", str(PUSH_MEMORY),
                                                      "--chunk-size", "20K", *opens))
    assert m.status()["fuse_mode"] == mode
    mount(m, make_digest(digits_tree.root, "digits"), "digits")
    root = os.path.join(m.root, "digits")
    for _ in os.walk(root):  # as ImageFolder does: the kernel learns every inode
        pass
    held: list[int] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            push = m.status()["push"]
            assert push["budget"] == PUSH_MEMORY
            held.append(push["held"])
            done.wait(0.02)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        watcher = pool.submit(watch)
        jobs = [pool.submit(_run_job, root, seed, 3, pool) for seed in (1, 2)]
        try:
            assert [j.result(timeout=300) for j in jobs] == [3 * 1797] * 2
        finally:
            done.set()
        watcher.result()
    st = m.status()
    c = st["counters"]
    assert c["pushed"] > 0 and c["pushed_opens" if opens else "pushed_passed"] > 0, c
    assert max(held) <= PUSH_MEMORY and len(held) > 10
    assert st["cache"]["used_bytes"] <= 100 << 10


def test_bad_push_memory_is_one_line(quiver, tmp_path):
    r = quiver("mountd", "--root", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
               "--cache-size", "1G", "--foreground", "--push-memory", "-5")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        "quiver: error: invalid --push-memory '-5': use a number with an optional K, M, "
        "G or T suffix, e.g. 20G"]
    config = tmp_path / "quiver.toml"
    config.write_text('[mountd]\npush-memory = "lots"\n', encoding="utf-8")
    r = quiver("--config", str(config), "mountd", "--root", str(tmp_path), "--cache-dir",
               str(tmp_path / "c"), "--cache-size", "1G", "--foreground")
    assert r.returncode == 10 and len(r.stderr.strip().splitlines()) == 1
    assert "[mountd] push-memory: " in r.stderr
    assert not (tmp_path / "c").exists()  # refused before anything was made

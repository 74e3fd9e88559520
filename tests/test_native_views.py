"""The substitutable view's cached opens served by the native data plane on the
``.quiver`` connection (mountd/native/view.c, mountd.fs.native_views): real mountd, real
readers. ``make sanitize`` runs these under ASan and UBSan too."""
from __future__ import annotations

import collections
import hashlib
import json
import os
import subprocess
import sys
import time

import pytest

from quiverfs import digest as digest_format
from quiverfs.bench.processes import MountdProcess
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401
from tests.test_view import SERVED_HASH, SERVED_PATH, control_requests, digest_hashes

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


def cached_view(m: MountdProcess, digits_tree) -> tuple[digest_format.Digest, str]:
    """The digits mounted exactly and as the view ``digits``, every item cached (read
    through the exact mount); the digest and the view's root."""
    data = make_digest(digits_tree.root, "digits")
    mount(m, data, "exact")
    mount(m, data, "digits", view="substitutable")
    d = digest_format.decode(data)
    for i in range(len(d)):
        with open(os.path.join(m.root, "exact", d.path(i)), "rb") as f:
            f.read()
    return d, os.path.join(m.root, "digits")


def native_counters(m: MountdProcess) -> collections.Counter[str]:
    return collections.Counter(m.status()["native"])


def test_a_cached_view_pass_is_opened_read_and_released_by_the_native_plane(
        mountd_factory, digits_tree):
    """Every item cached, a plain reader's passes (open, fstat, read to the end,
    fgetxattr, close) over the view are served by the native plane on the ``.quiver``
    connection, but for the first open, through which mountd learns the reader's job:
    each open takes the next hit mountd queued for the job, or where the job's queue of
    that pool is empty, waits there for mountd to queue more; mountd sees an OPEN only
    where it declines such a wait, and no READ; the process serving the connection
    sees a few requests a folder, not each path's GETATTR. The reader still gets every
    item once a pass, each whole and of its path's folder; fstat says its size, and
    the extended attributes name it."""
    m = mountd_factory()
    d, root = cached_view(m, digits_tree)
    paths = sorted(d.path(i) for i in range(len(d)))
    by_path = {d.path(i): d.hash(i).hex() for i in range(len(d))}

    def read_pass() -> collections.Counter[str]:
        served: collections.Counter[str] = collections.Counter()
        for rel in paths:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
                assert os.fstat(f.fileno()).st_size == len(data)
                sha = hashlib.sha256(data).hexdigest()
                assert os.getxattr(f.fileno(), SERVED_HASH).decode() == sha
                served_path = os.getxattr(f.fileno(), SERVED_PATH).decode()
            assert by_path[served_path] == sha
            assert os.path.dirname(served_path) == os.path.dirname(rel)
            served[sha] += 1
        return served

    def hits() -> int:
        return sum(j["counters"].get("hits", 0) for j in m.status()["view_jobs"])

    before, native_before = control_requests(m), native_counters(m)
    assert read_pass() == digest_hashes(d)  # the first looks the names up
    got, native = control_requests(m) - before, native_counters(m) - native_before
    # the plane knows the job from its first open through mountd on: an open that
    # finds the job's queue of its pool empty waits there for mountd to queue the
    # pass's next items, and goes to mountd only where mountd declines
    assert native["view_waits"] > 0
    assert got["open"] == 1 + native["view_declined"], (got, native)
    assert got["open"] + native["view_opens"] == len(d)
    before, native_before, hits_before = control_requests(m), native_counters(m), hits()
    assert read_pass() == digest_hashes(d)
    assert hits() - hits_before == len(d)
    got, native = control_requests(m) - before, native_counters(m) - native_before
    assert got["open"] + native["view_opens"] == len(d)
    assert got["open"] == native["view_declined"], (got, native)
    assert native["view_releases"] == native["view_opens"]
    assert native["view_reads"] >= native["view_opens"]
    assert got["read"] == 0
    # the kernel's GETATTR of each path before its open (its permission check), and
    # the ioctl of open()'s isatty(), are the plane's too: what reaches the connection's
    # process is the two fgetxattr calls a file, and a few requests a folder
    assert native["view_forwarded"] - 2 * len(d) < len(d) // 10, native


def test_a_reader_that_changes_process_group_is_another_job_in_the_plane_too(
        mountd_factory, digits_tree):
    """The plane serves a process's opens for the job mountd recognised it as only
    while the process stays in that process group, as mountd's own rule: a reader that
    moves to a group of its own (``setpgid``) halfway through is a new job, which is
    served every item of the pass again; the first job got what it opened before."""
    m = mountd_factory()
    d, root = cached_view(m, digits_tree)
    paths = sorted(d.path(i) for i in range(len(d)))
    script = f"""
import hashlib, json, os, sys
root, paths = {root!r}, {paths!r}
out = []
def read(rel):
    with open(os.path.join(root, rel), "rb") as f:
        data = f.read()
        out.append((os.getpgid(0), hashlib.sha256(data).hexdigest()))
for rel in paths:
    read(rel)
os.setpgid(0, 0)
for rel in paths:
    read(rel)
print(json.dumps(out))
"""
    native_before = native_counters(m)
    # in this process's group first (a session leader could not move)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, timeout=300)
    out = json.loads(run.stdout)
    first_group, second_group = out[0][0], out[-1][0]
    assert first_group != second_group
    assert collections.Counter(sha for g, sha in out if g == first_group) == digest_hashes(d)
    assert collections.Counter(sha for g, sha in out if g == second_group) == digest_hashes(d)
    jobs = {j["identity"]: j["counters"] for j in m.status()["view_jobs"]}
    assert jobs[f"pgid:{first_group}"]["opens"] == len(d)
    assert jobs[f"pgid:{second_group}"]["opens"] == len(d)
    assert (native_counters(m) - native_before)["view_opens"] > len(d)  # both, natively


def test_items_queued_in_the_plane_and_dropped_from_the_store_are_fetched_again(
        mountd_factory, digits_tree):
    """A reader's job has hits queued in the native plane when every value file goes
    from the store behind mountd's back: the plane gives those items back, and mountd
    chooses them for the job anew, misses fetched again. The pass still gets every item
    once, each its own bytes."""
    m = mountd_factory()
    d, root = cached_view(m, digits_tree)
    paths = sorted(d.path(i) for i in range(len(d)))
    by_path = {d.path(i): d.hash(i).hex() for i in range(len(d))}
    served: collections.Counter[str] = collections.Counter()

    def read(rel: str) -> None:
        with open(os.path.join(root, rel), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
            served_path = os.getxattr(f.fileno(), SERVED_PATH).decode()
        assert by_path[served_path] == sha
        served[sha] += 1

    for rel in paths:  # a first pass: mountd learns what is cached
        read(rel)
    assert served == digest_hashes(d)
    served.clear()
    read(paths[0])  # a second: the job's next hits of that folder go to the plane
    deadline = time.monotonic() + 30
    while not m.status()["view_jobs"][0]["queued_natively"]:
        assert time.monotonic() < deadline, "no hit was queued in the native plane"
        time.sleep(0.02)
    store = os.path.join(m.cache_dir, "store")
    for dirpath, _, files in os.walk(store):
        for name in files:
            if name.endswith(".val"):
                os.unlink(os.path.join(dirpath, name))
    native_before = native_counters(m)
    for rel in paths[1:]:
        read(rel)
    assert served == digest_hashes(d)
    assert (native_counters(m) - native_before)["view_returned"] > 0

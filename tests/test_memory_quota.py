"""Memory that registrations take, bounded per uid and in total, with identical digests
shared (docs/security.md, "Memory").

The quota tests run a real mountd with small limits and register through the real
``quiver`` CLI as other users (uid 1000 and nobody), so each takes seconds. The estimate
tests build real digests, trees and pools and measure them with tracemalloc.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tracemalloc

import msgpack
import pytest

from mountd.datasets.memory_budget import DigestCost, digest_cost
from mountd.datasets.pools import ViewPools
from mountd.datasets.tree import DatasetTree
from quiverfs import digest as digest_format
from quiverfs.digest_checks import decode_peak
from quiverfs.sizes import human
from tests.conftest import CLI_TIMEOUT
from tests.mountd_helpers import mountd_factory  # noqa: F401

needs_mount = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                 reason="needs root and /dev/fuse")

USER, NOBODY = 1000, 65534
ENTRIES = 20_000  # a digest of about 2 MB that costs about 7 MB in memory
BLOB = bytes(range(256)) * 16  # every item is one byte of this file


# -- helpers --------------------------------------------------------------------------
def owned_dir(parent: str, name: str, uid: int) -> str:
    path = os.path.join(parent, name)
    os.mkdir(path)
    os.chown(path, uid, uid)
    return path


def write_owned(path: str, data: bytes, uid: int) -> str:
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, uid, uid)
    return path


def blob_digest(src: str, name: str) -> bytes:
    """ENTRIES one-byte items of ``src``/blob in 20 class folders; its bytes differ by
    ``name`` only, so digests of names of one length cost the same."""
    items = [digest_format.NewItem(path=f"c{i % 20:02d}/i{i:06d}",
                                   digest=hashlib.sha256(BLOB[i % len(BLOB):][:1]).digest(),
                                   size=1, key="blob", offset=i % len(BLOB))
             for i in range(ENTRIES)]
    return digest_format.encode(name, "file://" + src, items)


def cost_of(data: bytes) -> DigestCost:
    return digest_cost(digest_format.decode(data))


class Quiver:
    """The real ``quiver`` CLI of one mountd, run as a given uid."""

    def __init__(self, m) -> None:
        self.m = m

    def run(self, uid: int, *args: str) -> subprocess.CompletedProcess:
        prefix = () if uid == 0 else ("setpriv", f"--reuid={uid}", f"--regid={uid}",
                                      "--clear-groups", "--")
        return subprocess.run([*prefix, sys.executable, "-m", "quiverfs.cli", *args,
                               "--root", self.m.root, "--control-socket", self.m.socket],
                              capture_output=True, text=True, timeout=CLI_TIMEOUT,
                              stdin=subprocess.DEVNULL)

    def mount(self, uid: int, digest_path: str, name: str,
              *more: str) -> subprocess.CompletedProcess:
        return self.run(uid, "mount", digest_path, "--name", name, *more)

    def memory(self, uid: int) -> dict:
        done = self.run(uid, "status", "--json")
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)["memory"]


@pytest.fixture
def setup(shared_workdir, mountd_factory):  # noqa: F811
    """``start(per_user, total)``: a mountd with those limits, the CLI to reach it, and
    digests of 20,000 items that uid 1000 and nobody may register: ``digests[uid][k]``."""
    digests: dict[int, list[str]] = {}
    for uid in (USER, NOBODY):
        home = owned_dir(shared_workdir, f"u{uid:05d}", uid)
        write_owned(os.path.join(home, "blob"), BLOB, uid)
        digests[uid] = [write_owned(os.path.join(home, f"d{k}.qd"),
                                    blob_digest(home, f"u{uid:05d}-d{k}"), uid) for k in range(3)]

    def start(per_user: int, total: int) -> Quiver:
        m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"),
                           extra_args=("--memory-per-user", str(per_user),
                                       "--memory-total", str(total)))
        os.chmod(m.cache_dir, 0o755)  # the control socket lives there
        return Quiver(m)

    return start, digests


def one_cost(digests: dict[int, list[str]]) -> DigestCost:
    """What each of the test's digests costs (they all cost the same)."""
    with open(digests[USER][0], "rb") as f:
        return cost_of(f.read())


def refusal(done: subprocess.CompletedProcess) -> str:
    """The one line a refused command printed, checked to be exit 6 and one line."""
    assert done.returncode == 6, (done.returncode, done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


# -- quotas against a real mountd -----------------------------------------------------
@needs_mount
def test_many_digests_of_one_uid_stop_at_its_quota(setup):
    start, digests = setup
    cost = one_cost(digests).digest
    q = start(per_user=cost * 5 // 2, total=1 << 30)
    for k in range(2):
        done = q.mount(USER, digests[USER][k], f"m{k}")
        assert done.returncode == 0, done.stderr
    assert q.memory(USER)["uid_in_use"] == 2 * cost

    line = refusal(q.mount(USER, digests[USER][2], "m2"))
    assert f"uid {USER}'s registrations would take" in line and "--memory-per-user" in line
    assert "'quiver umount' a dataset first" in line
    state = os.path.join(q.m.cache_dir, "state", "digests")
    assert len(os.listdir(state)) == 2  # the refused digest left nothing on disk
    assert q.memory(USER)["uid_in_use"] == 2 * cost
    # another uid has a quota of its own
    assert q.mount(NOBODY, digests[NOBODY][0], "n0").returncode == 0
    # what an unmount frees can be registered again
    assert q.run(USER, "umount", "m0").returncode == 0
    assert q.mount(USER, digests[USER][2], "m2").returncode == 0
    assert q.memory(USER)["uid_in_use"] == 2 * cost


@needs_mount
def test_the_same_digest_again_shares_one_copy(setup):
    start, digests = setup
    cost = one_cost(digests)
    q = start(per_user=cost.digest * 3 // 2, total=1 << 30)
    path = digests[USER][0]
    for name in ("a", "b", "c"):  # more than the quota would allow as separate copies
        done = q.mount(USER, path, name)
        assert done.returncode == 0, done.stderr
        memory = q.memory(USER)
        assert (memory["uid_in_use"], memory["in_use"]) == (cost.digest, cost.digest)
    # root's registration of it shares the copy too: charged to root, not to the total
    assert q.mount(0, path, "roots").returncode == 0
    assert q.memory(0)["uid_in_use"] == q.memory(0)["in_use"] == cost.digest
    # a substitutable view of it adds its pools only
    assert q.mount(USER, path, "any", "--view", "substitutable").returncode == 0
    assert q.memory(USER)["uid_in_use"] == cost.digest + cost.pools

    for name in ("a", "c", "any"):
        assert q.run(USER, "umount", name).returncode == 0
    assert q.memory(USER)["uid_in_use"] == cost.digest
    wanted = {f"c{i % 20:02d}/i{i:06d}": BLOB[i % len(BLOB)] for i in (0, 777, ENTRIES - 1)}
    got = read_as(USER, [os.path.join(q.m.root, "b", p) for p in wanted])
    assert got == [bytes([b]).hex() for b in wanted.values()]


@needs_mount
def test_the_total_cap_holds_across_uids(setup):
    start, digests = setup
    cost = one_cost(digests).digest
    q = start(per_user=cost * 5 // 2, total=cost * 7 // 2)
    assert q.mount(USER, digests[USER][0], "m0").returncode == 0
    assert q.mount(USER, digests[USER][1], "m1").returncode == 0
    assert q.mount(NOBODY, digests[NOBODY][0], "n0").returncode == 0

    line = refusal(q.mount(NOBODY, digests[NOBODY][1], "n1"))  # within nobody's own quota
    assert "all users' registrations would take" in line and "--memory-total" in line
    line = refusal(q.mount(0, digests[NOBODY][1], "r1"))  # root counts toward the total
    assert "--memory-total" in line
    assert q.mount(0, digests[USER][0], "r0").returncode == 0  # a shared copy costs nothing
    assert q.memory(0)["in_use"] == 3 * cost
    status = q.run(NOBODY, "status")
    assert status.returncode == 0, status.stderr
    assert f"memory of registrations: uid {NOBODY} " in status.stdout
    assert f"all users {human(3 * cost)} of {human(cost * 7 // 2)}" in status.stdout


@needs_mount
def test_a_digest_too_big_to_decode_is_refused_before_decoding(setup, shared_workdir):
    start, digests = setup
    q = start(per_user=1 << 30, total=64 << 20)
    with open(digests[USER][0], "rb") as f:
        data = f.read()
    bomb = write_owned(os.path.join(shared_workdir, f"u{USER:05d}", "bomb.qd"),
                       with_junk_header(data, 1 << 20), USER)  # 1 MiB of empty maps
    line = refusal(q.mount(USER, bomb, "bomb"))
    assert "decoding this digest" in line and "--memory-total" in line
    assert q.mount(USER, digests[USER][0], "fine").returncode == 0


@needs_mount
def test_restored_registrations_share_and_outlive_a_lowered_quota(setup):
    start, digests = setup
    cost = one_cost(digests).digest
    q = start(per_user=3 * cost, total=1 << 30)
    for name, k in (("a", 0), ("a2", 0), ("b", 1)):
        assert q.mount(USER, digests[USER][k], name).returncode == 0
    assert q.m.stop() == 0

    q = start(per_user=cost, total=1 << 30)  # below what uid 1000 already holds
    assert sorted(d["name"] for d in q.m.status()["datasets"]) == ["a", "a2", "b"]
    assert q.memory(USER)["uid_in_use"] == 2 * cost  # a and a2 restored on one copy
    assert f"uids over their {cost}-byte limit: [{USER}]" in q.m.log_tail(50)
    line = refusal(q.mount(USER, digests[USER][2], "c"))
    assert "--memory-per-user" in line


def read_as(uid: int, paths: list[str]) -> list[str | int]:
    """Each file's bytes (hex), or the errno its read failed with, read as ``uid``."""
    script = ("import json, sys\nout = []\nfor p in sys.argv[1:]:\n"
              "    try:\n        out.append(open(p, 'rb').read().hex())\n"
              "    except OSError as exc:\n        out.append(exc.errno)\n"
              "print(json.dumps(out))")
    done = subprocess.run(["/usr/bin/python3", "-c", script, *paths], user=uid, group=uid,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def with_junk_header(data: bytes, junk: int) -> bytes:
    """``data`` with ``junk`` empty maps under an unknown header key (which decode
    ignores, after msgpack has made them into 72-byte objects each)."""
    header_len = int.from_bytes(data[10:14], "little")
    header = msgpack.unpackb(data[46:46 + header_len])
    header["junk"] = [{}] * junk
    packed = msgpack.packb(header, use_bin_type=True)
    body = packed + data[46 + header_len:]
    return (data[:10] + len(packed).to_bytes(4, "little") + hashlib.sha256(body).digest()
            + body)


# -- the estimate against what is built -----------------------------------------------
def shapes() -> dict[str, list[digest_format.NewItem]]:
    """Digests of 5,000 items shaped to cost the most per byte, and a common one."""
    h = hashlib.sha256(b"x").digest()
    n = 5000

    def items(paths: list[str]) -> list[digest_format.NewItem]:
        return [digest_format.NewItem(path=p, digest=h, size=1) for p in paths]

    return {
        "imagefolder": items([f"n{i // 50:08d}/n{i // 50:08d}_{i:08d}.JPEG" for i in range(n)]),
        "one folder": items([f"{i:x}" for i in range(n)]),
        "a folder per item": items([f"{i:x}/f.{i % 7}" for i in range(n)]),
        "2000 levels deep": items([f"x{i}/" + "a/" * 2000 + "f" for i in range(10)]),
        "wide characters": items([f"\U0001F600{i // 50}/{'a' * 40}\U0001F600{i}"
                                  for i in range(n)]),
        "long names": items([f"c{i // 50}/" + f"{i:x}".rjust(250, "z") for i in range(n)]),
        "object keys": [digest_format.NewItem(path=f"k/{i:x}", digest=h, size=1,
                                              key=f"pack{i:x}", offset=i) for i in range(n)],
    }


@pytest.mark.parametrize("shape", list(shapes()))
def test_the_estimate_covers_what_a_copy_holds(shape):
    data = digest_format.encode("shape", "file:///data", shapes()[shape])
    tracemalloc.start()
    try:
        digest = digest_format.decode(data)
        tree = DatasetTree(digest)
        with_tree, _ = tracemalloc.get_traced_memory()
        pools = ViewPools.of(digest)
        with_pools, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    cost = digest_cost(digest)
    held = len(data) + with_tree  # the columns are views of the digest file's bytes
    assert held <= cost.digest, (held, cost)
    assert with_pools - with_tree <= cost.digest + cost.pools - held, (with_pools, cost)
    if shape == "imagefolder":  # not so far over that honest users are refused
        assert cost.digest < 1.5 * held
    assert tree.n_dirs == digest.n_dirs and pools.members


@pytest.mark.parametrize("shape", ["2000 levels deep", "a folder per item", "junk header"])
def test_decoding_stays_within_its_bound(shape):
    if shape == "junk header":
        data = with_junk_header(digest_format.encode("j", "file:///data",
                                                     shapes()["imagefolder"]), 100_000)
    else:
        data = digest_format.encode("shape", "file:///data", shapes()[shape])
    tracemalloc.start()
    try:
        digest = digest_format.decode(data)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # paths 2000 levels deep once took 1000 times their digest's size to check
    assert peak <= decode_peak(data), (peak, len(data))
    assert len(digest) and digest.n_dirs > 1

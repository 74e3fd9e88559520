"""A local user attacking a root mountd through ``file://`` registrations.

Each test is a real attack against a real mount: the attacker is uid 1000, the files
it must not reach belong to root.
"""
from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import shutil
import subprocess
import time

import pytest

from mountd.control.controller import MAX_ITEM_BYTES
from mountd.control.quotas import MAX_DATASETS_PER_USER
from mountd.fetch.integrity_budget import MAX_INTEGRITY_FAILURES_PER_USER
from mountd.fs.datasets_fs import FAILED_HOLD
from quiverfs import control_client
from quiverfs import digest as digest_format
from quiverfs.mount_point import mount_device
from tests.mountd_helpers import (call_as, dataset_counters, make_digest,  # noqa: F401
                                  mountd_factory, run_as)
from tests.test_content_store import value_files

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                reason="needs root and /dev/fuse")

ATTACKER = 1000
NOBODY = 65534
SECRET = b"TOPSECRET-root-only"
# Reads files as the calling user and prints, as JSON, what each read returned
# (hex) or the errno it failed with. The system Python: the attacker needs no venv.
READ_ALL = """
import json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        with open(path, "rb") as f:
            out[path] = f.read().hex()
    except OSError as exc:
        out[path] = exc.errno
print(json.dumps(out))
"""


def attacker_dir(shared_workdir: str) -> str:
    d = os.path.join(shared_workdir, "attacker")
    os.mkdir(d)
    os.chown(d, ATTACKER, ATTACKER)
    return d


def root_secret(shared_workdir: str) -> str:
    path = os.path.join(shared_workdir, "secret")
    with open(path, "wb") as f:
        f.write(SECRET)
    os.chmod(path, 0o600)
    return path


def attacker_file(directory: str, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    os.chown(path, ATTACKER, ATTACKER)
    return path


def read_as(uid: int, paths: list[str]) -> dict[str, str | int]:
    done = subprocess.run(["/usr/bin/python3", "-c", READ_ALL, *paths], user=uid,
                          group=uid, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def read_as_attacker(paths: list[str]) -> dict[str, str | int]:
    return read_as(ATTACKER, paths)


def byte_oracle_digest(directory: str, key: str, offsets: int) -> bytes:
    """One-byte items at offsets 0..offsets-1 of ``key``, each under all 256 hashes: a
    read that succeeds confirms the byte at that offset."""
    items = [digest_format.NewItem(path=f"o{off}/b{b:03d}",
                                   digest=hashlib.sha256(bytes([b])).digest(), size=1,
                                   key=key, offset=off)
             for off in range(offsets) for b in range(256)]
    return digest_format.encode("oracle", "file://" + directory, items)


def start_shared_mountd(factory, shared_workdir: str):
    m = factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"))
    os.chmod(m.cache_dir, 0o755)  # the control socket lives there
    return m


def test_symlink_swap_after_registration_confirms_no_byte(shared_workdir, mountd_factory):
    secret = root_secret(shared_workdir)
    mine = attacker_dir(shared_workdir)
    attacker_file(mine, "f", b"\x00" * 8)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    reply = call_as(ATTACKER, ATTACKER, m.socket, {
        "op": "mount", "name": "oracle", "digest": byte_oracle_digest(mine, "f", 4)})
    assert reply["ok"], reply
    base = os.path.join(m.root, "oracle")
    # an honest read first: the registration works while the file is the attacker's
    assert read_as_attacker([f"{base}/o0/b000"]) == {f"{base}/o0/b000": "00"}

    os.unlink(os.path.join(mine, "f"))
    os.symlink(secret, os.path.join(mine, "f"))
    os.lchown(os.path.join(mine, "f"), ATTACKER, ATTACKER)
    paths = [f"{base}/o{off}/b{b:03d}" for off in range(4) for b in range(256)]
    got = read_as_attacker(paths)

    served = {p: v for p, v in got.items() if isinstance(v, str)}
    # only the zero byte read before the swap is served (from the cache, by its hash)
    assert served == {f"{base}/o{off}/b000": "00" for off in range(4)}
    assert all(v == 5 for p, v in got.items() if p not in served)  # EIO, nothing confirmed
    counters = dataset_counters(m, "oracle")
    assert counters.get("integrity_failures", 0) == 0  # the secret was never even read
    assert counters["bucket_errors"] == len(paths) - len(served)
    assert m.status()["cache"]["items"] == 1
    assert "not readable (permission denied)" in m.log_tail(5)


def test_registration_of_a_root_only_file_is_refused_and_leaves_nothing(shared_workdir,
                                                                       mountd_factory):
    secret = root_secret(shared_workdir)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    digests_dir = os.path.join(m.cache_dir, "state", "digests")
    data = byte_oracle_digest(os.path.dirname(secret), os.path.basename(secret), 1)
    reply = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "steal",
                                                   "digest": data})
    assert not reply["ok"] and reply["code"] == 6
    assert "cannot read" in reply["error"] and "Permission denied" in reply["error"]
    assert os.listdir(digests_dir) == []
    assert m.status()["datasets"] == []


def test_fifo_swapped_in_fails_one_read_without_blocking_the_daemon(shared_workdir, mountd_factory):
    mine = attacker_dir(shared_workdir)
    src = os.path.join(mine, "data")
    os.mkdir(src)
    os.chown(src, ATTACKER, ATTACKER)
    for name in ("a", "b"):
        attacker_file(src, f"{name}.bin", name.encode() * 1000)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    reply = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "mine",
                                                   "digest": make_digest(src, "mine")})
    assert reply["ok"], reply
    os.unlink(os.path.join(src, "a.bin"))
    os.mkfifo(os.path.join(src, "a.bin"))
    os.chown(os.path.join(src, "a.bin"), ATTACKER, ATTACKER)
    base = os.path.join(m.root, "mine")
    # a blocking open of the FIFO would hang a worker per read until none were left
    paths = [f"{base}/a.bin"] * 20 + [f"{base}/b.bin"]
    got = read_as_attacker(paths)
    assert got == {f"{base}/a.bin": 5, f"{base}/b.bin": (b"b" * 1000).hex()}


def test_permissions_taken_away_after_registration_apply_to_the_next_read(shared_workdir,
                                                                         mountd_factory):
    src = os.path.join(shared_workdir, "shared-data")  # root's, readable by all for now
    os.mkdir(src)
    for name in ("a", "b"):
        with open(os.path.join(src, f"{name}.bin"), "wb") as f:
            f.write(name.encode() * 1000)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    reply = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "lent",
                                                   "digest": make_digest(src, "lent")})
    assert reply["ok"], reply
    os.chmod(os.path.join(src, "b.bin"), 0o600)
    base = os.path.join(m.root, "lent")
    got = read_as_attacker([f"{base}/a.bin", f"{base}/b.bin"])
    assert got == {f"{base}/a.bin": (b"a" * 1000).hex(), f"{base}/b.bin": 5}


def test_registrations_per_user_are_bounded(shared_workdir, mountd_factory):
    mine = attacker_dir(shared_workdir)
    src = os.path.join(mine, "one")
    os.mkdir(src)
    os.chown(src, ATTACKER, ATTACKER)
    attacker_file(src, "x.bin", b"x")
    data = make_digest(src, "one")
    m = start_shared_mountd(mountd_factory, shared_workdir)
    for i in range(MAX_DATASETS_PER_USER):
        reply = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": f"d{i}",
                                                       "digest": data})
        assert reply["ok"], (i, reply)
    refused = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "one-more",
                                                     "digest": data})
    assert not refused["ok"] and refused["code"] == 6 and "umount" in refused["error"]
    # root is not bounded, and the digests dir holds the one shared digest
    assert m.call({"op": "mount", "name": "roots", "digest": data})["path"]
    assert os.listdir(os.path.join(m.cache_dir, "state", "digests")) == [
        f"{digest_format.decode(data).identity}.qd"]


def test_one_digest_under_many_names_counts_once_toward_a_users_digest_bytes(
        shared_workdir, mountd_factory):
    """The state directory keeps a digest once, by identity, however many names it is
    registered under: so it counts once toward the uid's bytes of digests (before, once
    per name: a third name of it was refused here)."""
    mine = attacker_dir(shared_workdir)
    digests = []
    for name in ("one", "two", "three"):
        src = os.path.join(mine, name)
        os.mkdir(src)
        os.chown(src, ATTACKER, ATTACKER)
        attacker_file(src, "x.bin", name.encode())
        digests.append(make_digest(src, name))
    limit = len(digests[0]) + len(digests[1])  # two of them, not three
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"),
                       extra_args=("--digest-bytes-per-user", str(limit)))
    os.chmod(m.cache_dir, 0o755)  # the control socket lives there

    def register(name: str, data: bytes) -> dict:
        return call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": name,
                                                      "digest": data})

    for i in range(4):
        reply = register(f"one-{i}", digests[0])
        assert reply["ok"], (i, reply)
    assert register("two", digests[1])["ok"]
    refused = register("three", digests[2])
    assert not refused["ok"] and refused["code"] == 6, refused
    assert refused["error"] == (f"uid {ATTACKER}'s digests would take "
                                f"{limit + len(digests[2])} bytes, over the {limit}-byte "
                                "limit: 'quiver umount' a dataset first")
    assert sorted(os.listdir(os.path.join(m.cache_dir, "state", "digests"))) == sorted(
        f"{digest_format.decode(d).identity}.qd" for d in digests[:2])
    assert m.call({"op": "mount", "name": "roots", "digest": digests[2]})["path"]


def start_job(mountpoint: str, job: str, dataset: str) -> None:
    """Configure a job reading ``dataset``'s one item (c0/x.bin) under ROOT/.quiver."""
    path = os.path.join(mountpoint, ".quiver", "jobs", job)
    os.mkdir(path)
    for name, data in (("paths", b"c0/x.bin\n"),
                       ("config", json.dumps({"dataset": dataset, "batch_size": 1,
                                              "paths": 1}).encode())):
        fd = os.open(os.path.join(path, name), os.O_WRONLY)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)


def test_cluster_status_shows_a_user_only_their_own_datasets_cycles(shared_workdir,
                                                                     mountd_factory):
    """Two users' jobs make chunk cycles of their datasets; ``quiver status --cluster``
    shows each user the cycle of their own (before, both: another user's digest
    identity, chunk count and states), and root both."""
    m = start_shared_mountd(mountd_factory, shared_workdir)
    identities = {}
    for uid in (ATTACKER, NOBODY):
        src = os.path.join(shared_workdir, f"src{uid}", "c0")
        os.makedirs(src)
        with open(os.path.join(src, "x.bin"), "wb") as f:
            f.write(f"uid {uid}'s item".encode())
        for d in (src, os.path.dirname(src)):
            os.chown(d, uid, uid)
        os.chown(os.path.join(src, "x.bin"), uid, uid)
        data = make_digest(os.path.dirname(src), f"ds{uid}")
        identities[uid] = digest_format.decode(data).identity
        reply = call_as(uid, uid, m.socket, {"op": "mount", "name": f"ds{uid}", "digest": data})
        assert reply["ok"], reply
        run_as(uid, uid, functools.partial(start_job, m.root, f"job{uid}", f"ds{uid}"))

    deadline = time.monotonic() + 60
    while set(m.call({"op": "cluster"})["cycles"]) != set(identities.values()):
        assert time.monotonic() < deadline, m.call({"op": "cluster"})["cycles"]
        time.sleep(0.1)

    def cycles_seen() -> list[str]:
        return sorted(control_client.call(m.socket, {"op": "cluster"})["cycles"])

    for uid in (ATTACKER, NOBODY):
        assert run_as(uid, uid, cycles_seen) == [identities[uid]]
    assert sorted(m.call({"op": "cluster"})["cycles"]) == sorted(identities.values())


def wrong_guesses(directory: str, name: str, n: int) -> bytes:
    """A digest of ``n`` one-byte items of ``directory``'s file ``f`` that all fail their
    hash check, and two, ``honest`` and ``later``, that pass it (the file holds zeros)."""
    wrong = hashlib.sha256(b"\x01").digest()
    items = [digest_format.NewItem(path=f"w{i:04d}", digest=wrong, size=1, key="f",
                                   offset=i % 8) for i in range(n)]
    items += [digest_format.NewItem(path=path, digest=hashlib.sha256(b"\0").digest(), size=1,
                                    key="f") for path in ("honest", "later")]
    return digest_format.encode(name, "file://" + directory, items)


def test_a_uid_whose_hashes_keep_failing_is_stopped(shared_workdir, mountd_factory):
    mine = attacker_dir(shared_workdir)
    attacker_file(mine, "f", b"\x00" * 8)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    # the budget is the uid's, summed over its registrations: A fails 600, B the rest
    first = MAX_INTEGRITY_FAILURES_PER_USER * 3 // 5
    sizes = {"a": first, "b": MAX_INTEGRITY_FAILURES_PER_USER - first, "c": 0}
    for name, n in sizes.items():
        reply = call_as(ATTACKER, ATTACKER, m.socket, {
            "op": "mount", "name": name, "digest": wrong_guesses(mine, name, n)})
        assert reply["ok"], reply
    paths = {name: [f"{m.root}/{name}/w{i:04d}" for i in range(n)]
             for name, n in sizes.items()}
    assert set(read_as_attacker(paths["a"]).values()) == {5}
    honest_a = f"{m.root}/a/honest"
    # within the budget a failing dataset still serves what is right
    assert read_as_attacker([honest_a]) == {honest_a: "00"}
    assert set(read_as_attacker(paths["b"]).values()) == {5}
    assert [dataset_counters(m, n).get("integrity_failures", 0) for n in sizes] == [
        sizes["a"], sizes["b"], 0]

    # the budget spent: the failing datasets serve nothing more, even what is cached,
    # and fetch nothing; a dataset that never failed is served as before
    fetched = {n: dataset_counters(m, n).get("bucket_fetches", 0) for n in sizes}
    later = [f"{m.root}/{n}/later" for n in sizes]  # the store holds their bytes
    assert read_as_attacker(later) == {later[0]: 5, later[1]: 5, later[2]: "00"}
    time.sleep(FAILED_HOLD)  # a file that just failed fails again without a new try
    assert set(read_as_attacker(paths["b"][:10]).values()) == {5}
    assert {n: dataset_counters(m, n).get("bucket_fetches", 0) for n in sizes} == fetched
    assert dataset_counters(m, "b")["suspended_reads"] == 11
    assert dataset_counters(m, "b")["integrity_failures"] == sizes["b"]  # no more checks

    # and its new registrations are refused, unmounting changes nothing
    again = call_as(ATTACKER, ATTACKER, m.socket, {
        "op": "mount", "name": "more", "digest": byte_oracle_digest(mine, "f", 1)})
    assert not again["ok"] and again["code"] == 6
    assert f"failed {MAX_INTEGRITY_FAILURES_PER_USER} hash checks" in again["error"]
    assert call_as(ATTACKER, ATTACKER, m.socket, {"op": "umount", "name": "b"})["ok"]
    again = call_as(ATTACKER, ATTACKER, m.socket, {
        "op": "mount", "name": "more", "digest": byte_oracle_digest(mine, "f", 1)})
    assert not again["ok"] and again["code"] == 6


def mountd_index_fds(m) -> dict[str, int]:
    """mountd's descriptors of its store's index files, by file name."""
    pid = m.status()["pid"]
    index = os.path.join(m.cache_dir, "store", "cache.db")
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue  # closed since the listing
        if target.startswith(index):
            out[os.path.basename(target)] = int(fd)
    return out


def test_proc_magic_links_read_nothing_of_mountd(shared_workdir, mountd_factory):
    # root's own small item lives in the index (and its WAL): what the oracle is after
    private = os.path.join(shared_workdir, "private")
    os.mkdir(private, 0o700)
    with open(os.path.join(private, "s.bin"), "wb") as f:
        f.write(SECRET)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    assert m.call({"op": "mount", "name": "roots", "digest": make_digest(private, "roots")})
    with open(os.path.join(m.root, "roots", "s.bin"), "rb") as f:
        assert f.read() == SECRET
    fds = mountd_index_fds(m)
    assert "cache.db" in fds, fds

    # naming a magic link outright is refused at registration
    for source, key in (("/proc/self/fd", str(fds["cache.db"])), ("/dev/fd", "0"),
                        ("/proc/self", "environ")):
        item = digest_format.NewItem(path="x", digest=b"\0" * 32, size=1, key=key)
        reply = call_as(ATTACKER, ATTACKER, m.socket, {
            "op": "mount", "name": "direct",
            "digest": digest_format.encode("direct", "file://" + source, [item])})
        assert not reply["ok"] and reply["code"] == 6, (source, reply)

    # swapped in after registration, every link fails its open: nothing is read
    mine = attacker_dir(shared_workdir)
    # fd 1 is mountd's log, open for all to read: through the link only the link stops it
    targets = {f"fd{n}": f"/proc/self/fd/{n}" for n in (1, *fds.values())}
    targets |= {"devfd": f"/dev/fd/{fds['cache.db']}", "mem": "/proc/self/mem",
                "cmdline": "/proc/self/cmdline",  # it begins with "/" (sys.executable)
                "root": f"/proc/self/root{os.path.join(private, 's.bin')}"}
    items = [digest_format.NewItem(path=f"{key}/b{b:03d}",
                                   digest=hashlib.sha256(bytes([b])).digest(), size=1,
                                   key=key)
             for key in targets for b in range(256)]
    for key in targets:
        attacker_file(mine, key, b"")
    reply = call_as(ATTACKER, ATTACKER, m.socket, {
        "op": "mount", "name": "oracle",
        "digest": digest_format.encode("oracle", "file://" + mine, items)})
    assert reply["ok"], reply
    for key, target in targets.items():
        os.unlink(os.path.join(mine, key))
        os.symlink(target, os.path.join(mine, key))
    got = read_as_attacker([f"{m.root}/oracle/{it.path}" for it in items])
    assert set(got.values()) == {5}
    counters = dataset_counters(m, "oracle")
    assert counters.get("integrity_failures", 0) == 0  # not a byte was read, or compared
    assert counters["bucket_errors"] == len(items)
    assert "/proc" in m.log_tail(5)


def test_a_dataset_in_mountds_own_mount_fails_its_reads_and_mountd_serves_on(
        shared_workdir, mountd_factory):
    mine = attacker_dir(shared_workdir)
    src = os.path.join(mine, "src")
    os.mkdir(src)
    os.chown(src, ATTACKER, ATTACKER)
    data = {f"f{i}.bin": os.urandom(5000) for i in range(40)}
    for name, content in data.items():
        attacker_file(src, name, content)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"),
                       extra_args=("--threads", "4"))
    os.chmod(m.cache_dir, 0o755)
    assert call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "base",
                                                  "digest": make_digest(src, "base")})["ok"]
    # items whose files are the mount's own: each read would wait on a worker reading it
    inner = os.path.join(m.root, "base")
    items = [digest_format.NewItem(path=f"g{name}", digest=hashlib.sha256(c).digest(),
                                   size=len(c), key=name) for name, c in data.items()]
    looped = digest_format.encode("looped", "file://" + inner, items)
    refused = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "looped",
                                                     "digest": looped})
    assert not refused["ok"] and refused["code"] == 6
    assert "mountd's own mount" in refused["error"]
    # root's registrations are not checked for access: their reads refuse it instead
    m.call({"op": "mount", "name": "looped", "digest": looped})
    paths = [f"{m.root}/looped/{it.path}" for it in items]
    with concurrent.futures.ThreadPoolExecutor(len(paths)) as pool:  # more than 4 at once
        got = list(pool.map(lambda p: read_as(0, [p]), paths))
    assert got == [{p: 5} for p in paths]
    assert dataset_counters(m, "looped")["bucket_errors"] == len(items)
    assert read_as_attacker([f"{m.root}/base/f1.bin"]) == {
        f"{m.root}/base/f1.bin": data["f1.bin"].hex()}


def test_the_store_is_root_only(shared_workdir, mountd_factory, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "small.bin").write_bytes(b"s" * 100)  # a file of the store, however small
    (src / "large.bin").write_bytes(b"l" * 50_000)
    data = make_digest(str(src), "mixed")
    cache_dir = os.path.join(shared_workdir, "cache")

    def private_modes() -> dict[str, str]:
        """Every path under the store whose mode lets anyone but root in."""
        loose = {}
        for dirpath, dirs, files in os.walk(os.path.join(cache_dir, "store")):
            for name in [".", *dirs, *files]:
                path = os.path.normpath(os.path.join(dirpath, name))
                if os.stat(path).st_mode & 0o077:
                    loose[path] = oct(os.stat(path).st_mode)
        return loose

    for run in ("first", "again"):
        m = mountd_factory(name=run, workdir=shared_workdir, cache_dir=cache_dir)
        if run == "first":
            m.call({"op": "mount", "name": "mixed", "digest": data})
        for name in ("small.bin", "large.bin"):
            with open(os.path.join(m.root, "mixed", name), "rb") as f:
                assert f.read() == (src / name).read_bytes()
        assert m.status()["cache"]["items"] == 2
        assert len(value_files(os.path.join(cache_dir, "store"))) == 2  # modes checked
        assert os.path.exists(os.path.join(cache_dir, "store", "cache.db-wal"))
        assert private_modes() == {}
        if run == "first":  # made as an older version left it: readable by all
            assert m.stop() == 0
            for dirpath, _, files in os.walk(os.path.join(cache_dir, "store")):
                os.chmod(dirpath, 0o755)
                for name in files:
                    os.chmod(os.path.join(dirpath, name), 0o644)
            assert private_modes()


def test_an_item_too_large_to_serve_is_refused_at_registration(shared_workdir, mountd_factory):
    mine = attacker_dir(shared_workdir)
    sparse = attacker_file(mine, "huge", b"")
    os.truncate(sparse, MAX_ITEM_BYTES + 1)  # sparse: costs the attacker no disk
    item = digest_format.NewItem(path="huge", digest=b"\0" * 32, size=MAX_ITEM_BYTES + 1)
    m = start_shared_mountd(mountd_factory, shared_workdir)
    reply = call_as(ATTACKER, ATTACKER, m.socket, {
        "op": "mount", "name": "huge",
        "digest": digest_format.encode("huge", "file://" + mine, [item])})
    assert not reply["ok"] and reply["code"] == 5 and "larger than mountd serves" in reply["error"]
    assert m.status()["datasets"] == []


def unit_capabilities() -> list[str]:
    unit = os.path.join(os.path.dirname(__file__), "..", "systemd", "quiver-mountd.service")
    with open(unit, encoding="utf-8") as f:
        for line in f:
            if line.startswith("CapabilityBoundingSet="):
                return line.split("=", 1)[1].split()
    raise AssertionError("the mountd unit sets no CapabilityBoundingSet")


def bounded_to(caps: list[str]) -> tuple[str, ...]:
    """A setpriv prefix that runs a command with only ``caps``, as systemd would."""
    wanted = ",".join(f"+{c.lower().removeprefix('cap_')}" for c in caps)
    return ("setpriv", f"--bounding-set=-all,{wanted}", "--inh-caps=-all", "--")


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("drop, readable", [((), True), (("CAP_SETUID", "CAP_SETGID"), False)])
def test_users_datasets_under_the_units_capabilities(shared_workdir, mountd_factory, drop, readable):
    caps = [c for c in unit_capabilities() if c not in drop]
    mine = attacker_dir(shared_workdir)
    src = os.path.join(mine, "data")
    os.mkdir(src)
    os.chown(src, ATTACKER, ATTACKER)
    attacker_file(src, "a.bin", b"a" * 1000)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"),
                       wrapper=bounded_to(caps))
    os.chmod(m.cache_dir, 0o755)
    reply = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "mine",
                                                   "digest": make_digest(src, "mine")})
    if not readable:  # fails closed, and says why
        assert not reply["ok"] and reply["code"] == 6 and "CAP_SETUID" in reply["error"]
        assert "other users' file:// datasets cannot be read" in m.log_tail(50)
        return
    assert reply["ok"], reply
    path = os.path.join(m.root, "mine", "a.bin")
    assert read_as_attacker([path]) == {path: (b"a" * 1000).hex()}


def test_a_restarted_control_mount_is_refused_as_a_datasets_source(shared_workdir,
                                                                   mountd_factory):
    """ROOT/.quiver is mountd's own too, and its child's mount may be a new device each
    time the child is started again: files there named by a digest are refused after a
    restart as before (before, only the first child's device was)."""
    mine = attacker_dir(shared_workdir)
    src = os.path.join(mine, "src")
    os.makedirs(os.path.join(src, "c0"))
    os.chown(src, ATTACKER, ATTACKER)
    os.chown(os.path.join(src, "c0"), ATTACKER, ATTACKER)
    data = {f"c0/f{i}.bin": os.urandom(5000) for i in range(8)}
    for name, content in data.items():
        attacker_file(src, name, content)
    m = mountd_factory(workdir=shared_workdir, cache_dir=os.path.join(shared_workdir, "cache"))
    os.chmod(m.cache_dir, 0o755)
    assert call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "base",
                                                  "digest": make_digest(src, "base"),
                                                  "view": "substitutable"})["ok"]
    control = os.path.join(m.root, ".quiver")
    items = [digest_format.NewItem(path=f"g{name}", digest=hashlib.sha256(c).digest(),
                                   size=len(c), key=name) for name, c in data.items()]
    looped = digest_format.encode("looped", f"file://{control}/views/base", items)

    def refused_as_own() -> None:
        refused = call_as(ATTACKER, ATTACKER, m.socket, {"op": "mount", "name": "looped",
                                                         "digest": looped})
        assert not refused["ok"] and refused["code"] == 6, refused
        assert "mountd's own mount" in refused["error"], refused

    refused_as_own()
    device = mount_device(control)
    holder = os.path.join(shared_workdir, "holder")
    os.mkdir(holder)
    # this mountd's child only: other mountds on the machine keep theirs
    found = subprocess.run(["pgrep", "-f",  # its mount point, then --forward or nothing
                            f"mountd.fs.control_mount_process [0-9]+ {control}( |$)"],
                           capture_output=True, text=True, check=True)
    for pid in found.stdout.split():
        os.kill(int(pid), 9)
    try:
        # the kernel gives a new mount the lowest free device number: a tmpfs mounted
        # while ROOT/.quiver is detached takes the old one
        deadline = time.monotonic() + 30
        while mount_device(control) is not None:
            assert time.monotonic() < deadline, "ROOT/.quiver was not detached"
            time.sleep(0.01)
        subprocess.run(["mount", "-t", "tmpfs", "tmpfs", holder], check=True)
        while "is mounted again" not in m.log_tail(50):
            assert time.monotonic() < deadline, "ROOT/.quiver was not mounted again"
            time.sleep(0.05)
        assert mount_device(control) not in (None, device)
        refused_as_own()
    finally:
        subprocess.run(["umount", holder], check=False)

"""The substitutable view: plain readers get every item of each label once per pass."""
from __future__ import annotations

import collections
import dataclasses
import hashlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import types
import wave

import numpy as np
import pytest
import torch
import torchvision
import trio
import trio.testing

from mountd.datasets.pools import ViewPools
from mountd.fetch.read_stats import ReadStats
from mountd.fetch.staging import Staging
from mountd.datasets.mount_table import MountTable
from mountd.jobs import registry
from mountd.jobs.dataset_jobs import DatasetJobs
from mountd.view.native_queue import NEEDED, OPENED, RETURNED
from mountd.view.readahead import (EVICTION_PAUSE, IN_FLIGHT, MAX_AHEAD, ROUND_ITEMS,
                                   ViewReadahead, next_items)
from mountd.view.view_job import Choice
from mountd.view.view_jobs import ViewJob, ViewJobs, identity_from
from quiverfs import digest as digest_format
from quiverfs.bench.processes import MountdProcess
from quiverfs.chunk_cycle import ChunkState
from quiverfs.errors import QuietError
from quiverfs.heartbeat import CacheMode, CycleView
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

SERVED_HASH = "user.quiver.served.sha256"
SERVED_PATH = "user.quiver.served.path"

# A reader in its own process: reads the given paths under ROOT (argv: ROOT, then a JSON
# list of paths on stdin) and prints, per path, what it was served (JSON lines).
READER = """
import hashlib, json, os, sys
root = sys.argv[1]
for rel in json.load(sys.stdin):
    with open(os.path.join(root, rel), "rb") as f:
        data = f.read()
        served = os.getxattr(f.fileno(), "user.quiver.served.sha256").decode()
        path = os.getxattr(f.fileno(), "user.quiver.served.path").decode()
    print(json.dumps({"read": rel, "served": served, "path": path,
                      "sha256": hashlib.sha256(data).hexdigest()}), flush=True)
"""


def load_served(path: str) -> dict:
    """A DatasetFolder loader: what an open of ``path`` served, checked against its bytes."""
    with open(path, "rb") as f:
        data = f.read()
        size = os.fstat(f.fileno()).st_size
        served = os.getxattr(f.fileno(), SERVED_HASH).decode()
        served_path = os.getxattr(f.fileno(), SERVED_PATH).decode()
    return {"read": path, "served": served, "path": served_path, "size": size,
            "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def keep_dicts(batch: list) -> list:
    return batch


@pytest.fixture
def view_mount(mountd_factory, digits_tree):
    """mountd with the digits mounted as a substitutable view at ROOT/digits."""
    def start(cache_size: str = "1G") -> tuple[MountdProcess, digest_format.Digest]:
        m = mountd_factory(cache_size=cache_size)
        data = make_digest(digits_tree.root, "digits")
        reply = mount(m, data, "digits", view="substitutable")
        assert reply["view"] == "substitutable"
        return m, digest_format.decode(data)
    return start


def digest_hashes(d: digest_format.Digest) -> collections.Counter[str]:
    return collections.Counter(d.hash(i).hex() for i in range(len(d)))


def check_served(records: list[dict], d: digest_format.Digest, root: str) -> None:
    """Each record's bytes are the item it says it was served, of the label of the path
    it was read under, and fstat told their size."""
    by_path = {d.path(i): d.hash(i).hex() for i in range(len(d))}
    for r in records:
        assert r["sha256"] == r["served"] == by_path[r["path"]]
        read = os.path.relpath(r["read"], root) if os.path.isabs(r["read"]) else r["read"]
        assert os.path.dirname(read) == os.path.dirname(r["path"])  # same class folder
        if "size" in r:
            assert r["size"] == r["bytes"]


def test_dataloader_with_four_workers_gets_every_item_once_per_epoch(view_mount):
    m, d = view_mount(cache_size="200K")  # a fifth of the digits' store footprint, about
    root = os.path.join(m.root, "digits")
    ds = torchvision.datasets.DatasetFolder(root, loader=load_served, extensions=(".png",))
    loader = torch.utils.data.DataLoader(ds, batch_size=32, shuffle=True, num_workers=4,
                                         collate_fn=keep_dicts)
    for _ in range(2):
        records = [r for batch in loader for r, _ in batch]
        assert len(records) == len(d)
        assert collections.Counter(r["served"] for r in records) == digest_hashes(d)
        check_served(records, d, root)
    jobs = m.status()["view_jobs"]
    assert len(jobs) == 1 and jobs[0]["identity"].startswith("pgid:")
    assert jobs[0]["counters"]["opens"] == 2 * len(d)
    assert jobs[0]["counters"]["hits"] > 0


def control_requests(m: MountdProcess) -> collections.Counter[str]:
    """The requests of the ``.quiver`` connection that reached mountd, by opcode."""
    return collections.Counter({op.removeprefix("control."): n for op, n in
                                m.status()["fuse_requests"].items()
                                if op.startswith("control.")})


def test_paths_through_a_views_link_cost_one_readlink_not_one_a_file(mountd_factory,
                                                                      digits_tree):
    """``ROOT/NAME`` of a view is a link to ``ROOT/.quiver/views/NAME``, which every path
    through it follows: the kernel keeps the link's target (mountd asks it to cache
    READLINK's answers in the INIT reply), so a pass over the view's files reaches
    mountd with no READLINK once the first has been answered."""
    m = mountd_factory()
    data = make_digest(digits_tree.root, "digits")
    mount(m, data, "digits", view="substitutable")
    d = digest_format.decode(data)
    root = os.path.join(m.root, "digits")

    def readlinks() -> int:
        return m.status()["fuse_requests"].get("readlink", 0)

    def read_pass() -> collections.Counter[str]:
        served: collections.Counter[str] = collections.Counter()
        for i in range(len(d)):
            with open(os.path.join(root, d.path(i)), "rb") as f:
                served[hashlib.sha256(f.read()).hexdigest()] += 1
        return served

    assert m.status()["data_path"] == "native"
    assert read_pass() == digest_hashes(d)
    assert readlinks() == 1
    assert read_pass() == digest_hashes(d)
    assert readlinks() == 1


def run_readers(root: str, groups: list[tuple[dict[str, str], list[str]]],
                new_session: bool) -> list[list[dict]]:
    """Start reader processes: per group an environment and one path-list file per
    process; the processes of a group share a process group. Their records, per group."""
    procs = []
    for env, path_lists in groups:
        script = " & ".join(f"{sys.executable} -c \"$READER\" {root} < {path} > {path}.out"
                            for path in path_lists) + " & wait"
        procs.append(subprocess.Popen(["sh", "-c", script], env={**os.environ, **env,
                                                                  "READER": READER},
                                      start_new_session=new_session))
    for p in procs:
        assert p.wait(timeout=300) == 0
    out = []
    for _, path_lists in groups:
        records = []
        for path in path_lists:
            with open(f"{path}.out", encoding="utf-8") as f:
                records += [json.loads(line) for line in f]
        out.append(records)
    return out


def path_files(tmp_path, name: str, paths: list[str], parts: int) -> list[str]:
    files = []
    for k in range(parts):
        f = tmp_path / f"{name}-{k}.json"
        f.write_text(json.dumps(paths[k::parts]))
        files.append(str(f))
    return files


def test_two_concurrent_jobs_each_get_every_item_once(view_mount, tmp_path):
    m, d = view_mount(cache_size="400K")
    root = os.path.join(m.root, "digits")
    paths = sorted(d.path(i) for i in range(len(d)))
    # one job recognised by its process group, one by QUIVER_JOB
    by_session, by_env = run_readers(root, [
        ({}, path_files(tmp_path, "a", paths, 1)),
        ({"QUIVER_JOB": "second"}, path_files(tmp_path, "b", paths, 1))], new_session=True)
    for records in (by_session, by_env):
        assert collections.Counter(r["served"] for r in records) == digest_hashes(d)
        check_served(records, d, root)
    deadline = time.monotonic() + 30  # their processes are gone: the jobs are forgotten
    while m.status()["view_jobs"] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert m.status()["view_jobs"] == []


@pytest.mark.parametrize("same", ["process group", "QUIVER_JOB"])
def test_two_ranks_of_one_run_together_get_every_item_once(view_mount, tmp_path, same):
    """Two processes of one run, each reading half of the paths, are one job: in one
    process group (as mp.spawn starts ranks), or in sessions of their own with the same
    QUIVER_JOB. Together they get each item once."""
    m, d = view_mount(cache_size="400K")
    root = os.path.join(m.root, "digits")
    paths = sorted(d.path(i) for i in range(len(d)))
    halves = path_files(tmp_path, "r", paths, 2)
    if same == "process group":
        [records] = run_readers(root, [({}, halves)], new_session=True)
    else:
        env = {"QUIVER_JOB": "run-1"}
        records = sum(run_readers(root, [(env, halves[:1]), (env, halves[1:])],
                                  new_session=True), [])
    assert sorted(r["read"] for r in records) == paths
    assert collections.Counter(r["served"] for r in records) == digest_hashes(d)
    check_served(records, d, root)


def write_mixed_tree(dest: str) -> dict[str, bytes]:
    """Class folders of .npy arrays and .wav clips of different lengths; path -> bytes."""
    rng = np.random.default_rng(3)
    files = {}
    for label in ("a", "b"):
        for k in range(12):
            buf = io.BytesIO()
            np.save(buf, rng.normal(size=(int(rng.integers(1, 400)),)).astype(np.float32))
            files[f"{label}/{k}.npy"] = buf.getvalue()
            buf = io.BytesIO()
            with wave.open(buf, "wb") as w:
                w.setnchannels(1)
                w.setsampwidth(2)
                w.setframerate(8000)
                w.writeframes(rng.integers(-2000, 2000, int(rng.integers(10, 3000)),
                                           dtype=np.int16).tobytes())
            files[f"{label}/{k}.wav"] = buf.getvalue()
    for rel, data in files.items():
        os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
        with open(os.path.join(dest, rel), "wb") as f:
            f.write(data)
    return files


def test_numpy_and_wave_readers_get_whole_items_of_their_folder_and_type(mountd_factory,
                                                                         tmp_path):
    src = str(tmp_path / "mixed")
    files = write_mixed_tree(src)
    m = mountd_factory()
    mount(m, make_digest(src, "mixed"), "mixed", view="substitutable")
    root = os.path.join(m.root, "mixed")
    npy = [p for p in files if p.endswith(".npy")]
    wav = [p for p in files if p.endswith(".wav")]
    got_npy, got_wav = collections.Counter(), collections.Counter()
    for rel in npy:
        with open(os.path.join(root, rel), "rb") as f:
            array = np.load(f)
            served = os.getxattr(f.fileno(), SERVED_PATH).decode()
        assert served.endswith(".npy") and served.split("/")[0] == rel.split("/")[0]
        np.testing.assert_array_equal(array, np.load(io.BytesIO(files[served])))
        got_npy[served] += 1
    for rel in wav:
        with open(os.path.join(root, rel), "rb") as f:
            with wave.open(f, "rb") as w:
                frames = w.readframes(w.getnframes())
            served = os.getxattr(f.fileno(), SERVED_PATH).decode()
        assert served.endswith(".wav") and served.split("/")[0] == rel.split("/")[0]
        with wave.open(io.BytesIO(files[served]), "rb") as w:
            assert frames == w.readframes(w.getnframes())
        got_wav[served] += 1
    assert got_npy == collections.Counter(npy)  # each item once
    assert got_wav == collections.Counter(wav)


def test_unlabelled_digest_and_unknown_view_are_refused(mountd_factory, quiver, tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    for k in range(3):
        (flat / f"{k}.bin").write_bytes(bytes([k]) * 10)
    m = mountd_factory()
    digest_file = tmp_path / "flat.qd"
    digest_file.write_bytes(make_digest(str(flat), "flat"))
    r = quiver("mount", str(digest_file), "--view", "substitutable", "--root", m.root,
               "--control-socket", m.socket)
    assert r.returncode == 5
    assert r.stderr.strip().count("\n") == 0 and "has no labels" in r.stderr
    r = quiver("mount", str(digest_file), "--view", "shuffled", "--root", m.root,
               "--control-socket", m.socket)
    assert r.returncode == 2 and "invalid choice: 'shuffled'" in r.stderr
    with pytest.raises(QuietError, match="unknown view 'shuffled'"):
        m.call({"op": "mount", "name": "flat", "digest": digest_file.read_bytes(),
                "view": "shuffled"})
    assert m.status()["datasets"] == []


def test_the_sampler_is_refused_on_a_view(view_mount):
    m, _ = view_mount()
    root = os.path.join(m.root, "digits")
    with pytest.raises(ValueError, match="is a substitutable view"):
        QuiverBatchSampler(root, 32)


def test_job_identity_rule():
    assert identity_from({b"QUIVER_JOB": b"sweep-3"}, 77) == "env:sweep-3"
    torchrun = {b"TORCHELASTIC_RUN_ID": b"none", b"MASTER_ADDR": b"127.0.0.1",
                b"MASTER_PORT": b"29500"}
    assert identity_from(torchrun, 77) == "torchrun:127.0.0.1:29500:none"
    assert identity_from({**torchrun, b"QUIVER_JOB": b"mine"}, 77) == "env:mine"
    for hostile in (b"", b"../x", b"a b", b"\xff", b"x" * 200, b".hidden"):
        assert identity_from({b"QUIVER_JOB": hostile}, 77) == "pgid:77"


def test_pools_are_a_folder_and_an_extension_and_unlabelled_items_stand_alone():
    items = [digest_format.NewItem(path, hashlib.sha256(path.encode()).digest(), 10)
             for path in ("README", "a/1.jpg", "a/2.JPG", "a/3.json", "b/1.jpg",
                          "b/sub/1.jpg", "b/sub/2.jpg", "top.jpg")]
    d = digest_format.decode(digest_format.encode("t", "file:///x", items))
    pools = ViewPools.of(d)
    groups = sorted(sorted(d.path(int(i)) for i in m) for m in pools.members)
    assert groups == [["README"], ["a/1.jpg", "a/2.JPG"], ["a/3.json"], ["b/1.jpg"],
                      ["b/sub/1.jpg", "b/sub/2.jpg"], ["top.jpg"]]


def test_the_items_of_an_evicted_hash_are_found_by_it_every_copy():
    """Which items the store's news of an evicted hash is: each copy of a content the
    digest lists twice, none for a hash it does not list (its first 8 bytes included)."""
    paths = [f"c/{k}.jpg" for k in range(6)]
    contents = [hashlib.sha256(bytes([k % 5])).digest() for k in range(6)]  # 0 and 5 alike
    d = digest_format.decode(digest_format.encode(
        "t", "file:///x", [digest_format.NewItem(p, h, 10) for p, h in zip(paths, contents)]))
    pools = ViewPools.of(d)
    near = contents[3][:8] + bytes(24)  # another content, the same first 8 bytes
    assert sorted(pools.items_with(d, [contents[0], contents[3], near, b"short"])) == [0, 3, 5]
    assert len(pools.items_with(d, [])) == 0 and len(pools.items_with(d, [near])) == 0


def _classes_digest(per_class: int, size: int, classes: str = "ab") -> digest_format.Digest:
    items = [digest_format.NewItem(f"{c}/{k}.jpg", hashlib.sha256(f"{c}{k}".encode()).digest(),
                                   size)
             for c in classes for k in range(per_class)]
    return digest_format.decode(digest_format.encode("t", "file:///x", items))


def _cycle(n_chunks: int, resident: tuple[int, ...], capacity: int) -> CycleView:
    states = [ChunkState.ACTIVE if c in resident else ChunkState.EVICTED
              for c in range(n_chunks)]
    return CycleView(n_chunks, tuple(states), resident, {}, 0,
                     (max(resident) + 1) % n_chunks, capacity, capacity, (), ("node",),
                     CacheMode.COOP, 0, {})


def test_a_pass_hands_out_each_item_once_and_the_jobs_needs_follow_it():
    d = _classes_digest(50, 10)
    ds = types.SimpleNamespace(digest=d, pools=ViewPools.of(d), name="t", mean_item_bytes=10)
    job = ViewJob("view:t:0:env:x", ds, 0, "env:x", DatasetJobs(ds, 200, None))
    assert job.need.all() and job.report().remaining == (0,) * job.group.plan.n_chunks
    a = job.pass_of(0)
    served = []
    while a.pending.any():
        batch = [int(i) for i in a.pending_items()[:7]]
        job.place(a, batch)
        served += batch
        with pytest.raises(AssertionError):
            job.place(a, batch[:1])  # never twice in a pass
        assert not job.need[batch].any()
    members = ds.pools.members[0]
    assert sorted(served) == sorted(int(i) for i in members)
    assert not job.kept_for(members).any() and job.kept_for(ds.pools.members[1]).all()
    assert a.used_up and job.pass_of(0) is not a and job.pass_of(0).number == 1
    assert job.need[members].all()  # the next pass needs all of pool a again


class _Store:
    """The store as the view sees it: what is held, and the marks it was given."""

    def __init__(self, digest: digest_format.Digest) -> None:
        self.digest = digest
        self.held_items: set[int] = set()
        self.spent_items: set[int] = set()

    async def held(self, hashes: list[bytes]) -> list[bool]:
        await trio.lowlevel.checkpoint()
        return [any(self.digest.hash(i) == h for i in self.held_items) for h in hashes]

    def _items(self, hashes) -> set[int]:
        hashes = set(hashes)
        return {i for i in range(len(self.digest)) if self.digest.hash(i) in hashes}

    def spent(self, hashes) -> None:
        self.spent_items |= self._items(hashes)

    def wanted(self, hashes) -> None:
        self.spent_items -= self._items(hashes)


class _Files:
    """The store's value files as the view sees them: those whose file it knows (found
    in the store); of the others it cannot tell without a look."""

    def __init__(self) -> None:
        self.known: set[bytes] = set()

    def seen(self, digest: bytes) -> None:
        self.known.add(digest)

    def holds(self, digest: bytes) -> bool | None:
        return True if digest in self.known else None

    def forget(self, digest: bytes) -> None:
        self.known.discard(digest)


def _two_view_jobs() -> tuple:
    """Two view jobs on one lone node's dataset of 4 chunks of 4 items (2 of each
    class), chunk 2 resident and 3 next, with a fake store: (ds, group, store, jobs,
    the two jobs, the pool of item 0)."""
    d = _classes_digest(8, 100)
    ds = types.SimpleNamespace(digest=d, pools=ViewPools.of(d), name="t", mean_item_bytes=100)
    group = DatasetJobs(ds, 400, None)
    group.view = _cycle(group.plan.n_chunks, (2,), 2)
    store = _Store(d)
    files = _Files()
    services = types.SimpleNamespace(
        bulk=store, recency=store,
        cluster=types.SimpleNamespace(live=lambda: ["node"], other_owner=lambda digest: None),
        limiter=None, stats=None, staging=types.SimpleNamespace(planned=lambda hashes: None),
        store=types.SimpleNamespace(files=files, evictions=collections.deque()))
    jobs = ViewJobs(None, services)
    first, second = (ViewJob(f"view:t:0:env:{n}", ds, 0, f"env:{n}", group) for n in "xy")
    group.jobs = {first.id: first, second.id: second}
    return ds, group, store, jobs, (first, second), int(ds.pools.pool_of[0])


def test_jobs_that_open_a_dataset_together_wait_for_one_chunk_plan(monkeypatch):
    """The first opens of several jobs of one dataset, together, make its DatasetJobs
    (the chunk plan, a loop over every item) once, and all get that one."""
    d = _classes_digest(8, 100)
    ds = types.SimpleNamespace(digest=d, pools=ViewPools.of(d), name="t", mean_item_bytes=100)
    made: list[DatasetJobs] = []
    every_open_came = threading.Event()

    class Counted(DatasetJobs):
        def __init__(self, *args: object) -> None:
            every_open_came.wait(30)  # a plan under way while the other opens come
            super().__init__(*args)
            made.append(self)
    monkeypatch.setattr(registry, "DatasetJobs", Counted)
    jobs = registry.JobRegistry(MountTable(), trio.CapacityLimiter(4), 400)
    got: list[DatasetJobs] = []

    async def main() -> None:
        async def first_open() -> None:
            got.append(await jobs.group_for(ds))
        async with trio.open_nursery() as nursery:
            for _ in range(4):
                nursery.start_soon(first_open)
            await trio.testing.wait_all_tasks_blocked()
            every_open_came.set()
    trio.run(main)
    assert len(made) == 1 and got == made * 4


def test_jobs_take_a_pool_in_one_order_so_that_one_jobs_miss_is_the_others_hit():
    ds, group, store, jobs, (first, second), pool = _two_view_jobs()
    members = ds.pools.members[pool]
    order = group.in_order(members, 0)
    chunks = group.plan.chunk_of[order]
    assert list(chunks) == sorted(chunks, key=lambda c: (c - 2) % 4)  # resident first
    again = group.in_order(members, 1)  # the next pass: each chunk's items shuffled anew
    assert list(group.plan.chunk_of[again]) == list(chunks) and list(again) != list(order)

    async def plan(job: ViewJob) -> list:  # what the job's next opens take
        current = job.pass_of(pool)
        await jobs._plan(job, pool, current)
        out = []
        while current.queue:
            out.append(jobs._taken(job, pool, current.queue.popleft()))
        return out

    (miss,) = trio.run(plan, first)
    assert (miss.index, miss.hit, miss.keep) == (order[0], False, True)
    assert group.cached.cached[miss.index]  # taken to be cached: the other job needs it
    store.held_items.add(miss.index)  # its read stored it
    (hit,) = trio.run(plan, second)
    assert (hit.index, hit.hit) == (order[0], True)
    # both jobs have had it: the store's first to evict, no longer counted
    assert store.spent_items == {order[0]} and not group.cached.cached[order[0]]
    assert group.cached.bytes == 0
    # a miss that the other job has had already is read once, not kept
    store.held_items.clear()
    (own,) = trio.run(plan, second)
    assert (own.index, own.keep) == (order[1], True)
    group.cached.evicted(np.asarray([own.index]))  # its read stored it; evicted since
    (last,) = trio.run(plan, first)
    assert (last.index, last.hit, last.keep) == (order[1], False, False)


def test_a_miss_is_of_the_first_item_not_on_its_way_already():
    """Jobs at the front of a pool's common order each miss a different item: one on
    its way (another job's miss) is waited for by no second job, which fetches the
    next; with every item it needs on its way, the first."""
    ds, group, store, jobs, (first, second), pool = _two_view_jobs()
    order = [int(i) for i in group.in_order(ds.pools.members[pool], 0)]

    async def miss(job: ViewJob) -> int:
        current = job.pass_of(pool)
        await jobs._plan(job, pool, current)
        (choice,) = current.queue
        current.queue.clear()
        assert not choice.hit
        return choice.index

    assert trio.run(miss, first) == order[0]
    assert trio.run(miss, second) == order[1]  # the first's is on its way
    assert trio.run(miss, first) == order[2]  # the second's is on its way too
    store.held_items.add(order[0])  # it came: the second's next open is its hit
    trio.run(jobs._plan, second, pool, second.pass_of(pool))
    assert [(c.index, c.hit) for c in second.pass_of(pool).queue] == [(order[0], True)]
    second.pass_of(pool).queue.clear()
    group.cached.hold(order)  # all on their way: the first it needs
    assert trio.run(miss, second) == order[2]


def test_the_stores_evictions_reach_what_the_view_takes_to_be_cached():
    """What a put evicted reaches the view as news: its items are forgotten without a
    look in the store (its readahead's room is then true), as a needed item's eviction;
    a spent item's eviction, or another dataset's, changes nothing else."""
    ds, group, store, jobs, (first, second), pool = _two_view_jobs()
    jobs.jobs = {("t", 0, job.identity): job for job in (first, second)}
    order = [int(i) for i in group.in_order(ds.pools.members[pool], 0)]
    group.cached.hold(order[:3])
    group.cached.spend(order[2:3])  # both jobs have had it
    evicted_at = group.cached.evicted_at
    news = jobs.services.store.evictions
    news.extend([ds.digest.hash(order[2]), hashlib.sha256(b"elsewhere").digest()])
    jobs._needs()
    assert not news and group.cached.bytes == 200 and group.cached.evicted_at == evicted_at
    assert not group.cached.findable(np.asarray(order[2:3])).any()  # not looked for again
    news.extend([ds.digest.hash(order[0])] * 2)  # evicted, stored again, evicted
    jobs._needs()
    assert not group.cached.cached[order[0]] and group.cached.bytes == 100
    assert group.cached.evicted_at > evicted_at  # a needed item: the readahead pauses
    assert group.cached.cached[order[1]]


def test_a_planned_hit_is_spent_when_the_last_job_opens_it_not_when_planned():
    ds, group, store, jobs, (first, second), pool = _two_view_jobs()
    order = group.in_order(ds.pools.members[pool], 0)
    group.cached.hold(order[:2])
    store.held_items |= {int(i) for i in order[:2]}
    for job in (first, second):  # each plans both cached items as hits
        trio.run(jobs._plan, job, pool, job.pass_of(pool))
        assert [c.index for c in job.pass_of(pool).queue] == list(order[:2])
    taken = jobs._taken(second, pool, second.pass_of(pool).queue.popleft())
    assert taken.keep and not store.spent_items  # the first job has yet to open it
    taken = jobs._taken(first, pool, first.pass_of(pool).queue.popleft())
    assert not taken.keep and store.spent_items == {order[0]}
    assert group.cached.cached[order[1]] and not group.cached.cached[order[0]]


def test_nothing_of_a_dataset_allotted_full_is_spent():
    """Where the dataset is allotted full it is kept whole: the last job's open of a
    planned hit leaves it counted cached and not the store's first to evict."""
    ds, group, store, jobs, (first, second), pool = _two_view_jobs()
    group.view = dataclasses.replace(group.view, mode=CacheMode.FULL)
    order = group.in_order(ds.pools.members[pool], 0)
    group.cached.hold(order[:1])
    store.held_items.add(int(order[0]))
    for job in (first, second):
        trio.run(jobs._plan, job, pool, job.pass_of(pool))
        taken = jobs._taken(job, pool, job.pass_of(pool).queue.popleft())
        assert (taken.index, taken.hit, taken.keep) == (order[0], True, True)
    assert not store.spent_items and group.cached.cached[order[0]]


def test_opens_waiting_on_a_pass_that_runs_out_get_the_next_pass_not_each_others_lock():
    """Three opens of one job at once, one item of its pass left: one plans it while the
    others wait for the pass's lock; they then get the next pass's items. (trio hands a
    released lock straight to the next waiter, so a pass counted as not used up while
    its lock was held never was: the two waiters handed it to each other for ever,
    mountd's loop at 100% CPU and the job's reads hung.)"""
    ds, group, store, jobs, (first, _), pool = _two_view_jobs()
    jobs.stats = ReadStats()
    ds.counters = collections.Counter()

    async def job_for(ds, pid: int, uid: int) -> ViewJob:
        return first
    jobs.job_for = job_for
    members = [int(i) for i in ds.pools.members[pool]]
    current = first.pass_of(pool)
    first.place(current, members[:-1])
    got: list[tuple[int, int]] = []

    async def open_one() -> None:
        choice = await jobs.choose(ds, members[0], 1, 0)
        got.append((first.pass_number(pool), choice.index))

    async def main() -> None:
        with trio.fail_after(5):
            async with trio.open_nursery() as nursery:
                for _ in range(3):
                    nursery.start_soon(open_one)
    trio.run(main)
    assert (0, members[-1]) in got and len(got) == 3
    assert first.pass_of(pool) is not current and first.pass_number(pool) == 1
    assert len({index for _, index in got}) == 3 and current.used_up


class _Plane:
    """The native plane as the view jobs' queues see it (ViewPlane): what is pushed."""

    def __init__(self) -> None:
        self.pushed: list[int] = []
        # one job and pool's: (item, the pass it was queued in)
        self.queued: collections.deque[tuple[int, int]] = collections.deque()
        self.passes: list[int] = []  # the numbers of the passes said begun
        self.waiting_opens = 0  # opens waiting on the queue (plane_view_waiting)
        self.declined = 0

    def job(self, job_id: int, base: int, uid: int) -> bool:
        return True

    def waiting(self, job_id: int, pool: int) -> int:
        return self.waiting_opens

    def decline(self, job_id: int, pool: int) -> None:
        self.declined += 1

    def push(self, job_id: int, pool: int, items: list[int], number: int) -> bool:
        self.pushed.extend(items)
        self.queued.extend((i, number) for i in items)
        return True

    def passed(self, job_id: int, pool: int, number: int) -> None:
        self.passes.append(number)

    def take(self, job_id: int, pool: int) -> tuple[int, int] | None:
        return self.queued.popleft() if self.queued else None

    def drain(self) -> None:
        pass


def _opened(queued: tuple[int, int]) -> tuple[int, int, float, int]:
    """The plane's report of an open of ``queued`` (item, pass), less the job."""
    return queued[0], OPENED, 0.001, queued[1]


def _native_view_job() -> tuple:
    """The first of two view jobs, its queues in a _Plane: (ds, group, store, jobs, the
    job, the pool of item 0, the plane)."""
    ds, group, store, jobs, (first, _), pool = _two_view_jobs()
    ds.inode_base, ds.counters = 0, collections.Counter()
    store.hit = lambda h: None
    jobs.staging, jobs.stats = Staging(), ReadStats()
    plane = _Plane()
    jobs.serve_natively(plane)
    jobs.native.created(first)
    return ds, group, store, jobs, first, pool, plane


def _full_view_job() -> tuple:
    """A view job whose dataset is allotted full, every item cached, its queues in a
    _Plane: (ds, jobs, the job, the pool of item 0, its members, the plane)."""
    ds, group, store, jobs, first, pool, plane = _native_view_job()
    group.jobs = {first.id: first}
    group.view = dataclasses.replace(group.view, mode=CacheMode.FULL)
    members = [int(i) for i in ds.pools.members[pool]]
    group.cached.hold(members)
    store.held_items |= set(members)
    first.pass_of(pool)  # as the job's first open, through Python, begins it
    return ds, jobs, first, pool, members, plane


def test_where_the_dataset_is_allotted_full_the_next_pass_is_queued_behind_the_current():
    """Once a pass has handed out every item to the plane, the next pass's hits queue
    behind them, so that the job's first opens of it are the plane's too (through
    Python, they were 3% of a cached view epoch's opens); each pass still serves every
    item once, and the next becomes the current one as the last of the first is opened."""
    ds, jobs, first, pool, members, plane = _full_view_job()
    trio.run(jobs.native._fill, first, pool)
    current, upcoming = first.pools[pool], first.upcoming[pool]
    assert plane.pushed[:len(members)] == list(current.native)
    assert sorted(plane.pushed[:len(members)]) == members
    assert sorted(plane.pushed[len(members):]) == members  # the next pass, behind
    assert (current.number, upcoming.number) == (0, 1)
    assert not first.need[members].any()  # the current pass has handed out all
    events = [(first.native_id, *_opened(plane.take(0, pool))) for _ in members]
    jobs.native.drained(events[:-1])
    assert first.pass_of(pool) is current  # one left to open
    jobs.native.drained(events[-1:])
    assert first.counters["hits"] == len(members) and not current.native
    assert first.pass_of(pool) is upcoming and not upcoming.ahead
    assert not first.need[members].any()
    assert plane.passes == [0, 1]  # the plane told the second has begun
    # counted as started once an item of it is opened (its epoch's, not the one before)
    assert first.counters["passes"] == 1
    # the next pass's first open is served from it, and counted once
    item, number = plane.take(0, pool)
    assert number == 1
    jobs.native.drained([(first.native_id, item, OPENED, 0.001, number)])
    assert item not in upcoming.native and first.counters["hits"] == len(members) + 1
    assert first.counters["passes"] == 2


def test_an_open_through_python_after_the_current_pass_is_served_gets_the_next_ones():
    """An open through Python of a job whose current pass's last hit is opened in the
    plane and not yet reported, the next pass's queued behind it: it gets an item of
    the next pass (what it takes back first is that pass's to choose again), and once
    the report is in, every item of the next pass is served once: to this open, from
    the plane's queue, or chosen again."""
    ds, jobs, first, pool, members, plane = _full_view_job()
    trio.run(jobs.native._fill, first, pool)
    current, upcoming = first.pools[pool], first.upcoming[pool]
    opened = [plane.take(0, pool)[0] for _ in members]
    last = next(i for i in opened if i != plane.queued[0][0])  # opened, not yet reported
    jobs.native.drained([(first.native_id, i, OPENED, 0.001, 0) for i in opened if i != last])

    async def open_and_report() -> Choice | None:
        async with trio.open_nursery() as nursery:
            async def report() -> None:
                await trio.sleep(0.05)
                jobs.native.drained([(first.native_id, last, OPENED, 0.001, 0)])
            nursery.start_soon(report)
            return await jobs.native.take_back(first, pool, current)
    got = trio.run(open_and_report)
    assert current.used_up and first.counters["hits"] == len(members)
    assert [i for i, _ in plane.queued] == list(upcoming.native)
    served = [*upcoming.native, *upcoming.pending_items()]
    if got is not None:
        served.append(got.index)
    assert sorted(served) == members
    assert first.pass_of(pool) is upcoming


def test_a_top_up_of_the_planes_queue_chooses_hits_only_a_miss_is_chosen_at_its_open():
    """Topping up a job's queue in the native plane where nothing of the pool is cached
    chooses nothing: the job's next open, through Python, chooses then, and an item
    loaded since is a hit. (A miss the top-up chose stayed a miss though its item was
    loaded before the open: make demo's view hit 0.36-0.38 of its items, not 0.76.)
    A hit the plane opened counts as one and no longer holds its plan's promise, which
    keeps a planned item from a chunk's eviction until it is read; one it gives back is
    chosen anew (handed out at once as a miss, the view fetched what a chunk would
    load for every job a little later)."""
    ds, group, store, jobs, first, pool, plane = _native_view_job()
    current = first.pass_of(pool)
    trio.run(jobs.native._fill, first, pool)
    assert not plane.pushed and not current.queue and current.pending.all()
    order = [int(i) for i in group.in_order(ds.pools.members[pool], 0)]
    group.cached.hold(order[:1])  # loaded since
    store.held_items.add(order[0])
    trio.run(jobs._plan, first, pool, current)  # the next open's choice
    assert [(c.index, c.hit) for c in current.queue] == [(order[0], True)]
    group.cached.hold(order[1:2])
    store.held_items.add(order[1])
    trio.run(jobs.native._fill, first, pool)  # the hits to the plane
    assert plane.pushed == order[:2] and not current.queue
    assert sorted(current.native) == sorted(order[:2])
    promised = [jobs.staging.awaiting_read(ds.digest.hash(i)) for i in order[:2]]
    assert promised == [True, True]
    jobs.native.drained([(first.native_id, order[0], OPENED, 0.001, 0)])  # opened there
    assert first.counters["hits"] == 1 and list(current.native) == [order[1]]
    promised = [jobs.staging.awaiting_read(ds.digest.hash(i)) for i in order[:2]]
    assert promised == [False, True]
    # the plane gives the other back (its file left the store): the job is yet to be
    # served it, and it is chosen anew, a hit again where cached by then
    jobs.services.store.files.seen(ds.digest.hash(order[1]))  # found when planned
    jobs.native.drained([(first.native_id, order[1], RETURNED, 0.0, 0)])
    assert not current.native and not current.queue and first.need[order[1]]
    assert jobs.services.store.files.holds(ds.digest.hash(order[1])) is None
    assert order[1] in current.pending_items() and order[0] not in current.pending_items()
    trio.run(jobs._plan, first, pool, current)
    assert [(c.index, c.hit) for c in current.queue] == [(order[1], True)]


def test_an_open_waiting_on_an_empty_queue_is_given_a_hit_else_its_miss_once_loaded():
    """An open of a job's waits in the native plane on its empty queue of a pool (a
    NEEDED event): mountd queues the pass's next hits there; where none is cached, it
    chooses the miss then, fetches it into the store and queues it, a miss (counted as
    one once opened). A fetch that fails is declined: the open comes to Python, which
    finds the miss at the head of the pass's queue and fetches it (or fails) itself.
    With no open waiting any more (a top-up served it), nothing is chosen."""
    ds, group, store, jobs, first, pool, plane = _native_view_job()
    order = [int(i) for i in group.in_order(ds.pools.members[pool], 0)]
    loaded: list[int] = []

    async def load(job: ViewJob, choice: Choice) -> bool:
        loaded.append(choice.index)
        if choice.index == order[2]:
            return False  # the bucket failed it
        store.held_items.add(choice.index)
        return True
    jobs.native._load = load

    def needed() -> None:
        jobs.native.drained([(first.native_id, pool, NEEDED, 0.0, 0)])
        trio.run(jobs.native._supply, first, pool)

    needed()  # no open waits: nothing chosen
    assert not plane.pushed and not loaded and not first.pools
    plane.waiting_opens = 1
    needed()  # nothing cached: the first of the common order, fetched, then queued
    current = first.pools[pool]
    assert loaded == plane.pushed == [order[0]] and plane.declined == 0
    assert not current.native[order[0]].hit and order[0] not in current.pending_items()
    jobs.native.drained([(first.native_id, order[0], OPENED, 0.001, 0)])
    assert (first.counters["misses"], first.counters["hits"]) == (1, 0)
    group.cached.hold(order[1:2])  # loaded since, by another job's open
    store.held_items.add(order[1])
    needed()  # a hit: queued at once
    assert plane.pushed == order[:2] and loaded == [order[0]] and current.native[order[1]].hit
    jobs.native.drained([(first.native_id, order[1], OPENED, 0.001, 0)])
    needed()  # its fetch fails: declined, the miss left for Python's open
    assert loaded == [order[0], order[2]] and plane.pushed == order[:2]
    assert plane.declined == 1 and not current.native
    assert [(c.index, c.hit) for c in current.queue] == [(order[2], False)]


def test_a_jobs_queued_hits_count_as_cached_items_ahead_of_it_for_the_readahead():
    """The readahead fills first the pools where some job has the fewest cached items
    still to open, and the hits handed out to a job and queued (here, or in the native
    plane) are among them. (Counted as had, a job's queue of hits looked like nothing
    ahead, and the readahead fetched for pools that had plenty: with the plane's queues
    of 48, the full substitution's view hit 0.85 of its items, against 0.98 counted.)"""
    ds, group, store, jobs, (first, second), pool = _two_view_jobs()
    jobs.jobs = {("t", 0, job.identity): job for job in (first, second)}
    a = group.in_order(ds.pools.members[pool], 0)
    b = group.in_order(ds.pools.members[int(ds.pools.pool_of[8])], 0)
    group.cached.hold(a[:2])
    store.held_items |= {int(i) for i in a[:2]}
    for job in (first, second):  # each is handed out a's two cached items
        trio.run(jobs._plan, job, pool, job.pass_of(pool))
        assert not job.need[a[:2]].any()
    current = first.pass_of(pool)  # the first job's are queued in the plane
    current.native.update((c.index, c) for c in current.queue)
    current.queue.clear()
    ((seen, needs),) = jobs._needs()
    assert seen is group and all(need[a[:2]].all() for need, _ in needs)
    # a has two cached items ahead of each job, b none: b's come first
    assert next_items(group, needs, 2) == [int(i) for i in b[:2]]


def test_the_readahead_fills_the_pools_with_the_fewest_cached_items_within_the_allotment():
    d = _classes_digest(8, 100)
    ds = types.SimpleNamespace(digest=d, pools=ViewPools.of(d), name="t", mean_item_bytes=100)
    group = DatasetJobs(ds, 400, None)
    group.view = _cycle(group.plan.n_chunks, (0,), 1)  # allotted one chunk: 400 bytes
    a, b = (ds.pools.members[int(ds.pools.pool_of[i])] for i in (0, 8))
    assert group.allotment() == 400 and d.path(int(a[0])).startswith("a/")
    a = group.in_order(a, 0)
    job = ViewJob("view:t:0:env:x", ds, 0, "env:x", group)
    group.cached.hold(a[:2])  # two of a's items come

    def next_up() -> list[int]:
        return next_items(group, [(job.need, job.pass_number)], 16)

    ahead = next_up()  # b has none cached: the first item of its common order
    assert ahead == [int(group.in_order(b, 0)[0])]  # 320 bytes to fill, 200 cached
    group.cached.hold(ahead)
    assert group.cached.bytes == 300 and next_up() == []
    group.cached.seen([int(a[0])], [True])  # it came
    group.cached.seen([int(a[0])], [False])  # found evicted: forgotten, and while
    assert group.cached.bytes == 200 and next_up() == []  # evictions go on, the readahead
    group.cached.forget(a[1:2])  # fills at most 0.9 of the 200 bytes cached then
    assert group.cached.bytes == 100 and next_up() == []  # 80 bytes of room: not an item
    group.cached.forget(np.asarray(ahead))
    assert next_up() == [int(a[0])]  # 180 bytes of room: one item
    group.cached.evicted_at -= EVICTION_PAUSE  # then the allotment's share again: 320
    assert next_up() == [int(a[0]), int(a[1]), int(group.in_order(b, 0)[0])]


def test_the_readahead_keeps_several_rounds_in_flight_up_to_its_bound():
    d = _classes_digest(30, 10, "abcdefgh")  # 8 classes: 128 items MAX_AHEAD
    ds = types.SimpleNamespace(digest=d, pools=ViewPools.of(d), name="t")
    group = DatasetJobs(ds, 10 * len(d), None)
    group.view = dataclasses.replace(_cycle(group.plan.n_chunks, (0,), 1),
                                     mode=CacheMode.FULL)  # the whole dataset allotted
    job = ViewJob("view:t:0:env:x", ds, 0, "env:x", group)
    rounds: list[list[int]] = []
    done = trio.Event()

    class Bulk:
        async def load(self, ds, items, counters, cause) -> None:
            rounds.append(items)
            await done.wait()  # every round stays in flight until released

    async def main() -> None:
        readahead = ViewReadahead(Bulk(), types.SimpleNamespace(wanted=lambda hashes: None),
                                  lambda: [(group, [(job.need, job.pass_number)])])
        async with trio.open_nursery() as nursery:
            nursery.start_soon(readahead.run)
            await trio.sleep(5)
            assert sum(map(len, rounds)) == IN_FLIGHT  # no more while all are in flight
            assert len(rounds) > 1 and all(len(r) <= ROUND_ITEMS for r in rounds)
            done.set()
            await trio.sleep(5)  # released: the next rounds, up to MAX_AHEAD a class
            assert sum(map(len, rounds)) == 8 * MAX_AHEAD
            nursery.cancel_scope.cancel()

    trio.run(main, clock=trio.testing.MockClock(autojump_threshold=0))
    fetched = [i for r in rounds for i in r]
    assert len(set(fetched)) == len(fetched)  # each item once

"""A cluster of real processes: a coordinator and mountd nodes on loopback."""
from __future__ import annotations

import collections
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator

import msgpack
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st

from mountd.cluster.peers import PeerService
from mountd.store.content_store import ContentStore
from quiverfs import ownership, wire
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess, unmount
from quiverfs.heartbeat import Heartbeat, to_wire
from quiverfs.rpc import RpcClient, RpcError, RpcServer, Unavailable
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest, tree_hashes

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

SECRET = b"test-cluster-secret-0123456789"
DEADLINE = 30.0  # seconds to wait for a cluster condition


class Cluster:
    """A coordinator and mountd nodes under one directory."""

    def __init__(self, base: str, coordinator_args: tuple[str, ...] = ()) -> None:
        self.base = base
        self.secret_file = os.path.join(base, "secret")
        with open(self.secret_file, "wb") as f:
            f.write(SECRET)
        self.coordinator = CoordinatorProcess(os.path.join(base, "coordinator"),
                                              self.secret_file,
                                              os.path.join(base, "coordinator.log"),
                                              extra_args=coordinator_args)
        self.nodes: dict[str, MountdProcess] = {}

    def add_node(self, name: str, cache_size: str = "1G",
                 extra_args: tuple[str, ...] = ()) -> MountdProcess:
        root = os.path.join(self.base, f"{name}-mnt")
        cache = os.path.join(self.base, f"{name}-cache")
        os.makedirs(root, exist_ok=True)
        os.makedirs(cache, exist_ok=True)
        m = MountdProcess(root, cache, cache_size, os.path.join(self.base, f"{name}.log"),
                          extra_args=("--coordinator", self.coordinator.address,
                                      "--listen", "127.0.0.1:0", "--node-id", name,
                                      "--cluster-secret-file", self.secret_file,
                                      *extra_args))
        m.start()
        self.nodes[name] = m
        return m

    def wait_for(self, condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + DEADLINE
        while not condition():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    def live_members(self, node: str) -> list[str]:
        return sorted(n["id"] for n in self.nodes[node].call({"op": "cluster"})["nodes"]
                      if n["live"])

    def stop(self) -> list[str]:
        problems = []
        for name, m in reversed(list(self.nodes.items())):
            killed = m.proc is not None and m.proc.returncode == -9
            rc = m.stop()
            if rc != 0 and not killed:
                problems.append(f"{name} exited {rc}: {m.log_tail()}")
            unmount(m.root)
        self.coordinator.stop()
        return problems


@pytest.fixture
def cluster(tmp_path) -> Iterator[Cluster]:
    c = Cluster(str(tmp_path))
    c.coordinator.start()
    yield c
    problems = c.stop()
    assert not problems, "\n".join(problems)


def start_nodes(cluster: Cluster, names: list[str], data: bytes,
                extra_args: tuple[str, ...] = ()) -> None:
    for name in names:
        cluster.add_node(name, extra_args=extra_args).call(
            {"op": "mount", "name": "syn", "digest": data})
    everyone = sorted(cluster.nodes)
    cluster.wait_for(lambda: all(cluster.live_members(n) == everyone for n in everyone),
                     "every node to see every member")


def read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_correct_bytes_from_any_node(cluster, synthetic_tree):
    start_nodes(cluster, ["a", "b", "c"], make_digest(synthetic_tree.root, "syn"))
    expected = tree_hashes(synthetic_tree.root)
    for name, m in cluster.nodes.items():  # the first node fills, the others use peers
        got = {p: hashlib.sha256(read(os.path.join(m.root, "syn", p))).hexdigest()
               for p in expected}
        assert got == expected, name
    fetched = sum(m.status()["counters"].get("bucket_fetches", 0)
                  for m in cluster.nodes.values())
    assert fetched == len(expected)  # every item came from the bucket exactly once
    assert cluster.nodes["c"].status()["counters"].get("peer_hits", 0) > 0


def test_substitutable_hits_come_from_peers_in_batches(tmp_path, synthetic_tree):
    c = Cluster(str(tmp_path), coordinator_args=("--probe-batches", "1"))
    c.coordinator.start()
    sampler = None
    try:
        start_nodes(c, ["a", "b", "c"], make_digest(synthetic_tree.root, "syn"))
        expected = tree_hashes(synthetic_tree.root)
        for p in expected:  # node a fills every owner's store
            read(os.path.join(c.nodes["a"].root, "syn", p))
        c.wait_for(lambda: sum(m.status()["cache"]["items"] for m in c.nodes.values())
                   == len(expected), "every item to reach its owner")
        root = os.path.join(c.nodes["c"].root, "syn")
        sampler = QuiverBatchSampler(root, 8, seed=2)

        def epoch(e: int) -> tuple[dict[str, str], int]:
            sampler.set_epoch(e)
            got, hits = {}, 0
            for b in range(len(sampler)):
                manifest = sampler.manifest(b)
                hits += manifest.hits
                for p in manifest.paths:
                    with open(os.path.join(root, p), "rb") as f:
                        got[p] = hashlib.sha256(f.read()).hexdigest()
                        # as for a dataset larger than RAM: the next read reaches mountd
                        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            return got, hits

        assert epoch(0)[0] == expected  # the job's first epoch starts its chunk cycle (and probe)
        c.wait_for(lambda: [cycle["mode"] for cycle in
                            c.nodes["c"].call({"op": "cluster"})["cycles"].values()] == ["full"],
                   "the coordinator to give the dataset the whole cache")
        assert epoch(1)[0] == expected  # a probe asked for late falls in this epoch
        before = c.nodes["c"].status()["counters"]
        got, hits = epoch(2)
        after = c.nodes["c"].status()["counters"]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
        assert got == expected  # every item once, each with the right bytes
        assert hits == len(expected)
        assert delta.get("bucket_fetches", 0) == 0
        assert delta.get("staged_hits", 0) >= delta["peer_hits"] > len(expected) / 3
        # one get per owning peer per batch, not one per item
        assert delta["peer_batch_gets"] <= 2 * len(sampler)
    finally:
        if sampler is not None:
            sampler.close()
        problems = c.stop()
    assert not problems, "\n".join(problems)


PLANNERS = 3  # jobs planning batches at once on one node
THREADS = 1  # that node's blocking workers: fewer than its planners
MAX_EPOCHS = 20


def test_more_planners_than_worker_threads_finish(tmp_path, synthetic_tree):
    """A planner asks the store and the peers about candidates between its steps, so
    planners never hold every worker while waiting for one (a deadlock before)."""
    c = Cluster(str(tmp_path), coordinator_args=("--probe-batches", "1"))
    c.coordinator.start()
    try:
        start_nodes(c, ["a", "b"], make_digest(synthetic_tree.root, "syn"),
                    extra_args=("--threads", str(THREADS)))
        expected = tree_hashes(synthetic_tree.root)
        root = os.path.join(c.nodes["a"].root, "syn")
        for p in expected:  # cached at both owners: planning asks the store and the peer
            read(os.path.join(root, p))
        wrong: list[tuple[int, int]] = []  # (job, epoch) that did not see every item once
        hits = collections.Counter[int]()

        def job(n: int) -> None:
            sampler = QuiverBatchSampler(root, 4, seed=n)
            try:
                # until an epoch had hits: the first ones come before the coordinator's
                # first answer, or are probed, and are planned without look-ups
                for epoch in range(MAX_EPOCHS):
                    sampler.set_epoch(epoch)
                    got = {}
                    for b in range(len(sampler)):
                        manifest = sampler.manifest(b)
                        hits[n] += manifest.hits
                        for p in manifest.paths:
                            got[p] = hashlib.sha256(read(os.path.join(root, p))).hexdigest()
                    if got != expected:
                        wrong.append((n, epoch))
                    if hits[n]:
                        return
            finally:
                sampler.close()

        threads = [threading.Thread(target=job, args=(n,), daemon=True)
                   for n in range(PLANNERS)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 2 * DEADLINE
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in threads), "planners are stuck"
        assert not wrong
        assert all(hits[n] > 0 for n in range(PLANNERS))  # the look-ups did find items
    finally:
        problems = c.stop()
    assert not problems, "\n".join(problems)


def test_ownership_rebalances_when_nodes_join_and_leave(cluster, synthetic_tree):
    data = make_digest(synthetic_tree.root, "syn")
    start_nodes(cluster, ["a", "b"], data)
    shares = {n["id"]: n["share"] for n in cluster.nodes["a"].call({"op": "cluster"})["nodes"]}
    assert set(shares) == {"a", "b"} and all(s > 0.2 for s in shares.values())
    start_nodes(cluster, ["c"], data)
    cluster.wait_for(lambda: cluster.live_members("a") == ["a", "b", "c"], "c to join")
    nodes = cluster.nodes["a"].call({"op": "cluster"})["nodes"]
    assert abs(sum(n["share"] for n in nodes) - 1.0) < 0.01
    assert all(n["share"] > 0.15 for n in nodes)
    cluster.nodes["c"].stop()
    cluster.wait_for(lambda: cluster.live_members("a") == ["a", "b"], "c to be declared dead")
    nodes = cluster.nodes["a"].call({"op": "cluster"})["nodes"]
    assert sum(n["share"] for n in nodes if n["live"]) == pytest.approx(1.0, abs=0.01)
    # keys move only from the node that left
    keys = [hashlib.sha256(str(i).encode()).digest() for i in range(2000)]
    before = {k: ownership.owner(k, ["a", "b", "c"]) for k in keys}
    after = {k: ownership.owner(k, ["a", "b"]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "c")


def test_peer_killed_mid_epoch_no_errors_and_exactly_once(cluster, digits_tree):
    start_nodes(cluster, ["a", "b", "c"], make_digest(digits_tree.root, "syn"))
    everything = sorted(tree_hashes(digits_tree.root))
    root = os.path.join(cluster.nodes["a"].root, "syn")
    sampler = QuiverBatchSampler(root, 32, seed=5)
    try:
        paths: list[str] = []
        sampler.set_epoch(0)
        for b in range(len(sampler)):
            batch = sampler.manifest(b).paths
            for p in batch:  # the job reads every item it is given
                assert len(read(os.path.join(root, p))) > 0
            paths += batch
            if b == 10:
                cluster.nodes["c"].kill()
        assert sorted(paths) == everything
        # exact reads of every item still work, from survivors or the bucket
        for p in everything:
            assert read(os.path.join(root, p)) == read(os.path.join(digits_tree.root, p))
    finally:
        sampler.close()
    cluster.wait_for(lambda: cluster.live_members("a") == ["a", "b"], "c to be declared dead")


def test_coordinator_restart(cluster, synthetic_tree):
    start_nodes(cluster, ["a", "b"], make_digest(synthetic_tree.root, "syn"))
    expected = tree_hashes(synthetic_tree.root)
    cluster.coordinator.stop()
    a = cluster.nodes["a"]
    cluster.wait_for(lambda: not a.call({"op": "cluster"})["coordinator_ok"],
                     "a to notice the outage")
    for p in expected:  # reads go on without the coordinator
        assert hashlib.sha256(read(os.path.join(a.root, "syn", p))).hexdigest() == expected[p]
    cluster.coordinator.start()
    cluster.wait_for(lambda: a.call({"op": "cluster"})["coordinator_ok"], "a to reconnect")
    cluster.wait_for(lambda: cluster.live_members("b") == ["a", "b"], "membership to resume")


def rpc_call(port: int, secret: bytes, op: str, args: dict) -> object:
    """One RPC call to the server on ``port``; an error reply is raised as RpcError, an
    unreachable or refusing server as Unavailable."""
    async def main() -> dict:
        client = RpcClient("127.0.0.1", port, secret, timeout=5)
        out: dict = {}
        async with trio.open_nursery() as nursery:
            await nursery.start(client.tasks.run)
            try:
                out["result"] = await client.call(op, args)
            except (RpcError, Unavailable) as exc:  # raised outside the nursery, not in a group
                out["error"] = exc
            nursery.cancel_scope.cancel()
        return out
    out = trio.run(main)
    if "error" in out:
        raise out["error"]
    return out["result"]


def peer_port(m: MountdProcess) -> int:
    me = m.call({"op": "cluster"})
    return int(next(n["peer"] for n in me["nodes"] if n["id"] == me["node"]).rsplit(":", 1)[1])


def test_poisoned_put_is_rejected(cluster, synthetic_tree):
    start_nodes(cluster, ["a"], make_digest(synthetic_tree.root, "syn"))
    port = peer_port(cluster.nodes["a"])
    good = b"real content"
    claimed = hashlib.sha256(b"other content").digest()
    assert rpc_call(port, SECRET, "put", {"items": [[claimed, good]]}) == [False]
    assert rpc_call(port, SECRET, "lookup", {"hashes": [claimed]}) == [False]
    honest = hashlib.sha256(good).digest()
    assert rpc_call(port, SECRET, "put", {"items": [[honest, good]]}) == [True]
    assert rpc_call(port, SECRET, "get", {"hashes": [honest]}) == [good]
    assert cluster.nodes["a"].call({"op": "cluster"})["rejected_puts"] == 1
    assert "rejected a put" in cluster.nodes["a"].log_tail(50)


def test_unauthenticated_clients_get_nothing(cluster, synthetic_tree):
    start_nodes(cluster, ["a"], make_digest(synthetic_tree.root, "syn"))
    port = peer_port(cluster.nodes["a"])
    with pytest.raises(Unavailable):
        rpc_call(port, b"wrong-secret-wrong-secret", "get", {"hashes": [b"\0" * 32]})

    async def no_handshake() -> list[object]:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await wire.recv_frame(stream, 4096)  # the challenge
            await wire.send_msg(stream, {"id": 1, "op": "get", "args": {"hashes": []}})
            replies = []
            try:
                while True:
                    replies.append(wire.unpack(await wire.recv_frame(stream)))
            except (EOFError, trio.BrokenResourceError):
                return replies
    replies = trio.run(no_handshake)
    assert replies == [{"ok": False, "error": "authentication failed"}]
    # the coordinator refuses too
    with pytest.raises(Unavailable):
        rpc_call(int(cluster.coordinator.address.rsplit(":", 1)[1]), b"x" * 20, "status", {})


def test_malformed_and_oversized_frames_get_error_replies(cluster, synthetic_tree):
    start_nodes(cluster, ["a"], make_digest(synthetic_tree.root, "syn"))
    port = peer_port(cluster.nodes["a"])

    async def abuse() -> list[dict]:
        from quiverfs.rpc import client_handshake
        out = []
        for frame in (b"\xc1\xc1", msgpack.packb([1, 2]), msgpack.packb({"id": 3, "op": "get",
                      "args": {"hashes": ["nope"]}}), msgpack.packb({"id": 4, "op": "zap"})):
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await client_handshake(stream, SECRET)
                await stream.send_all(wire.HEADER.pack(len(frame)) + frame)
                out.append(wire.unpack(await wire.recv_frame(stream)))
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await client_handshake(stream, SECRET)
            await stream.send_all(wire.HEADER.pack(1 << 30))  # 1 GiB announced
            out.append(wire.unpack(await wire.recv_frame(stream)))
        return out
    replies = trio.run(abuse)
    assert all(r["ok"] is False and r["error"] for r in replies)
    assert "exceeds" in replies[-1]["error"]
    # the server is still up and serving
    assert rpc_call(port, SECRET, "lookup", {"hashes": [b"\0" * 32]}) == [False]


MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.binary(max_size=40)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4),
    max_leaves=12)
REQUESTS = st.fixed_dictionaries({"id": MSGPACK_VALUES,
                                  "op": st.sampled_from(["get", "lookup", "put", "loaded",
                                                         "zap"]),
                                  "args": MSGPACK_VALUES})


@pytest.fixture(scope="module")
def fuzz_store(tmp_path_factory) -> Iterator[ContentStore]:
    store = ContentStore(str(tmp_path_factory.mktemp("fuzz-store")), 1 << 20)
    yield store
    store.close()


@settings(max_examples=300, deadline=None)
@given(body=st.one_of(st.binary(max_size=300), st.builds(msgpack.packb, MSGPACK_VALUES),
                      st.builds(msgpack.packb, REQUESTS)))
def test_rpc_decoder_fuzz_never_crashes(fuzz_store, body):
    """Random frames into the real peer handlers and store: always a reply, never a crash."""
    async def dispatch() -> dict:
        service = PeerService(fuzz_store, trio.CapacityLimiter(2), lambda identity: None)
        return await RpcServer(SECRET, service.handlers())._dispatch(body)

    reply = trio.run(dispatch)
    assert isinstance(reply, dict) and set(reply) <= {"id", "ok", "result", "error"}
    assert reply["ok"] in (True, False)


@pytest.mark.parametrize("dataset, woken", [
    ("ab" * 32, ["ab" * 32]), ("AB" * 32, []), ("ab" * 33, []), ("../x", []), (7, [])])
def test_a_peers_loaded_call_wakes_only_a_dataset_identity(fuzz_store, dataset, woken):
    """``loaded`` (another node stored more of a loading chunk) wakes the jobs waiting on
    that dataset; anything but a digest identity is an error reply."""
    called: list[str] = []

    async def dispatch() -> dict:
        service = PeerService(fuzz_store, trio.CapacityLimiter(2), called.append)
        body = msgpack.packb({"id": 1, "op": "loaded", "args": {"dataset": dataset}})
        return await RpcServer(SECRET, service.handlers())._dispatch(body)

    reply = trio.run(dispatch)
    assert called == woken and reply["ok"] is bool(woken)


def test_node_rejoining_with_its_old_cache_reuses_it(cluster, synthetic_tree):
    start_nodes(cluster, ["a", "b"], make_digest(synthetic_tree.root, "syn"))
    expected = tree_hashes(synthetic_tree.root)
    b = cluster.nodes["b"]
    for p in expected:
        read(os.path.join(b.root, "syn", p))
    held_before = b.status()["cache"]["items"]
    assert held_before > 0
    # b's puts to a are sent in the background: let them land before b goes
    cluster.wait_for(lambda: held_before + cluster.nodes["a"].status()["cache"]["items"]
                     == len(expected), "every item to reach its owner")
    assert b.stop() == 0
    b.start()  # same node id, same cache directory
    cluster.wait_for(lambda: cluster.live_members("b") == ["a", "b"], "b to rejoin")
    for p in expected:
        assert hashlib.sha256(read(os.path.join(b.root, "syn", p))).hexdigest() == expected[p]
    counters = b.status()["counters"]
    assert counters["local_hits"] == held_before  # its own share came from its old cache
    assert counters.get("bucket_fetches", 0) == 0


def coordinator_nodes(cluster: Cluster) -> dict[str, bool]:
    """The members the coordinator knows of: id -> alive."""
    port = int(cluster.coordinator.address.rsplit(":", 1)[1])
    return {n["id"]: n["alive"] for n in rpc_call(port, SECRET, "status", {})["nodes"]}


def test_a_node_that_stopped_beating_is_forgotten_also_after_a_restart(tmp_path,
                                                                       synthetic_tree):
    c = Cluster(str(tmp_path), coordinator_args=("--forget-after", "3"))
    c.coordinator.start()
    try:
        start_nodes(c, ["a", "b"], make_digest(synthetic_tree.root, "syn"))
        assert c.nodes["b"].stop() == 0
        c.wait_for(lambda: list(coordinator_nodes(c)) == ["a"], "b to be forgotten")
        c.coordinator.stop()
        c.coordinator.start()
        assert "b" not in coordinator_nodes(c)
        c.wait_for(lambda: coordinator_nodes(c) == {"a": True}, "a to beat again")
        assert c.live_members("a") == ["a"]
    finally:
        problems = c.stop()
    assert not problems, "\n".join(problems)


def test_a_coordinator_restart_revives_no_dead_node(cluster):
    """A node dead before the restart is dead after it (it is kept until forgotten)."""
    port = int(cluster.coordinator.address.rsplit(":", 1)[1])
    rpc_call(port, SECRET, "heartbeat", to_wire(Heartbeat("ghost", "127.0.0.1:9", 100)))
    cluster.wait_for(lambda: coordinator_nodes(cluster) == {"ghost": False},
                     "the ghost to be dead")
    cluster.coordinator.stop()
    cluster.coordinator.start()
    assert coordinator_nodes(cluster) == {"ghost": False}

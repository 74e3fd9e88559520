"""The node-coordinator protocol: typed records, checked on the way in, driving the
coordinator's chunk cycles."""
from __future__ import annotations

import json
import os
import time

import msgpack
import pytest
import trio

from coordinator.embedded import EmbeddedCoordinator
from coordinator.server import CoordinatorServer
from coordinator.state import CoordinatorState
from mountd.cluster.membership import Cluster
from quiverfs.chunk_cycle import FORCE_EVICT_AFTER, ChunkState
from quiverfs.heartbeat import (MAX_CHUNKS, PROBE_BATCHES, CacheMode, DatasetReport, Heartbeat,
                                HeartbeatReply, JobReport, LoadedShare, from_wire, refusal,
                                to_wire)

CHUNKS = 4


def beat(node: str, loaded: tuple[LoadedShare, ...] = (), gen: int = 0) -> Heartbeat:
    job = JobReport(id=f"{node}-job", gen=gen, gpus=1, remaining=(5,) * CHUNKS, probe_seq=0)
    report = DatasetReport(name="ds", chunks=CHUNKS, size=4000, chunk_bytes=500,
                           loaded=loaded, jobs=(job,))
    return Heartbeat(node, f"127.0.0.1:{len(node)}", 1500, {"ident": report})  # COOP fits


def over_the_wire(record: object, kind: type) -> object:
    return from_wire(msgpack.unpackb(msgpack.packb(to_wire(record)), raw=False), kind)


def test_records_survive_the_wire():
    hb = beat("a", loaded=(LoadedShare(1, ("a", "b")),))
    assert over_the_wire(hb, Heartbeat) == hb


@pytest.mark.parametrize("mangle, field", [
    (lambda w: w.update(node=5), "node"),
    (lambda w: w.pop("capacity"), "capacity"),
    (lambda w: w["datasets"]["ident"].update(chunks="4"), "chunks"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(remaining=[1, "x"]), "remaining"),
    (lambda w: w["datasets"]["ident"].update(loaded=[[1, "a"]]), "loaded"),
    (lambda w: w.update(datasets=[]), "datasets"),
    # out of range
    (lambda w: w.update(capacity=-1), "capacity"),
    (lambda w: w.update(capacity=1 << 63), "capacity"),
    (lambda w: w.update(node="a/b"), "node"),
    (lambda w: w.update(node="a\n"), "node"),
    (lambda w: w.update(node=""), "node"),
    (lambda w: w.update(node="a" * 254), "node"),
    (lambda w: w.update(peer="1" * 301), "peer"),
    (lambda w: w["datasets"]["ident"].update(chunks=0), "chunks"),
    (lambda w: w["datasets"]["ident"].update(chunks=MAX_CHUNKS + 1), "chunks"),
    (lambda w: w["datasets"]["ident"].update(size=-5), "size"),
    (lambda w: w["datasets"]["ident"].update(chunk_bytes=-1), "chunk_bytes"),
    (lambda w: w["datasets"]["ident"].update(name="x" * 256), "name"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(gpus=0), "gpus"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(gen=-1), "gen"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(probe_seq=-1), "probe_seq"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(remaining=[5, 5, -1, 5]), "remaining"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(t_miss=float("nan")), "t_miss"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(t_hit=float("inf")), "t_hit"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(t_hit=-0.5), "t_hit"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(id="j" * 1025), "id"),
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(batch_bytes=-1), "batch_bytes"),
    (lambda w: w.update(bucket_bps=0.0), "bucket_bps"),
    (lambda w: w.update(bucket_bps=float("nan")), "bucket_bps"),
    (lambda w: w.update(bucket_bps=1e300), "bucket_bps"),
    (lambda w: w["datasets"]["ident"].update(
        loaded=[{"chunk": 0, "loaders": ["a/b"]}]), "loaders"),
    (lambda w: w.update(datasets={"i" * 1025: w["datasets"]["ident"]}), "datasets"),
    # fields that disagree
    (lambda w: w["datasets"]["ident"]["jobs"][0].update(remaining=[5, 5]), "reports 2 chunks"),
    (lambda w: w["datasets"]["ident"].update(
        loaded=[{"chunk": 4, "loaders": ["a"]}]), "loaded chunk 4"),
])
def test_a_malformed_heartbeat_is_refused_naming_the_field(mangle, field):
    wire = to_wire(beat("a"))
    mangle(wire)
    with pytest.raises(ValueError, match=f"malformed Heartbeat: .*{field}"):
        from_wire(wire, Heartbeat)


async def test_the_coordinator_answers_a_malformed_heartbeat_with_an_error(tmp_path):
    server = CoordinatorServer(CoordinatorState(str(tmp_path)), b"s" * 16, ("127.0.0.1", 0))
    with pytest.raises(ValueError):
        await server.heartbeat({"node": "a", "peer": "p", "capacity": "lots"})
    reply = from_wire(await server.heartbeat(to_wire(beat("a"))), HeartbeatReply)
    assert [m.id for m in reply.nodes] == ["a"]


def test_typed_reports_drive_the_cycle_and_survive_a_restart(tmp_path):
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0)
    first = state.heartbeat(beat("a"), now=1.0).cycles["ident"]
    assert first.mode is CacheMode.COOP
    assert first.loading == (0, 1) and first.capacity == 2  # two chunks fit the budget
    assert [load.loaders for load in first.loads] == [("a",), ("a",)]
    assert first.users == ("a",) and first.states[0] is ChunkState.LOADING
    state.heartbeat(beat("b"), now=1.1)  # b joins while a loads chunks 0 and 1 alone
    done = (LoadedShare(0, ("a",)), LoadedShare(1, ("a",)))
    view = state.heartbeat(beat("a", loaded=done), now=1.2).cycles["ident"]
    # b's cache deepens the cycle to the whole dataset; the next chunks load, by both
    assert view.capacity == 4 and view.active == (0, 1) and view.loading == (2, 3)
    assert [load.loaders for load in view.loads] == [("a", "b")] * 2
    assert view.users == ("a", "b") and view.marked == {}
    assert view.usable(beat("a").datasets["ident"].jobs[0].epoch_ref()) == [0, 1, 2, 3]

    data = state.changes()
    assert data is not None and state.changes() is None  # once per change
    state.write(data)
    again = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0)
    cycle = again.datasets["ident"].cycle
    assert (cycle.resident, cycle.loading, cycle.next) == ([0, 1, 2, 3], [2, 3], 0)
    assert again.datasets["ident"].mode is CacheMode.COOP


async def test_a_heartbeat_out_of_range_changes_nothing_at_the_coordinator(tmp_path):
    """Refused on the way in (an error reply), before the state sees it."""
    state = CoordinatorState(str(tmp_path))
    server = CoordinatorServer(state, b"s" * 16, ("127.0.0.1", 0))
    for mangle in (lambda w: w.update(capacity=-1),
                   lambda w: w["datasets"]["ident"]["jobs"][0].update(t_miss=float("nan")),
                   lambda w: w["datasets"]["ident"].update(chunks=MAX_CHUNKS + 1)):
        wire = to_wire(beat("a"))
        mangle(wire)
        with pytest.raises(ValueError, match="malformed Heartbeat"):
            await server.heartbeat(wire)
    assert state.nodes == {} and state.datasets == {} and state.changes() is None


def test_chunk_counts_that_disagree_between_live_nodes_are_refused(tmp_path):
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0)
    state.heartbeat(beat("a"), now=1.0)
    before = state.snapshot()
    job = JobReport(id="b-job", gen=0, gpus=1, remaining=(5,) * 8, probe_seq=0)
    other = Heartbeat("b", "127.0.0.1:2", 1500, {"ident": DatasetReport(
        name="ds", chunks=8, size=4000, chunk_bytes=500, jobs=(job,))})
    with pytest.raises(ValueError, match="node b plans 8 chunks, node a 4.*--chunk-size"):
        state.heartbeat(other, now=1.1)
    assert "b" not in state.nodes and state.snapshot() == before
    # once a is gone, the plan of the one node left is the dataset's
    assert state.heartbeat(other, now=100.0).cycles["ident"].chunks == 8


async def test_a_node_leaves_out_a_report_out_of_range_and_beats_on(tmp_path):
    """A report the coordinator would refuse (a crafted digest planned into too many
    chunks) is left out by the node, not sent to get its whole heartbeat refused."""
    link = EmbeddedCoordinator(str(tmp_path), FORCE_EVICT_AFTER, PROBE_BATCHES,
                               trio.CapacityLimiter(1))
    cluster = Cluster("node", "local", 1500, link, None)
    crafted = DatasetReport(name="crafted", chunks=MAX_CHUNKS + 1, size=1, chunk_bytes=1)
    assert "chunks" in refusal(crafted)
    reports = {"ident": beat("node").datasets["ident"], "crafted": crafted}
    applied: list[list[str]] = []

    async def apply(cycles: dict, version: int) -> None:
        applied.append(sorted(cycles))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cluster.run, lambda: reports, apply, lambda: 2e6)
        await cluster.synced.wait()
        nursery.cancel_scope.cancel()
    assert applied == [["ident"]] and list(link.state.datasets) == ["ident"]
    assert link.state.bucket_bandwidth(link.state.now()) == 2e6  # what its fetches measured


async def test_the_embedded_coordinator_writes_its_state_off_the_heartbeats_path(tmp_path):
    """A heartbeat's reply does not wait for the state file: the link's own task writes
    it after the beats that changed it, and once more as it stops."""
    link = EmbeddedCoordinator(str(tmp_path), FORCE_EVICT_AFTER, PROBE_BATCHES,
                               trio.CapacityLimiter(1))
    path = tmp_path / "coordinator.json"
    await link.heartbeat(beat("a"))
    assert not path.exists()  # not by the beat itself
    async with trio.open_nursery() as nursery:
        await nursery.start(link.run)
        with trio.fail_after(10):
            while not path.exists():
                await trio.sleep(0.01)
        await link.heartbeat(beat("b"))  # within a second of the first write
        nursery.cancel_scope.cancel()
    saved = json.loads(path.read_text())
    assert sorted(n["id"] for n in saved["nodes"]) == ["a", "b"]  # written as it stopped
    restarted = EmbeddedCoordinator(str(tmp_path), FORCE_EVICT_AFTER, PROBE_BATCHES,
                                    trio.CapacityLimiter(1))
    assert sorted(restarted.state.nodes) == ["a", "b"]


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), 0.0, -1.0])
async def test_a_bandwidth_out_of_range_is_not_reported(tmp_path, rate):
    link = EmbeddedCoordinator(str(tmp_path), FORCE_EVICT_AFTER, PROBE_BATCHES,
                               trio.CapacityLimiter(1))
    cluster = Cluster("node", "local", 1500, link, None)

    async def apply(cycles: dict, version: int) -> None:
        pass

    async with trio.open_nursery() as nursery:
        nursery.start_soon(cluster.run, lambda: {}, apply, lambda: rate)
        await cluster.synced.wait()
        nursery.cancel_scope.cancel()
    assert link.state.bucket_bandwidth(link.state.now()) is None


def test_a_silent_node_is_forgotten_everywhere(tmp_path):
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=5.0, forget_after=10.0)
    state.heartbeat(beat("a"), now=1.0)
    state.heartbeat(beat("b"), now=1.1)
    done = (LoadedShare(0, ("a",)), LoadedShare(1, ("a",)))
    view = state.heartbeat(beat("a", loaded=done), now=1.2).cycles["ident"]
    assert [load.loaders for load in view.loads] == [("a", "b")] * 2  # b loads a share
    ds = state.datasets["ident"]
    ds.probes["b/b-job"], ds.probed_at["b/b-job"] = 1, 1.1
    state.heartbeat(beat("a"), now=8.0)  # b is dead, not yet forgotten
    assert [n["id"] for n in state.status(now=8.0)["nodes"]] == ["a", "b"]
    assert state.forget(now=11.0) == []  # 9.9 s of its silence counted: not yet
    state.heartbeat(beat("a"), now=11.2)
    assert list(state.nodes) == ["a"]
    assert list(ds.reports) == ["a"]
    assert all("b" not in loaders for loaders in ds.loaders.values())
    assert not any(key.startswith("b/") for key in ds.probes)
    assert [n["id"] for n in state.status(now=11.2)["nodes"]] == ["a"]


def test_forgetting_needs_no_heartbeat(tmp_path):
    """The coordinator's own timer calls forget(): a cluster gone quiet forgets too."""
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=5.0, forget_after=10.0)
    state.heartbeat(beat("a"), now=1.0)
    state.changes()
    assert state.forget(now=10.9) == [] and state.changes() is None
    assert state.forget(now=11.1) == ["a"] and state.nodes == {}
    assert state.changes() is not None  # saved: a restart does not bring it back


def saved_state(tmp_path, beats: list[tuple[str, float]], **options) -> CoordinatorState:
    """A state that heard ``beats`` (node, seconds ago), written and read back."""
    state = CoordinatorState(str(tmp_path), **options)
    for node, ago in beats:
        state.heartbeat(beat(node), now=state.now() - ago)
    state.save()
    return CoordinatorState(str(tmp_path), **options)


def test_a_restart_revives_no_dead_node(tmp_path):
    again = saved_state(tmp_path, [("a", 20.0), ("b", 0.0)], heartbeat_timeout=5.0,
                        forget_after=60.0)
    assert sorted(again.nodes) == ["a", "b"]  # a is dead but not forgotten
    assert [n.id for n in again.live()] == ["b"]
    assert [m.id for m in again.heartbeat(beat("b")).nodes] == ["b"]


def test_a_restart_forgets_the_nodes_whose_time_had_come(tmp_path):
    again = saved_state(tmp_path, [("a", 20.0), ("b", 0.0)], heartbeat_timeout=5.0,
                        forget_after=10.0)
    assert list(again.nodes) == ["b"]
    assert list(again.datasets) == ["ident"]  # the cycles stay


def test_a_state_file_without_last_seen_times_revives_no_node(tmp_path):
    """Written before the times were kept: its nodes count as never heard from; a live
    one joins again with its next heartbeat."""
    state = CoordinatorState(str(tmp_path))
    state.heartbeat(beat("a"))
    data = json.loads(state.snapshot())
    for node in data["nodes"]:
        del node["silent_s"]
    with open(os.path.join(tmp_path, "coordinator.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    again = CoordinatorState(str(tmp_path))
    assert again.nodes == {} and list(again.datasets) == ["ident"]
    assert [m.id for m in again.heartbeat(beat("a")).nodes] == ["a"]


def test_a_state_file_with_wall_clock_times_measures_silences_from_its_latest(tmp_path):
    """Written when last-seen times were wall-clock: the time since it was written is no
    node's silence, but a node dead then is dead after the restart."""
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=5.0, forget_after=60.0)
    state.heartbeat(beat("a"))
    state.heartbeat(beat("b"))
    data = json.loads(state.snapshot())
    written = time.time() - 3600.0  # an hour before this start
    for node, ago in zip(data["nodes"], (20.0, 0.0)):
        del node["silent_s"]
        node["last_seen"] = written - ago
    with open(os.path.join(tmp_path, "coordinator.json"), "w", encoding="utf-8") as f:
        json.dump(data, f)
    again = CoordinatorState(str(tmp_path), heartbeat_timeout=5.0, forget_after=60.0)
    assert {n["id"]: n["alive"] for n in again.status()["nodes"]} == {"a": False, "b": True}


def test_silences_are_saved_at_least_once_a_heartbeat_timeout(tmp_path):
    state = CoordinatorState(str(tmp_path), heartbeat_timeout=5.0)
    state.heartbeat(beat("a"), now=1.0)
    assert state.changes() is not None
    state.heartbeat(beat("a"), now=2.0)
    assert state.changes() is None  # nothing changed but the time
    state.heartbeat(beat("a"), now=6.5)
    data = state.changes()  # a heartbeat timeout since the last save
    assert data is not None and [n["id"] for n in json.loads(data)["nodes"]] == ["a"]

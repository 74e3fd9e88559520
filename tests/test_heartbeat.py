"""The node-coordinator protocol: typed records, checked on the way in, driving the
coordinator's chunk cycles."""
from __future__ import annotations

import msgpack
import pytest

from coordinator.server import CoordinatorServer
from coordinator.state import CoordinatorState
from quiverfs.chunk_cycle import ChunkState
from quiverfs.heartbeat import (CacheMode, DatasetReport, Heartbeat, HeartbeatReply, JobReport,
                                LoadedShare, from_wire, to_wire)

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
    assert view.users == ("a", "b") and view.marked is None
    assert view.usable(beat("a").datasets["ident"].jobs[0].epoch_ref()) == [0, 1, 2, 3]

    data = state.changes()
    assert data is not None and state.changes() is None  # once per change
    state.write(data)
    again = CoordinatorState(str(tmp_path), heartbeat_timeout=60.0)
    cycle = again.datasets["ident"].cycle
    assert (cycle.resident, cycle.loading, cycle.next) == ([0, 1, 2, 3], [2, 3], 0)
    assert again.datasets["ident"].mode is CacheMode.COOP

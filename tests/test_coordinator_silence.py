"""Silence is counted while the coordinator runs, and what no node reports is forgotten:
a real ``quiver coordinator`` process, with real mountd nodes or heartbeats over RPC."""
from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Callable

import pytest

from quiverfs.bench.processes import free_port
from quiverfs.heartbeat import (DatasetReport, Heartbeat, HeartbeatReply, JobReport,
                                LoadedShare, from_wire, to_wire)
from quiverfs.torch import QuiverBatchSampler
from tests.mountd_helpers import make_digest
from tests.test_cluster import SECRET, Cluster, rpc_call, start_nodes
from tests.test_metrics import scrape, value

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

HEARTBEAT_TIMEOUT = 2.0  # CoordinatorProcess's default
FORGET_AFTER = 3.0
CHUNKS = 4


def status(c: Cluster) -> dict:
    return rpc_call(int(c.coordinator.address.rsplit(":", 1)[1]), SECRET, "status", {})


def nodes(c: Cluster) -> dict[str, bool]:
    """The members the coordinator knows of: id -> alive."""
    return {n["id"]: n["alive"] for n in status(c)["nodes"]}


def loaders(c: Cluster) -> dict[str, dict[str, list[str]]]:
    """Per dataset identity, the nodes loading each loading chunk."""
    return {d["identity"]: d["loaders"] for d in status(c)["datasets"]}


def jobs(c: Cluster) -> dict[str, list[str]]:
    """Per dataset identity, the nodes of the jobs the coordinator counts."""
    return {d["identity"]: [j["node"] for j in d["jobs"]] for d in status(c)["datasets"]}


def beat(c: Cluster, node: str, datasets: tuple[str, ...] = ("ident",),
         loaded: tuple[LoadedShare, ...] = ()) -> HeartbeatReply:
    """One heartbeat from ``node`` (a job on each of ``datasets``) over RPC."""
    job = JobReport(id=f"{node}-job", gen=0, gpus=1, remaining=(5,) * CHUNKS, probe_seq=0)
    report = DatasetReport(name="ds", chunks=CHUNKS, size=4000, chunk_bytes=500,
                           loaded=loaded, jobs=(job,))
    reply = rpc_call(int(c.coordinator.address.rsplit(":", 1)[1]), SECRET, "heartbeat",
                     to_wire(Heartbeat(node, f"127.0.0.1:{9000 + len(node)}", 1500,
                                       {d: report for d in datasets})))
    return from_wire(reply, HeartbeatReply)


def log_since(c: Cluster, offset: int) -> str:
    with open(c.coordinator.log_path, encoding="utf-8") as f:
        f.seek(offset)
        return f.read()


def stop_for(c: Cluster, seconds: float) -> None:
    """SIGSTOP the coordinator for ``seconds`` (the pause is the test's stimulus, not a
    wait for a condition)."""
    c.coordinator.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        c.coordinator.proc.send_signal(signal.SIGCONT)


def restart_after(c: Cluster, seconds: float) -> None:
    """Stop the coordinator (SIGTERM), and start it again from its state directory
    ``seconds`` later."""
    assert c.coordinator.stop() == 0
    time.sleep(seconds)
    c.coordinator.start()


def kill_and_restart_after(c: Cluster, seconds: float) -> None:
    """SIGKILL the coordinator (its state file is as its last periodic save left it),
    and start it again ``seconds`` later."""
    c.coordinator.proc.kill()
    c.coordinator.proc.wait()
    time.sleep(seconds)
    c.coordinator.start()


OUTAGES: dict[str, Callable[[Cluster, float], None]] = {
    "stopped": stop_for, "restarted": restart_after, "killed": kill_and_restart_after}


@pytest.fixture
def cluster(tmp_path, request):
    c = Cluster(str(tmp_path), coordinator_args=getattr(request, "param", (
        "--forget-after", str(FORGET_AFTER))))
    c.coordinator.start()
    yield c
    problems = c.stop()
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("outage", OUTAGES)
def test_an_outage_longer_than_forget_after_counts_no_node_dead(cluster, outage,
                                                                synthetic_tree):
    """Real nodes beat on while the coordinator is stopped or down: once it runs again,
    neither is forgotten nor counted dead, and the membership keeps its version."""
    start_nodes(cluster, ["a", "b"], make_digest(synthetic_tree.root, "syn"))
    before = status(cluster)
    logged = os.path.getsize(cluster.coordinator.log_path)
    OUTAGES[outage](cluster, FORGET_AFTER + 1.0)
    # For two heartbeat timeouts once it runs again: a node counted dead would show
    end = time.monotonic() + 2 * HEARTBEAT_TIMEOUT
    while time.monotonic() < end:
        now = status(cluster)
        assert {n["id"]: n["alive"] for n in now["nodes"]} == {"a": True, "b": True}, now
        # a restart counts one version (nodes recompute owners, the same ones)
        assert now["version"] == before["version"] + (outage != "stopped"), now
    for node in ("a", "b"):
        assert cluster.live_members(node) == ["a", "b"]
    after = log_since(cluster, logged)
    for line in ("forgot node", "declared dead", "joined", "is back"):
        assert line not in after, after


@pytest.mark.parametrize("outage", OUTAGES)
def test_an_outage_longer_than_forget_after_moves_no_chunk_load(cluster, outage):
    """Nodes sharing a chunk's load keep their shares across the outage; a node that
    stays silent while the coordinator runs is still dead one heartbeat timeout later."""
    first = beat(cluster, "a").cycles["ident"].loads  # a alone loads the first chunks
    beat(cluster, "b")
    beat(cluster, "a", loaded=first)  # a and b load the next ones
    shares = loaders(cluster)
    assert shares["ident"] and all(n == ["a", "b"] for n in shares["ident"].values()), shares
    OUTAGES[outage](cluster, FORGET_AFTER + 1.0)
    assert nodes(cluster) == {"a": True, "b": True}  # before either beats again
    left_out = status(cluster)["not_running_s"]  # a restart's downtime is no process's
    assert (left_out >= FORGET_AFTER + 1.0) == (outage == "stopped"), left_out
    assert loaders(cluster) == shares
    assert [m.id for m in beat(cluster, "a").nodes] == ["a", "b"]
    assert loaders(cluster) == shares
    cluster.wait_for(lambda: beat(cluster, "a") and not nodes(cluster).get("b"),
                     "b, silent while the coordinator runs, to be dead")


METRICS_PORT = free_port()


@pytest.mark.parametrize("cluster", [("--forget-after", str(FORGET_AFTER), "--metrics",
                                      f"127.0.0.1:{METRICS_PORT}")], indirect=True)
def test_the_metrics_after_a_pause_count_the_nodes_live_and_the_pause(cluster):
    beat(cluster, "a")
    beat(cluster, "b")
    stop_for(cluster, FORGET_AFTER + 1.0)
    samples = scrape(METRICS_PORT)
    assert value(samples, "quiver_coordinator_nodes", state="live") == 2
    assert value(samples, "quiver_coordinator_nodes", state="dead") == 0
    assert value(samples, "quiver_coordinator_not_running_seconds_total") >= FORGET_AFTER + 1


@pytest.mark.parametrize("cluster", [("--forget-datasets-after", "2")], indirect=True)
def test_a_dataset_no_node_reports_is_forgotten_and_one_in_use_is_not(cluster):
    beat(cluster, "a", ("old", "used"))
    assert sorted(loaders(cluster)) == ["old", "used"]
    cluster.wait_for(lambda: beat(cluster, "a", ("used",)) and "old" not in loaders(cluster),
                     "the dataset no node reports to be forgotten")
    assert list(loaders(cluster)) == ["used"]  # reported all along: kept

    def saved() -> list[str]:
        with open(os.path.join(cluster.coordinator.state_dir, "coordinator.json"),
                  encoding="utf-8") as f:
            return [d["identity"] for d in json.load(f)["datasets"]]
    cluster.wait_for(lambda: saved() == ["used"], "the state file to drop it")
    restart_after(cluster, 0.0)
    assert list(loaders(cluster)) == ["used"]


@pytest.mark.parametrize("cluster", [("--forget-datasets-after", "2")], indirect=True)
def test_a_real_nodes_dataset_is_forgotten_once_its_jobs_end(cluster, synthetic_tree):
    start_nodes(cluster, ["a"], make_digest(synthetic_tree.root, "syn"))
    sampler = QuiverBatchSampler(os.path.join(cluster.nodes["a"].root, "syn"), 8, seed=1)
    try:
        cluster.wait_for(lambda: len(loaders(cluster)) == 1, "the job's dataset to be known")
    finally:
        sampler.close()
    cluster.wait_for(lambda: loaders(cluster) == {}, "the dataset to be forgotten")


def test_a_node_that_leaves_a_dataset_hands_its_chunk_loads_over(cluster):
    """A node reports every dataset it has jobs on: one it leaves out, it has left."""
    first = beat(cluster, "a").cycles["ident"].loads
    beat(cluster, "b")
    beat(cluster, "a", loaded=first)
    assert all(n == ["a", "b"] for n in loaders(cluster)["ident"].values())
    beat(cluster, "a", datasets=())
    assert jobs(cluster) == {"ident": ["b"]}
    shares = loaders(cluster)["ident"]
    assert shares and all(n == ["b"] for n in shares.values()), shares


def test_a_real_nodes_ended_job_stops_counting(cluster, synthetic_tree):
    start_nodes(cluster, ["a"], make_digest(synthetic_tree.root, "syn"))
    sampler = QuiverBatchSampler(os.path.join(cluster.nodes["a"].root, "syn"), 8, seed=1)
    try:
        sampler.set_epoch(0)
        sampler.manifest(0)
        cluster.wait_for(lambda: list(jobs(cluster).values()) == [["a"]], "the job to count")
    finally:
        sampler.close()
    cluster.wait_for(lambda: list(jobs(cluster).values()) == [[]],
                     "the ended job to leave the coordinator (the dataset is kept)")

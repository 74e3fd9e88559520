"""A node given several coordinators follows the one that answers as the leader: real
``quiver coordinator`` processes and a real mountd on loopback. A standby's redirect
(``not_leader``) is checked here as the node parses it; its real-process test needs
the standby coordinators of issue #55's coordinator side."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from mountd.cluster.coordinators import ALONE_CALL_TIMEOUT
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess, free_port
from quiverfs.errors import ExitCode
from quiverfs.heartbeat import (HeartbeatReply, Leader, Member, NotLeader, heartbeat_answer,
                                to_wire)
from tests.mountd_helpers import mountd_factory, wait_for  # noqa: F401
from tests.test_cluster import SECRET, rpc_call
from tests.test_digest_errors import assert_error
from tests.test_metrics import scrape, value

needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

DEADLINE = 30.0  # seconds to wait for a condition with no stated bound
# The goal: from the leader's death to the first heartbeat another coordinator
# answers, at most twice a 5 s lease and at most 10 s.
FAILOVER_BOUND = 10.0




@pytest.fixture
def secret_file(tmp_path) -> str:
    path = tmp_path / "secret"
    path.write_bytes(SECRET)
    return str(path)


@pytest.fixture
def coordinators(tmp_path, secret_file):
    """``start(name, port)``: a real coordinator with its own state directory; every
    one is stopped after the test."""
    started: list[CoordinatorProcess] = []

    def start(name: str, port: int) -> CoordinatorProcess:
        c = CoordinatorProcess(str(tmp_path / name), secret_file, str(tmp_path / f"{name}.log"),
                               port=port)
        c.start()
        started.append(c)
        return c

    yield start
    for c in started:
        c.stop()


def node_args(secret_file: str, *extra: str) -> tuple[str, ...]:
    return ("--listen", "127.0.0.1:0", "--node-id", "a", "--cluster-secret-file",
            secret_file, *extra)


def followed(node: MountdProcess) -> dict[str, Any]:
    """The node's coordinators, as ``status`` reports them."""
    return node.status()["cluster"]["coordinators"]


def alive_at(c: CoordinatorProcess) -> list[str]:
    """The nodes coordinator ``c`` counts alive."""
    status = rpc_call(c.port, SECRET, "status", {})
    return [n["id"] for n in status["nodes"] if n["alive"]]


# --- the node's side of a standby's redirect, as it parses it ---------------------------

def test_a_standbys_answer_names_the_leader_or_none():
    for leader in ("127.0.0.1:7000", "coordinator-2.example:65535", None):
        wire = {"not_leader": {"leader": leader}}
        assert heartbeat_answer(wire) == NotLeader(Leader(leader))
        assert to_wire(NotLeader(Leader(leader))) == wire


def test_a_leaders_answer_is_a_heartbeat_reply():
    reply = HeartbeatReply(3, (Member("a", "127.0.0.1:9000", 100),))
    assert heartbeat_answer(to_wire(reply)) == reply


@pytest.mark.parametrize("answer", [
    {"not_leader": {"leader": 7000}},
    {"not_leader": {"leader": ["127.0.0.1:7000"]}},
    {"not_leader": {"leader": "h" * 100_000 + ":7000"}},
    {"not_leader": {"leader": "127.0.0.1"}},
    {"not_leader": {"leader": ":7000"}},
    {"not_leader": {"leader": "127.0.0.1:0"}},
    {"not_leader": {"leader": "127.0.0.1:65536"}},
    {"not_leader": {"leader": "127.0.0.1:99999999999999999999"}},
    {"not_leader": {"leader": "127.0.0.1:-1"}},
    {"not_leader": {"leader": "127.0.0.1:\u0661\u0662"}},  # Arabic-Indic digits
    {"not_leader": {"leader": "evil host:7000"}},
    {"not_leader": {"leader": "evil\nhost:7000"}},
    {"not_leader": {}},
    {"not_leader": None},
    {"not_leader": "127.0.0.1:7000"},
    {"not_leader": {"leader": "127.0.0.1:7000", "term": 4}},
    {"not_leader": {"leader": "127.0.0.1:7000"}, "version": 1, "nodes": []},
    {"not_leader": {"leader": None}, "extra": "x" * 1_000_000},
    {"version": 1},
    None,
    [1, 2],
], ids=lambda a: repr(a)[:40])
def test_a_malformed_answer_is_refused_whole(answer):
    with pytest.raises(ValueError, match="malformed"):
        heartbeat_answer(answer)


# --- real processes ---------------------------------------------------------------------

@needs_fuse
@pytest.mark.parametrize("where", ["command line", "config file"])
def test_a_node_passes_a_dead_coordinator_for_a_live_one(tmp_path, mountd_factory,
                                                        coordinators, secret_file, where):
    dead = f"127.0.0.1:{free_port()}"  # nothing listens there
    live = coordinators("live", free_port())
    if where == "command line":
        node = mountd_factory("node", extra_args=node_args(
            secret_file, "--coordinator", f"{dead},{live.address}"))
    else:
        config = tmp_path / "quiver.toml"
        config.write_text(f'[mountd]\ncoordinator = ["{dead}", "{live.address}"]\n')
        node = mountd_factory("node", wrapper=("env", f"QUIVER_CONFIG={config}"),
                              extra_args=node_args(secret_file))
    wait_for(lambda: alive_at(live) == ["a"], "the node to join live")
    assert followed(node) == {"addresses": [dead, live.address], "in_use": live.address,
                              "switches": 0, "last_switch": None}
    assert node.call({"op": "cluster"})["coordinator_ok"] is True


@needs_fuse
def test_a_node_follows_the_next_coordinator_when_its_own_is_killed(
        tmp_path, mountd_factory, coordinators, secret_file, quiver):
    dead = f"127.0.0.1:{free_port()}"
    first = coordinators("first", free_port())
    second = coordinators("second", free_port())  # standing by: no node knows it yet
    metrics = free_port()
    node = mountd_factory("node", extra_args=node_args(
        secret_file, "--coordinator", f"{dead},{first.address},{second.address}",
        "--metrics", f"127.0.0.1:{metrics}"))
    wait_for(lambda: alive_at(first) == ["a"], "the node to join first")
    assert followed(node)["in_use"] == first.address
    assert alive_at(second) == []

    first.proc.kill()
    killed = time.monotonic()
    first.proc.wait()
    wait_for(lambda: followed(node)["in_use"] == second.address,
             "the node to follow second", within=FAILOVER_BOUND)
    took = time.monotonic() - killed
    assert took <= FAILOVER_BOUND, took
    assert alive_at(second) == ["a"]
    now = followed(node)
    assert (now["addresses"], now["switches"]) == ([dead, first.address, second.address], 1)
    assert now["last_switch"] is not None

    samples = scrape(metrics)
    assert value(samples, "quiver_coordinator_switches_total") == 1
    assert {a: value(samples, "quiver_coordinator_in_use", address=a)
            for a in (dead, first.address, second.address)} == {
        dead: 0, first.address: 0, second.address: 1}

    where = ("--root", node.root, "--control-socket", node.socket)
    text = quiver("status", *where)
    assert text.returncode == 0, text.stderr
    line = next(x for x in text.stdout.splitlines() if x.startswith("coordinator in use"))
    assert line.startswith(f"coordinator in use: {second.address} (reachable), of {dead}, "
                           f"{first.address}, {second.address}; switches 1, the last at "), line
    shown = quiver("status", "--json", *where)
    assert json.loads(shown.stdout)["cluster"]["coordinators"]["in_use"] == second.address
    cluster = quiver("status", "--cluster", *where)
    assert f"coordinator in use: {second.address} (reachable)" in cluster.stdout


@needs_fuse
def test_a_node_passes_over_a_coordinator_that_hangs(mountd_factory, coordinators,
                                                     secret_file):
    """A coordinator that is stopped (SIGSTOP) keeps its connections open and answers
    nothing: the node gives up on it within the try's timeout, not the 5 s of a lone
    coordinator's, and follows the next."""
    first = coordinators("first", free_port())
    second = coordinators("second", free_port())
    node = mountd_factory("node", extra_args=node_args(
        secret_file, "--coordinator", f"{first.address},{second.address}"))
    wait_for(lambda: alive_at(first) == ["a"], "the node to join first")
    first.proc.send_signal(signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: followed(node)["in_use"] == second.address,
                 "the node to follow second", within=FAILOVER_BOUND)
        took = time.monotonic() - stopped
    finally:
        first.proc.send_signal(signal.SIGCONT)
    # the goal: a coordinator that hangs costs about a try's timeout, not a lone one's
    assert took < ALONE_CALL_TIMEOUT, took
    assert alive_at(second) == ["a"]
    assert followed(node)["switches"] == 1


@needs_fuse
def test_a_node_with_one_coordinator_waits_for_it_as_before(mountd_factory, coordinators,
                                                           secret_file):
    port = free_port()
    only = coordinators("only", port)
    node = mountd_factory("node", extra_args=node_args(secret_file, "--coordinator",
                                                       only.address))
    wait_for(lambda: node.call({"op": "cluster"})["coordinator_ok"], "the node to join")
    only.proc.kill()
    only.proc.wait()
    wait_for(lambda: not node.call({"op": "cluster"})["coordinator_ok"],
             "the node to see its coordinator gone")
    assert followed(node)["in_use"] == only.address  # no other to move to
    only.start()  # again, on the same address and state
    wait_for(lambda: node.call({"op": "cluster"})["coordinator_ok"], "the node to rejoin")
    assert followed(node) == {"addresses": [only.address], "in_use": only.address,
                              "switches": 0, "last_switch": None}
    assert alive_at(only) == ["a"]


# --- bad values, on the command line and in the config file ------------------------------

def mountd_fails(quiver, tmp_path, *args: str,
                 config: str | None = None) -> subprocess.CompletedProcess:
    """``quiver mountd`` with a cluster secret (so that only the value under test can
    fail), before it mounts anything."""
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    pre = ("--config", config) if config is not None else ()
    (tmp_path / "mnt").mkdir(exist_ok=True)
    return quiver(*pre, "mountd", "--foreground", "--root", str(tmp_path / "mnt"),
                  "--cache-dir", str(tmp_path / "cache"), "--cache-size", "1G",
                  "--cluster-secret-file", str(secret), *args)


@pytest.mark.parametrize("value,words", [
    ("", "invalid --coordinator ''"),
    ("127.0.0.1:7000,", "invalid --coordinator ''"),
    ("127.0.0.1:7000,,127.0.0.1:7001", "invalid --coordinator ''"),
    ("127.0.0.1:7000,127.0.0.1", "invalid --coordinator '127.0.0.1': use HOST:PORT"),
    ("127.0.0.1:7000,127.0.0.1:0", "port must be at least 1, not 0"),
    ("127.0.0.1:70000,127.0.0.1:7001", "port must be at most 65535"),
])
def test_a_bad_coordinator_list_is_one_line(quiver, tmp_path, value: str, words: str):
    r = mountd_fails(quiver, tmp_path, "--coordinator", value)
    assert_error(r, ExitCode.USAGE, "--coordinator", words)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("setting,words", [
    ("coordinator = []", "must name at least one HOST:PORT"),
    ('coordinator = ["127.0.0.1:7000", 7001]', "must list strings, not 7001"),
    ('coordinator = ["127.0.0.1:7000", ["127.0.0.1:7001"]]', "must list strings"),
    ('coordinator = ["127.0.0.1:7000", "127.0.0.1:0"]', "port must be at least 1"),
    ('coordinator = ["127.0.0.1:7000", "nohost"]', "use HOST:PORT"),
    ("coordinator = 7000", "must be a string or an array, not an integer"),
])
def test_a_bad_coordinator_list_in_the_config_file_is_one_line(quiver, tmp_path, setting: str,
                                                              words: str):
    config = tmp_path / "quiver.toml"
    config.write_text(f"[mountd]\n{setting}\n")
    r = mountd_fails(quiver, tmp_path, config=str(config))
    assert_error(r, ExitCode.CONFIG, str(config), "[mountd] coordinator", words)
    assert not (tmp_path / "cache").exists()

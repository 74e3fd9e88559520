"""Two real ``quiver coordinator`` processes sharing a real etcd on loopback (--etcd):
one leads, the other stands by and takes over with the state; a leader cut off from etcd
steps down; a deposed leader's writes are refused; a malformed key is never led on."""
from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from quiverfs.bench.etcd_process import PREFIX, Etcd
from quiverfs.bench.processes import CoordinatorProcess, free_port
from quiverfs.heartbeat import (DatasetReport, Heartbeat, HeartbeatReply, JobReport,
                                LoadedShare, from_wire, to_wire)
from quiverfs.rpc import Unavailable
from tests.mountd_helpers import wait_for
from tests.test_cluster import SECRET, rpc_call
from tests.test_metrics import scrape, value

TTL = 2  # seconds of lease: etcd's own minimum at its default election timeout
HEARTBEAT_TIMEOUT = 10.0  # no node dies while a test drives its heartbeats by hand
DEADLINE = 30.0  # seconds to wait for a condition that has no latency goal
CHUNKS = 4


def coordinator(tmp_path, etcd: Etcd | list[Etcd], name: str,
                extra_args: tuple[str, ...] = (),
                heartbeat_timeout: float = HEARTBEAT_TIMEOUT) -> CoordinatorProcess:
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    urls = ",".join(e.url for e in (etcd if isinstance(etcd, list) else [etcd]))
    return CoordinatorProcess(None, str(secret), str(tmp_path / f"{name}.log"),
                              heartbeat_timeout=heartbeat_timeout,
                              extra_args=("--etcd", urls, "--lease-ttl", str(TTL),
                                          *extra_args))


@pytest.fixture
def pair(tmp_path, etcd) -> Iterator[tuple[CoordinatorProcess, CoordinatorProcess]]:
    """Two coordinators: the first started leads, the second stands by."""
    first, second = coordinator(tmp_path, etcd, "c1"), coordinator(tmp_path, etcd, "c2")
    try:
        start_pair(first, second)
        yield first, second
    finally:
        for c in (first, second):
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(signal.SIGCONT)
            c.stop()



def start_pair(first: CoordinatorProcess, second: CoordinatorProcess) -> None:
    """``first`` started until it leads, then ``second`` until it knows it does."""
    first.start()
    wait_for(lambda: role(first) == "leader", "the first coordinator to lead")
    second.start()
    wait_for(lambda: status(second)["coordinator"]["leader"] == first.address,
             "the second coordinator to know the leader")


def port(c: CoordinatorProcess) -> int:
    return int(c.address.rsplit(":", 1)[1])


def status(c: CoordinatorProcess) -> dict:
    return rpc_call(port(c), SECRET, "status", {})


def role(c: CoordinatorProcess) -> str:
    return status(c)["coordinator"]["role"]


def beat(c: CoordinatorProcess, node: str, loaded: tuple[LoadedShare, ...] = (),
         jobs: int = 1) -> dict:
    """One heartbeat from ``node`` (``jobs`` jobs on dataset "ident") over RPC: the raw
    reply."""
    report = DatasetReport(name="ds", chunks=CHUNKS, size=4000, chunk_bytes=500,
                           loaded=loaded, jobs=tuple(
                               JobReport(id=f"{node}-job{i}", gen=0, gpus=1,
                                         remaining=(5,) * CHUNKS, probe_seq=0)
                               for i in range(jobs)))
    return rpc_call(port(c), SECRET, "heartbeat", to_wire(Heartbeat(
        node, f"127.0.0.1:{9000 + len(node)}", 1500, {"ident": report})))


def drive(c: CoordinatorProcess) -> dict:
    """Nodes a and b beat on the leader ``c`` until a chunk was loaded and the cycle
    moved on; the leader's status then."""
    first = from_wire(beat(c, "a"), HeartbeatReply).cycles["ident"].loads
    beat(c, "b")
    beat(c, "a", loaded=first)  # a alone loaded the first chunks: a and b load the next
    s = status(c)
    loaders = s["datasets"][0]["loaders"]
    assert loaders and all(n == ["a", "b"] for n in loaders.values()), loaders
    return s


def cycles(s: dict) -> dict:
    """What must survive a takeover of each dataset: its cycle and its loaders."""
    keep = ("states", "resident", "marked", "generation", "marked_generations", "next",
            "capacity", "max_resident", "loaders", "mode")
    return {d["identity"]: {k: d[k] for k in keep} for d in s["datasets"]}


def log_of(c: CoordinatorProcess) -> str:
    with open(c.log_path, encoding="utf-8") as f:
        return f.read()


def test_a_standby_answers_heartbeats_with_the_leaders_address(pair):
    leader, standby = pair
    assert beat(standby, "a") == {"not_leader": {"leader": leader.address}}
    reply = from_wire(beat(leader, "a"), HeartbeatReply)
    assert [m.id for m in reply.nodes] == ["a"]
    assert status(standby) == {"coordinator": {
        "role": "standby", "leader": leader.address, "advertise": standby.address,
        "lease_ttl": TTL, "takeovers": 0, "last_takeover": None, "etcd_writes": 0,
        "etcd_keys_written": 0, "etcd_bytes_written": 0}}
    assert status(leader)["coordinator"]["takeovers"] == 1


def test_sigkill_of_the_leader_a_standby_leads_within_two_ttls_with_its_state(pair):
    leader, standby = pair
    before = drive(leader)
    killed = time.monotonic()
    leader.proc.kill()
    leader.proc.wait()
    wait_for(lambda: role(standby) == "leader", "the standby to lead")
    assert time.monotonic() - killed <= 2 * TTL
    after = status(standby)
    assert cycles(after) == cycles(before)
    assert {n["id"]: n["alive"] for n in after["nodes"]} == {"a": True, "b": True}
    assert after["version"] == before["version"] + 1
    assert after["coordinator"]["takeovers"] == 1
    reply = from_wire(beat(standby, "a"), HeartbeatReply)
    assert [m.id for m in reply.nodes] == ["a", "b"]
    assert "declared dead" not in log_of(standby)


def test_a_leader_cut_off_from_etcd_steps_down_within_its_lease(pair, etcd):
    leader, standby = pair
    etcd.proc.send_signal(signal.SIGSTOP)
    cut = time.monotonic()
    try:
        wait_for(lambda: role(leader) == "standby", "the leader to step down")
        assert time.monotonic() - cut <= TTL + 1.0  # its lease, and a status call's time
        assert beat(leader, "z") == {"not_leader": {"leader": None}}
        assert role(standby) == "standby"  # nobody leads without etcd
    finally:
        etcd.proc.send_signal(signal.SIGCONT)
    wait_for(lambda: "leader" in (role(leader), role(standby)), "a leader again")
    assert "stepped down as the leader: the lease was not renewed" in log_of(leader)


def test_a_deposed_leader_that_was_stopped_never_writes_again(pair, etcd):
    leader, standby = pair
    drive(leader)
    leader.proc.send_signal(signal.SIGSTOP)
    try:
        wait_for(lambda: role(standby) == "leader", "the standby to lead")
    finally:
        leader.proc.send_signal(signal.SIGCONT)
    reply = beat(leader, "z")
    assert set(reply) == {"not_leader"}, reply
    assert PREFIX + "nodes/z" not in etcd.keys()
    wait_for(lambda: status(leader)["coordinator"]["leader"] == standby.address,
               "the old leader to follow the new one")
    assert role(leader) == "standby"
    assert "z" not in {n["id"] for n in status(standby)["nodes"]}


def test_etcd_refuses_the_write_of_a_leader_whose_key_was_replaced(pair, etcd):
    """The leader key replaced under a leader whose lease still renews: its next write
    fails the transaction's compare, it steps down, and etcd holds nothing of it."""
    leader, standby = pair
    drive(leader)
    before = etcd.keys()
    standby.proc.send_signal(signal.SIGSTOP)  # it would campaign while the key is gone
    try:
        etcd.ctl("del", PREFIX + "leader")
        etcd.ctl("put", PREFIX + "leader", "127.0.0.1:1")
        assert beat(leader, "z") == {"not_leader": {"leader": None}}
    finally:
        standby.proc.send_signal(signal.SIGCONT)
    after = etcd.keys()
    assert PREFIX + "nodes/z" not in after
    assert {k: v for k, v in after.items() if k != PREFIX + "leader"} == {
        k: v for k, v in before.items() if k != PREFIX + "leader"}
    assert "etcd refused a write" in log_of(leader)
    wait_for(lambda: status(leader)["coordinator"]["leader"] == "127.0.0.1:1",
               "the old leader to name the key's holder")


def test_a_malformed_key_is_reported_once_and_never_led_on(tmp_path, etcd):
    key = PREFIX + "nodes/a"
    etcd.ctl("put", key, "{not json")
    written = etcd.keys()[key]
    c = coordinator(tmp_path, etcd, "c1")
    c.start()
    try:
        wait_for(lambda: "is malformed" in log_of(c), "the malformed key's log line")
        end = time.monotonic() + 3 * TTL  # three of its tries to lead
        while time.monotonic() < end:
            assert role(c) == "standby"
            assert beat(c, "b") == {"not_leader": {"leader": None}}
        assert etcd.keys()[key] == written
        lines = [line for line in log_of(c).splitlines() if "is malformed" in line]
        assert len(lines) == 1, lines
        assert f"etcd key {key} is malformed (JSONDecodeError" in lines[0]
        assert "Traceback" not in log_of(c)
        etcd.ctl("del", key)
        wait_for(lambda: role(c) == "leader", "the coordinator to lead")
    finally:
        assert c.stop() == 0


def test_a_restart_of_every_coordinator_resumes_from_etcd(pair):
    leader, standby = pair
    before = drive(leader)
    assert leader.stop() == 0  # the leader resigns: the standby takes over at once
    wait_for(lambda: role(standby) == "leader", "the standby to lead")
    assert standby.stop() == 0
    for c in (leader, standby):
        c.start()
    wait_for(lambda: "leader" in (role(leader), role(standby)), "a leader")
    now = leader if role(leader) == "leader" else standby
    after = status(now)
    assert cycles(after) == cycles(before)
    assert {n["id"]: n["alive"] for n in after["nodes"]} == {"a": True, "b": True}
    assert after["version"] == before["version"] + 2  # two takeovers since


@pytest.fixture
def etcd3(tmp_path) -> Iterator[list[Etcd]]:
    """A three-member etcd."""
    members = [Etcd(str(tmp_path), f"m{i}") for i in range(3)]
    cluster = ",".join(m.cluster for m in members)
    for m in members:
        m.cluster = cluster
        m.start(wait=False)
    for m in members:
        m.wait()
    yield members
    for m in members:
        m.stop()


def test_a_three_member_etcd_goes_on_without_one_and_stops_takeovers_without_two(
        tmp_path, etcd3):
    first, second = coordinator(tmp_path, etcd3, "c1"), coordinator(tmp_path, etcd3, "c2")
    first.start()
    second.start()
    try:
        wait_for(lambda: "leader" in (role(first), role(second)), "a leader")
        leader, standby = (first, second) if role(first) == "leader" else (second, first)
        drive(leader)
        etcd3[0].proc.kill()
        etcd3[0].proc.wait()
        # Two members go on (once they elected a leader among them, if m0 was it): a
        # write, and a takeover, whichever URL each coordinator tried first.
        wait_for(lambda: etcd3[1].quorum(), "etcd's two members to have a leader")
        wait_for(lambda: "leader" in (role(first), role(second)), "a leader")
        leader, standby = (first, second) if role(first) == "leader" else (second, first)
        from_wire(beat(leader, "c"), HeartbeatReply)
        before = status(leader)
        leader.proc.kill()
        leader.proc.wait()
        wait_for(lambda: role(standby) == "leader", "the standby to lead on two members")
        assert {n["id"] for n in status(standby)["nodes"]} == {"a", "b", "c"}
        assert cycles(status(standby)) == cycles(before)
        kept = etcd3[1].keys()
        etcd3[1].proc.kill()
        etcd3[1].proc.wait()
        # No bound here: etcd's leader may grant renewals for its election timeout
        # before it notices it lost its quorum.
        wait_for(lambda: role(standby) == "standby", "the leader to step down")
        assert beat(standby, "z") == {"not_leader": {"leader": None}}
        assert "stepped down as the leader: the lease was not renewed" in log_of(standby)
        assert "etcd: " in log_of(standby)
        for m in etcd3[:2]:  # back to three: the state is as it was, and is led on
            m.start(wait=False)
        for m in etcd3[:2]:
            m.wait()
        wait_for(lambda: role(standby) == "leader", "the coordinator to lead again")
        now = etcd3[2].keys()
        for key in (PREFIX + "leader", PREFIX + "version"):  # a new term, a new version
            now.pop(key), kept.pop(key)
        assert now == kept
    finally:
        for c in (first, second):
            c.stop()


def test_a_leader_cut_off_from_etcd_while_the_standby_is_not_steps_down_and_follows(
        tmp_path, etcd3):
    """The leader reaches etcd through one member, the standby through the other two:
    that member stopped (a network cut of the leader), the leader steps down within its
    lease, the standby leads on the state, and the old leader, back, follows it and
    writes nothing."""
    first, second = coordinator(tmp_path, etcd3[0], "c1"), coordinator(tmp_path, etcd3[1:],
                                                                       "c2")
    try:
        start_pair(first, second)
        before = drive(first)
        etcd3[0].proc.send_signal(signal.SIGSTOP)
        cut = time.monotonic()
        try:
            wait_for(lambda: role(first) == "standby", "the cut-off leader to step down")
            assert time.monotonic() - cut <= TTL + 1.0  # its lease, and a status call's
            wait_for(lambda: role(second) == "leader", "the standby to lead")
            assert cycles(status(second)) == cycles(before)
            assert {n["id"] for n in status(second)["nodes"]} == {"a", "b"}
        finally:
            etcd3[0].proc.send_signal(signal.SIGCONT)
        wait_for(lambda: status(first)["coordinator"]["leader"] == second.address,
                 "the old leader to follow the new one")
        assert role(first) == "standby"
        assert beat(first, "z") == {"not_leader": {"leader": second.address}}
        assert PREFIX + "nodes/z" not in etcd3[0].keys()
        assert "stepped down as the leader: the lease was not renewed" in log_of(first)
    finally:
        for c in (first, second):
            c.stop()


def test_the_metrics_show_the_leader_the_lease_and_the_takeovers(tmp_path, etcd):
    ports = [free_port(), free_port()]
    first, second = (coordinator(tmp_path, etcd, f"c{i}", ("--metrics", f"127.0.0.1:{p}"))
                     for i, p in enumerate(ports))
    try:
        start_pair(first, second)
        drive(first)
        leading, standing = scrape(ports[0]), scrape(ports[1])
        assert value(leading, "quiver_coordinator_leader") == 1
        assert value(leading, "quiver_coordinator_takeovers_total") == 1
        assert value(leading, "quiver_coordinator_lease_ttl_seconds") == TTL
        assert value(leading, "quiver_coordinator_last_takeover_timestamp_seconds") > 0
        assert value(leading, "quiver_coordinator_etcd_writes_total") >= 3  # a, b, cycle
        assert value(leading, "quiver_coordinator_etcd_written_bytes_total") > 0
        assert value(leading, "quiver_coordinator_nodes", state="live") == 2
        assert value(standing, "quiver_coordinator_leader") == 0
        assert value(standing, "quiver_coordinator_takeovers_total") == 0
        assert value(standing, "quiver_coordinator_last_takeover_timestamp_seconds") == 0
        # a standby exports its role alone, not a state it does not keep
        assert not any(name == "quiver_coordinator_nodes" for name, _ in standing)
        first.proc.kill()
        first.proc.wait()
        wait_for(lambda: role(second) == "leader", "the standby to lead")
        took_over = scrape(ports[1])
        assert value(took_over, "quiver_coordinator_leader") == 1
        assert value(took_over, "quiver_coordinator_takeovers_total") == 1
        assert value(took_over, "quiver_coordinator_nodes", state="live") == 2
        # What it loaded is what it would write: only the new membership version goes.
        wait_for(lambda: value(scrape(ports[1]), "quiver_coordinator_etcd_writes_total")
                   >= 1, "the new leader's first write")
        assert value(scrape(ports[1]), "quiver_coordinator_etcd_keys_written_total") == 1
    finally:
        for c in (first, second):
            c.stop()


def test_a_coordinator_takes_etcd_lease_ttl_and_advertise_from_the_config_file(
        tmp_path, etcd):
    """The keys docs/cluster.md shows in [coordinator] of /etc/quiver/quiver.toml."""
    listen = f"127.0.0.1:{free_port()}"
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    cfg = tmp_path / "quiver.toml"
    cfg.write_text(f'cluster-secret-file = "{secret}"\n[coordinator]\nlisten = "{listen}"\n'
                   f'advertise = "10.9.8.7:7070"\netcd = "{etcd.url}"\nlease-ttl = 3\n')
    with open(tmp_path / "c.log", "ab") as log:
        proc = subprocess.Popen([sys.executable, "-m", "quiverfs.cli", "--config", str(cfg),
                                 "coordinator"], stdin=subprocess.DEVNULL, stdout=log,
                                stderr=log)
    c = CoordinatorProcess(None, str(secret), str(tmp_path / "c.log"),
                           port=int(listen.rsplit(":", 1)[1]))
    c.proc = proc

    def leads() -> bool:
        assert proc.poll() is None, f"the coordinator exited with {proc.returncode}"
        try:
            return role(c) == "leader"
        except Unavailable:  # not listening yet
            return False

    try:
        wait_for(leads, "it to lead")
        assert status(c)["coordinator"]["lease_ttl"] == 3
        assert etcd.keys()[PREFIX + "leader"][0] == "10.9.8.7:7070"
    finally:
        assert c.stop() == 0


def test_steady_heartbeats_of_three_nodes_and_six_jobs_write_nothing(tmp_path, etcd):
    """Live nodes beating with nothing new to report change no record: a node's silence
    is saved as 0 within a heartbeat timeout, so its key is not rewritten each time the
    state is compared with etcd (twice a heartbeat timeout)."""
    metrics = free_port()
    c = coordinator(tmp_path, etcd, "c1", ("--metrics", f"127.0.0.1:{metrics}"),
                    heartbeat_timeout=2.0)
    c.start()
    try:
        wait_for(lambda: role(c) == "leader", "it to lead")
        for node in ("a", "b", "c"):
            beat(c, node, jobs=2)
        written = value(scrape(metrics), "quiver_coordinator_etcd_keys_written_total")
        revisions = etcd.keys()
        end = time.monotonic() + 6.0  # three heartbeat timeouts of beats every 0.5 s
        while time.monotonic() < end:
            for node in ("a", "b", "c"):
                beat(c, node, jobs=2)
            time.sleep(0.5)  # the nodes' own heartbeat interval, the test's stimulus
        assert value(scrape(metrics), "quiver_coordinator_etcd_keys_written_total") == written
        assert etcd.keys() == revisions
        assert {n["id"]: n["alive"] for n in status(c)["nodes"]} == {
            "a": True, "b": True, "c": True}
        assert len(status(c)["datasets"][0]["jobs"]) == 6
    finally:
        assert c.stop() == 0


def test_a_dataset_too_large_for_etcd_is_left_out_and_holds_back_no_other(pair, etcd):
    """A dataset whose record is over etcd's request limit (a huge digest planned into
    300,000 chunks) is logged once and not kept in etcd; the heartbeat is answered and
    the other records are written."""
    leader, _ = pair
    chunks = 300_000
    big = DatasetReport(name="big", chunks=chunks, size=chunks * 500, chunk_bytes=500,
                        jobs=(JobReport(id="a-big", gen=0, gpus=1, remaining=(5,) * chunks,
                                        probe_seq=0),))
    small = DatasetReport(name="ds", chunks=CHUNKS, size=4000, chunk_bytes=500, jobs=(
        JobReport(id="a-job", gen=0, gpus=1, remaining=(5,) * CHUNKS, probe_seq=0),))
    for _ in range(2):
        reply = rpc_call(port(leader), SECRET, "heartbeat", to_wire(Heartbeat(
            "a", "127.0.0.1:9001", 1500, {"ident": small, "bigident": big})))
        assert set(from_wire(reply, HeartbeatReply).cycles) == {"ident", "bigident"}
    keys = etcd.keys()
    assert PREFIX + "datasets/ident" in keys and PREFIX + "nodes/a" in keys
    assert PREFIX + "datasets/bigident" not in keys
    lines = [line for line in log_of(leader).splitlines() if "dataset big: its state" in line]
    assert len(lines) == 1, lines

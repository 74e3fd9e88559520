"""``--peer-network``: the coordinator refuses nodes whose peer address is outside it, and
mountd never dials such a member."""
from __future__ import annotations

import hashlib
import os

import pytest
import trio

from coordinator.server import CoordinatorServer
from coordinator.state import CoordinatorState
from mountd.cluster.peers import PeerSet
from quiverfs.errors import ExitCode, QuietError
from quiverfs.heartbeat import Heartbeat, to_wire
from quiverfs.peer_network import PeerNetworks, peer_refusal
from quiverfs.rpc import RpcError, Unavailable
from tests.mountd_helpers import make_digest, tree_hashes
from tests.test_cluster import SECRET, Cluster, read, rpc_call

NETWORKS = PeerNetworks("--peer-network")("10.0.0.0/8, fd00::/8")


@pytest.mark.parametrize("value", ["10.0.0.0/33", "10.0.0.1/8", "ten/8", "10.0.0.0/8,",
                                   "10.0.0.0/8;fd00::/8"])
def test_a_bad_network_is_a_usage_error(value):
    with pytest.raises(QuietError, match="invalid --peer-network") as exc:
        PeerNetworks("--peer-network")(value)
    assert exc.value.exitcode == ExitCode.USAGE


@pytest.mark.parametrize("peer", ["10.1.2.3:7071", "[fd00::1]:7071", "fd00::1:7071",
                                  "::ffff:10.0.0.2:7071"])
def test_addresses_inside_the_networks_are_allowed(peer):
    assert peer_refusal(peer, NETWORKS) is None


@pytest.mark.parametrize("peer, why", [
    ("127.0.0.1:7071", "outside --peer-network 10.0.0.0/8,fd00::/8"),
    ("11.0.0.1:7071", "outside"),
    ("[fe80::1]:7071", "outside"),
    ("vm2:7071", "not an IP address"),
    ("10.0.0.1.example.com:7071", "not an IP address"),
])
def test_addresses_outside_the_networks_and_host_names_are_refused(peer, why):
    assert why in peer_refusal(peer, NETWORKS)
    assert peer_refusal(peer, ()) is None  # without networks, any address


@pytest.mark.parametrize("peer", ["10.1.2.3", "10.1.2.3:", ":7071", "10.1.2.3:0",
                                  "10.1.2.3:65536", "10.1.2.3:７０", "a b:7071", "local"])
def test_malformed_peer_addresses_are_refused_with_or_without_networks(peer):
    assert "is not HOST:PORT" in peer_refusal(peer, ())
    assert "is not HOST:PORT" in peer_refusal(peer, NETWORKS)


async def test_the_coordinator_refuses_a_node_outside_the_networks(tmp_path):
    state = CoordinatorState(str(tmp_path))
    server = CoordinatorServer(state, b"s" * 16, ("127.0.0.1", 0), networks=NETWORKS)
    for peer in ("127.0.0.1:7071", "vm2:7071"):
        with pytest.raises(ValueError, match="peer address"):
            await server.heartbeat(to_wire(Heartbeat("a", peer, 100)))
    assert state.nodes == {} and state.changes() is None
    await server.heartbeat(to_wire(Heartbeat("a", "10.0.0.5:7071", 100)))
    assert list(state.nodes) == ["a"]


def test_a_coordinator_started_with_networks_drops_the_members_outside(tmp_path):
    state = CoordinatorState(str(tmp_path))
    state.heartbeat(Heartbeat("inside", "10.0.0.5:7071", 100))
    state.heartbeat(Heartbeat("outside", "192.168.0.5:7071", 100))
    state.save()
    again = CoordinatorState(str(tmp_path))
    CoordinatorServer(again, b"s" * 16, ("127.0.0.1", 0), networks=NETWORKS)
    assert list(again.nodes) == ["inside"]


async def test_mountd_never_dials_a_member_outside_the_networks():
    peers = PeerSet(SECRET, trio.CapacityLimiter(1), NETWORKS)
    async with trio.open_nursery() as nursery:
        await nursery.start(peers.tasks.run)
        peers.update({"in": "10.0.0.5:7071", "out": "127.0.0.1:7071", "bad": "nope"})
        assert sorted(peers.clients) == ["in"]
        assert peers.is_down("out") and peers.is_down("bad") and not peers.is_down("in")
        with pytest.raises(Unavailable):
            await peers.lookup("out", [b"\0" * 32])
        peers.update({"out": "10.0.0.6:7071"})  # it moved into the networks
        assert sorted(peers.clients) == ["out"] and not peers.is_down("out")
        nursery.cancel_scope.cancel()


def test_bad_peer_network_options_exit_2(quiver, tmp_path):
    coordinator = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir",
                         str(tmp_path / "co"), "--peer-network", "10.0.0.0/33")
    mountd = quiver("mountd", "--root", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
                    "--cache-size", "1G", "--peer-network", "10.0.0.1/8")
    for result in (coordinator, mountd):
        assert result.returncode == ExitCode.USAGE, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert "invalid --peer-network" in result.stderr


def test_a_node_whose_own_address_is_outside_its_networks_does_not_start(quiver, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(SECRET)
    result = quiver("mountd", "--root", str(tmp_path), "--cache-dir", str(tmp_path / "c"),
                    "--cache-size", "1G", "--coordinator", "127.0.0.1:7", "--listen",
                    "127.0.0.1:0", "--cluster-secret-file", str(secret),
                    "--peer-network", "10.0.0.0/8")
    assert result.returncode == ExitCode.USAGE, result.stderr
    assert "127.0.0.1 is outside --peer-network 10.0.0.0/8" in result.stderr
    assert not (tmp_path / "c").exists()  # refused before anything was made


def rpc(port: int, op: str, args: dict) -> object:
    return rpc_call(port, SECRET, op, args)


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
def test_a_coordinator_process_refuses_a_node_outside_its_network(tmp_path):
    c = Cluster(str(tmp_path), coordinator_args=("--peer-network", "127.0.0.1/32"))
    c.coordinator.start()
    try:
        port = int(c.coordinator.address.rsplit(":", 1)[1])
        with pytest.raises(RpcError, match="127.0.0.2 is outside --peer-network 127.0.0.1/32"):
            rpc(port, "heartbeat", to_wire(Heartbeat("b", "127.0.0.2:7071", 100)))
        reply = rpc(port, "heartbeat", to_wire(Heartbeat("a", "127.0.0.1:7071", 100)))
        assert [n["id"] for n in reply["nodes"]] == ["a"]
        assert [n["id"] for n in rpc(port, "status", {})["nodes"]] == ["a"]
    finally:
        problems = c.stop()
    assert not problems, "\n".join(problems)
    with open(c.coordinator.log_path, encoding="utf-8") as f:
        assert f.read().count("refused node b") == 1  # logged once


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
def test_a_node_never_dials_a_member_outside_its_network(tmp_path, synthetic_tree):
    """a admits only 127.0.0.1; b's peer server is on 127.0.0.2. a counts b as down, so
    a owns every key, and reads the whole dataset without handing b an item."""
    c = Cluster(str(tmp_path))
    c.coordinator.start()
    try:
        data = make_digest(synthetic_tree.root, "syn")
        a = c.add_node("a", extra_args=("--peer-network", "127.0.0.1/32"))
        b = c.add_node("b", extra_args=("--listen", "127.0.0.2:0"))
        for m in (a, b):
            m.call({"op": "mount", "name": "syn", "digest": data})
        c.wait_for(lambda: c.live_members("b") == ["a", "b"], "b to see both members")
        c.wait_for(lambda: sorted(n["id"] for n in a.call({"op": "cluster"})["nodes"])
                   == ["a", "b"], "a to learn of b")
        assert c.live_members("a") == ["a"]
        expected = tree_hashes(synthetic_tree.root)
        for p in expected:
            assert hashlib.sha256(read(os.path.join(a.root, "syn", p))).hexdigest() == expected[p]
        c.wait_for(lambda: a.status()["cache"]["items"] == len(expected),
                   "a to hold every item itself")
        assert b.status()["cache"]["items"] == 0
        assert a.status()["counters"].get("peer_puts", 0) == 0
        assert a.log_tail(200).count("not dialling member b") == 1
    finally:
        problems = c.stop()
    assert not problems, "\n".join(problems)

"""Anyone on the network can reach a node's peer port: a flood of connections that
never authenticate must leave the node serving."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from quiverfs import rpc
from quiverfs.bench.processes import CoordinatorProcess, MountdProcess, unmount
from quiverfs.errors import QuietError
from quiverfs.option_types import parse_address
from tests.mountd_helpers import make_digest, mount, read_hashes, tree_hashes

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

SECRET = b"flood-test-cluster-secret-0123"
FLOOD = 25_000  # connections held open at once


@pytest.fixture
def node(tmp_path) -> Iterator[MountdProcess]:
    """A coordinator and one mountd node with a peer server on loopback."""
    secret_file = str(tmp_path / "secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET)
    coordinator = CoordinatorProcess(str(tmp_path / "coordinator"), secret_file,
                                     str(tmp_path / "coordinator.log"))
    coordinator.start()
    os.makedirs(tmp_path / "mnt")
    os.makedirs(tmp_path / "cache")
    m = MountdProcess(str(tmp_path / "mnt"), str(tmp_path / "cache"), "1G",
                      str(tmp_path / "node.log"),
                      extra_args=("--coordinator", coordinator.address, "--listen",
                                  "127.0.0.1:0", "--node-id", "n1",
                                  "--cluster-secret-file", secret_file))
    try:
        m.start()
        yield m
        rc = m.stop()
        assert rc == 0, m.log_tail()
        assert "Traceback" not in m.log_tail(1000), m.log_tail(40)
    finally:
        m.kill()
        unmount(m.root)
        coordinator.stop()


# Holds N connections to HOST:PORT open, says how many, and closes them when its stdin
# closes. The flood is spread over processes: one may hold at most its open-files limit.
FLOODER = """
import socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
held = [socket.create_connection((host, port), timeout=30) for _ in range(n)]
print(len(held), flush=True)
sys.stdin.read()
"""
FLOODERS = 4


@pytest.mark.slow
def test_unauthenticated_flood_leaves_the_node_serving(node, synthetic_tree, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(synthetic_tree.root, src)
    expected = tree_hashes(src)
    mount(node, make_digest(src, "syn"), "syn")
    peer = [n["peer"] for n in node.call({"op": "cluster"})["nodes"] if n["id"] == "n1"][0]
    host, port = parse_address(peer)
    base = os.path.join(node.root, "syn")
    flooders = [subprocess.Popen([sys.executable, "-c", FLOODER, host, str(port),
                                  str(FLOOD // FLOODERS)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)
                for _ in range(FLOODERS)]
    try:
        assert read_hashes(base, sorted(expected)) == expected  # while the flood comes in
        held = sum(int(f.stdout.readline() or 0) for f in flooders)
        assert held == FLOOD
        assert read_hashes(base, sorted(expected)) == expected  # while all are held
    finally:
        for f in flooders:
            f.stdin.close()
            f.wait(timeout=60)
    counters = node.status()["counters"]
    assert counters.get("bucket_errors", 0) == 0 and counters.get("integrity_failures", 0) == 0
    # the port still serves the cluster: once the flood's handshakes have ended (the
    # node sees our closes), an authenticated call gets its answer
    deadline = time.monotonic() + 2 * rpc.HANDSHAKE_TIMEOUT
    while True:
        try:
            assert rpc.call_once(peer, SECRET, "lookup", {"hashes": [b"\0" * 32]}) == [False]
            break
        except QuietError:
            assert time.monotonic() < deadline, "the peer port stopped serving"
            time.sleep(0.1)

"""A request that decodes to far more than its bytes (16 MiB of empty arrays once made
1.2 GB of lists, for 5 s of the serving loop) is refused at once as it is decoded:
mountd grows by at most three times the request's bytes, and another user's ``status``
is answered within 100 ms meanwhile. The same holds for frames on the RPC port."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

import msgpack
import pytest
import trio

from quiverfs import digest as digest_format
from quiverfs import rpc, wire
from quiverfs.bench.processes import CoordinatorProcess
from quiverfs.errors import ExitCode, QuietError
from tests.conftest import CLI_TIMEOUT
from tests.mountd_helpers import mountd_factory  # noqa: F401

needs_mount = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/dev/fuse"),
                                 reason="needs root and /dev/fuse")

USER = 1000
BODY = 16 << 20  # bytes of each hostile request's body, about
STATUS_GOAL = 0.100  # seconds another user's status may take while one is decoded
SECRET = b"decoding-test-cluster-secret-01"
REPEAT_BYTES = 8 << 20  # what registering a digest again may leave in mountd's memory


def _tree(depth: int, leaf: bytes = b"\x90") -> bytes:
    """Arrays of 15 arrays, ``depth`` levels of them, ``leaf`` at the bottom."""
    return leaf if depth == 0 else b"\x9f" + _tree(depth - 1, leaf) * 15


def _map_tree(depth: int) -> bytes:
    """Maps of 15 maps (keys 0 to 14), ``depth`` levels of them, empty at the bottom."""
    if depth == 0:
        return b"\x80"
    child = _map_tree(depth - 1)
    return b"\x8f" + b"".join(bytes([k]) + child for k in range(15))


def _array(items: bytes, n: int) -> bytes:
    return b"\xdd" + n.to_bytes(4, "big") + items * n


def _fill(unit: bytes) -> bytes:
    """An array of copies of ``unit``, about BODY bytes, at most 64 of them (so that
    each array is short enough for a request, and only their number tells)."""
    return _array(unit, min(64, BODY // len(unit)))


def shapes() -> dict[str, bytes]:
    """Bodies of about BODY bytes that decode to many objects, each of a kind."""
    return {
        "empty arrays": _array(b"\x90", BODY),
        "empty maps": _array(b"\x80", BODY),
        "nested arrays": _fill(_tree(5)),
        "nested maps": _fill(_map_tree(5)),
        "deep nesting": _fill(_tree(2, b"\x91" * 1000 + b"\x90")),
        "short binaries": _fill(_tree(3, b"\x9f" + b"\xc4\x02ab" * 15)),
        "short strings": _fill(_tree(3, b"\x9f" + b"\xa2ab" * 15)),
        # a registration's shape, its digest not one: refused by the digest's checks
        "one large binary": msgpack.packb({"op": "mount", "name": "x",
                                           "digest": b"\xdd" * BODY}, use_bin_type=True),
    }


def vm_kb(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def status_seconds(path: str) -> float:
    """Seconds one ``status`` request takes on a connection of its own."""
    start = time.monotonic()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        s.sendall(wire.pack({"op": "status"}))
        reply = wire.sock_recv_msg(s)
    assert reply["ok"], reply
    return time.monotonic() - start


SEND = """
import json, socket, sys
from quiverfs import wire
body = sys.stdin.buffer.read()
with socket.socket(socket.AF_UNIX) as s:
    s.connect(sys.argv[1])
    s.sendall(wire.HEADER.pack(len(body)) + body)
    print(json.dumps(wire.sock_recv_msg(s)))
"""


def send_as(uid: int, path: str, body: bytes, statuses: list[float]) -> dict:
    """Send ``body`` as one request from a process of ``uid``; its reply. Meanwhile
    another connection asks for ``status`` again and again, its times in ``statuses``."""
    prefix = () if uid == 0 else ("setpriv", f"--reuid={uid}", f"--regid={uid}",
                                  "--clear-groups", "--")
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    proc = subprocess.Popen([*prefix, sys.executable, "-c", SEND, path], env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    writer = threading.Thread(target=lambda: (proc.stdin.write(body), proc.stdin.close()))
    writer.start()
    deadline = time.monotonic() + CLI_TIMEOUT
    while proc.poll() is None and time.monotonic() < deadline:
        statuses.append(status_seconds(path))
    writer.join()
    out, err = proc.stdout.read(), proc.stderr.read()
    proc.wait(timeout=CLI_TIMEOUT)
    statuses.append(status_seconds(path))  # and once it is answered
    assert proc.returncode == 0, err
    return json.loads(out)


@needs_mount
@pytest.mark.parametrize("uid", [USER, 0])
@pytest.mark.parametrize("shape", list(shapes()))
def test_a_request_that_decodes_to_many_objects_is_refused_within_its_bytes(
        mountd_factory, shared_workdir, shape, uid):  # noqa: F811
    m = mountd_factory(workdir=shared_workdir)
    os.chmod(m.cache_dir, 0o755)  # the control socket lives there
    pid = m.proc.pid
    status_seconds(m.socket)  # its first status, which imports and allocates, is done
    body = shapes()[shape]
    before = vm_kb(pid, "VmRSS")
    with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # the peak starts again from here
    statuses: list[float] = []
    reply = send_as(uid, m.socket, body, statuses)
    grown = (vm_kb(pid, "VmHWM") - before) * 1024

    refused = ExitCode.BAD_DIGEST if shape == "one large binary" else ExitCode.USAGE
    assert reply["ok"] is False and reply["code"] == int(refused), reply
    assert len(reply["error"].splitlines()) == 1
    assert grown <= 3 * len(body), (shape, grown, len(body), sorted(statuses)[-3:])
    assert max(statuses) <= STATUS_GOAL, (shape, sorted(statuses)[-5:])
    assert m.status()["datasets"] == []  # and mountd goes on


@needs_mount
def test_registering_one_digest_again_takes_no_more_memory(mountd_factory, tmp_path):  # noqa: F811
    """A digest of 25 MB registered under five names, after a 31 MiB request that is
    no digest: the first takes its copy, and the others (found to be that copy) take
    nothing that stays. Before, the large request raised glibc's thresholds, and the
    registrations' frames and copies stayed in the heap (54 MB more after the second);
    decoded in a worker thread, they stayed in that thread's arena (52 MB)."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "blob").write_bytes(bytes(range(256)))
    items = [digest_format.NewItem(path=f"c{i % 100:02d}/i{i:07d}",
                                   digest=hashlib.sha256(bytes([i % 256])).digest(),
                                   size=1, key="blob", offset=i % 256)
             for i in range(300_000)]
    data = digest_format.encode("big", f"file://{src}", items)
    m = mountd_factory()
    with pytest.raises(QuietError) as refused:
        m.call({"op": "mount", "name": "junk", "digest": b"\0" * (31 << 20)})
    assert refused.value.exitcode == ExitCode.BAD_DIGEST
    rss = []
    for k in range(5):
        assert m.call({"op": "mount", "name": f"d{k}", "digest": data})["items"] == len(items)
        rss.append(vm_kb(m.proc.pid, "VmRSS") * 1024)
    assert max(rss[1:]) - rss[0] <= REPEAT_BYTES, (len(data), rss)


def test_requests_of_every_legitimate_shape_decode():
    """What the limits must let through: a registration with a key file's credentials
    and a large digest."""
    from mountd.control.server import REQUEST_LIMITS

    credentials = {"type": "service_account", "private_key": "k" * 3300,
                   **{f"field{i}": "x" * 100 for i in range(20)}}
    request = {"op": "mount", "name": "d", "digest": b"\0" * (BODY * 4),
               "credentials": credentials, "emulator_host": None, "anonymous": False,
               "view": "exact", "prefetch": True}
    assert wire.unpack(msgpack.packb(request, use_bin_type=True), REQUEST_LIMITS) == request


async def test_an_rpc_frame_of_empty_arrays_is_refused_within_its_bytes(tmp_path):
    """A peer that passed the handshake sends a real coordinator 16 MiB of empty
    arrays: an error reply, the connection goes on, and the coordinator grew by at
    most three times the frame."""
    secret_file = str(tmp_path / "secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET)
    coordinator = CoordinatorProcess(str(tmp_path / "coordinator"), secret_file,
                                     str(tmp_path / "coordinator.log"))
    coordinator.start()
    pid = coordinator.proc.pid
    body = _array(b"\x90", BODY)
    try:
        stream = await trio.open_tcp_stream("127.0.0.1", coordinator.port)
        async with stream:
            await rpc.client_handshake(stream, SECRET)
            before = vm_kb(pid, "VmRSS")
            with open(f"/proc/{pid}/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            await stream.send_all(wire.HEADER.pack(len(body)) + body)
            reply = wire.unpack(await wire.recv_frame(stream))
            grown = (vm_kb(pid, "VmHWM") - before) * 1024
            await wire.send_msg(stream, {"id": 7, "op": "status", "args": {}})
            after = wire.unpack(await wire.recv_frame(stream))
    finally:
        assert coordinator.stop() == 0
    assert grown <= 3 * len(body), (grown, reply)
    assert reply["ok"] is False and reply["id"] is None, reply
    assert "max_array_len" in reply["error"], reply
    assert after["id"] == 7 and after["ok"] is True, after

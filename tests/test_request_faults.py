"""A fault below a request ends that request, never the daemon: FUSE handlers answer
EIO, the control server answers an error, and a uid cannot take all connections."""
from __future__ import annotations

import errno
import os
import socket
import types
from typing import Any

import pyfuse3
import pytest
import trio
import trio.testing

from mountd.control.server import (MAX_CONNECTIONS_PER_UID, SMALL_FRAME, ControlServer,
                                   FrameBytes, Peer)
from mountd.datasets.mount_table import FIRST_DATASET_INODE, MountTable
from mountd.fetch.read_stats import ReadStats
from mountd.fs.datasets_fs import QuiverFS
from mountd.jobs.registry import MAX_JOBS_PER_USER, JobLimit, JobRegistry
from quiverfs import control_client, wire
from quiverfs.errors import ExitCode, QuietError
from tests.mountd_helpers import run_as


class BrokenTable(MountTable):
    """A mount table whose look-ups fail the way a bug would."""

    def resolve(self, inode: int) -> Any:
        raise RuntimeError("injected fault")


def no_reads() -> Any:
    """The read path's counters only: no request here gets as far as reading."""
    return types.SimpleNamespace(reader=None, stats=ReadStats(), push=None, store=None,
                                 limiter=None)


@pytest.mark.parametrize("no_open", [False, True])
async def test_fuse_handler_fault_answers_eio_and_is_logged(caplog, no_open):
    fs = QuiverFS(BrokenTable(), no_reads(), no_open)
    last = (fs.read(0, 0, 4096, FIRST_DATASET_INODE) if no_open
            else fs.open(FIRST_DATASET_INODE, os.O_RDONLY, None))
    for call in (fs.getattr(FIRST_DATASET_INODE), fs.lookup(FIRST_DATASET_INODE, b"x"), last):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await call
        assert info.value.errno == errno.EIO
    op = "read" if no_open else "open"
    assert [r.getMessage() for r in caplog.records if r.name == "mountd.fs.datasets_fs"] == [
        f"FUSE {name} failed: answered EIO" for name in ("getattr", "lookup", op)]
    assert caplog.text.count("RuntimeError: injected fault") == 3
    assert fs.stats.fuse_requests == {"getattr": 1, "lookup": 1, op: 1}


async def test_fuse_errors_pass_through_unchanged():
    fs = QuiverFS(MountTable(), no_reads(), True)
    for call in (fs.getattr(FIRST_DATASET_INODE), fs.read(0, 0, 1, FIRST_DATASET_INODE)):
        with pytest.raises(pyfuse3.FUSEError) as info:
            await call
        assert info.value.errno == errno.ENOENT
    with pytest.raises(pyfuse3.FUSEError) as info:  # no-open mode: the kernel opens alone
        await fs.open(FIRST_DATASET_INODE, os.O_RDONLY, None)
    assert info.value.errno == errno.ENOSYS


async def failing(peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
    raise RuntimeError("injected fault")


async def echo(peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
    return {"uid": peer.uid}


async def test_control_request_that_fails_gets_an_error_and_the_server_goes_on(tmp_path,
                                                                              caplog):
    path = str(tmp_path / "control.sock")
    server = ControlServer(path, {"fail": failing, "echo": echo})
    server.bind()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with pytest.raises(QuietError) as info:
            await trio.to_thread.run_sync(control_client.call, path, {"op": "fail"})
        assert info.value.exitcode == ExitCode.DAEMON
        assert "RuntimeError" in info.value.message
        reply = await trio.to_thread.run_sync(control_client.call, path, {"op": "echo"})
        assert reply["uid"] == 0
        nursery.cancel_scope.cancel()
    assert "injected fault" in caplog.text


@pytest.mark.parametrize("unpackable", [{1, 2}, 1 << 64])  # a set; an int past u64
async def test_a_reply_that_cannot_be_sent_is_an_error_and_the_server_goes_on(tmp_path,
                                                                             caplog,
                                                                             unpackable):
    """A handler's reply msgpack cannot pack (a bug) costs that request an error reply;
    before, its TypeError (or OverflowError) ended the server's task, and mountd."""
    async def unsendable(peer: Peer, req: dict[str, Any]) -> dict[str, Any]:
        return {"items": unpackable}

    path = str(tmp_path / "control.sock")
    server = ControlServer(path, {"unsendable": unsendable, "echo": echo})
    server.bind()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(path)
            s.sendall(wire.pack({"op": "unsendable"}))
            reply = await trio.to_thread.run_sync(wire.sock_recv_msg, s)
            assert reply == {"ok": False, "error": "internal error: see mountd's log",
                             "code": int(ExitCode.DAEMON)}
            assert (await trio.to_thread.run_sync(echo_on, s))["uid"] == 0  # same connection
        nursery.cancel_scope.cancel()
    assert "control reply to uid 0 cannot be sent" in caplog.text


def echo_on(s: socket.socket) -> dict[str, Any]:
    return control_client.exchange(s, {"op": "echo"})


def hold_connections_as(uid: int, path: str, n: int) -> dict[str, Any]:
    """From a child running as ``uid``: hold ``n`` control connections (each answered
    once, so the server has counted it), then make a request on one more and report
    its reply."""
    def hold() -> dict[str, Any]:
        held = []
        for _ in range(n + 1):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(30)
            s.connect(path)
            held.append(s)
            reply = echo_on(s)
        return reply
    return run_as(uid, uid, hold)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another uid")
async def test_one_uid_cannot_take_all_control_connections(shared_workdir):
    path = os.path.join(shared_workdir, "control.sock")  # other uids can reach it
    server = ControlServer(path, {"echo": echo})
    server.bind()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        within = await trio.to_thread.run_sync(hold_connections_as, 1000, path,
                                               MAX_CONNECTIONS_PER_UID - 1)
        assert within == {"ok": True, "uid": 1000}
        over = await trio.to_thread.run_sync(hold_connections_as, 1001, path,
                                             MAX_CONNECTIONS_PER_UID)
        assert not over["ok"] and over["code"] == ExitCode.DAEMON
        assert "too many control connections" in over["error"]
        # another user (root here) is still served
        reply = await trio.to_thread.run_sync(control_client.call, path, {"op": "echo"})
        assert reply["uid"] == 0
        nursery.cancel_scope.cancel()


def test_a_refusal_sent_before_the_request_is_read_reaches_the_client():
    """mountd answers a connection over its uid's limit and closes it unread: a client
    whose send comes after the close (EPIPE) still reads the refusal (it failed as
    'Broken pipe' in one CI run, from a test that holds connections)."""
    client, server = socket.socketpair(socket.AF_UNIX)
    with client, server:
        refusal = {"ok": False, "error": "too many control connections open",
                   "code": int(ExitCode.DAEMON)}
        server.sendall(wire.pack(refusal))
        server.close()
        assert control_client.exchange(client, {"op": "echo"}) == refusal


MiB = 1 << 20


async def test_large_frames_wait_for_room_per_uid_and_in_all():
    frames = FrameBytes(per_uid=3 * MiB, total=5 * MiB)
    inside: list[str] = []
    done = {tag: trio.Event() for tag in ("a", "b", "c", "root", "small")}

    async def hold(tag: str, uid: int, n: int) -> None:
        async with frames.hold(uid, n):
            inside.append(tag)
            await done[tag].wait()

    async with trio.open_nursery() as nursery:
        for tag, uid, n in (("a", 1000, 2 * MiB), ("b", 1000, 2 * MiB), ("c", 1001, 3 * MiB),
                            ("root", 0, 2 * MiB), ("small", 1000, SMALL_FRAME - 1)):
            nursery.start_soon(hold, tag, uid, n)
            await trio.testing.wait_all_tasks_blocked()
        # b waits for its uid's room, root for the total's; a small frame never waits
        assert inside == ["a", "c", "small"] and dict(frames.held) == {1000: 2 * MiB,
                                                                       1001: 3 * MiB}
        done["c"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert inside[3:] == ["root"]  # b still over its uid's 3 MiB
        done["a"].set()
        await trio.testing.wait_all_tasks_blocked()
        assert inside[4:] == ["b"]
        for event in done.values():
            event.set()
    assert not frames.held


async def test_a_request_that_trickles_is_dropped_and_the_waiting_one_served(tmp_path):
    path = str(tmp_path / "control.sock")
    timeout = 1.0
    server = ControlServer(path, {"echo": echo}, FrameBytes(4 * MiB, 4 * MiB), timeout)
    server.bind()
    async with trio.open_nursery() as nursery:
        await nursery.start(server.serve)
        with socket.socket(socket.AF_UNIX) as slow:
            slow.connect(path)
            started = trio.current_time()
            slow.sendall(wire.HEADER.pack(3 * MiB) + b"\x81")  # and nothing more
            with trio.fail_after(10):
                while server.frames.held[0] != 3 * MiB:
                    await trio.sleep(0.01)
            # a whole request of 3 MiB does not fit beside it: it waits for the drop
            reply = await trio.to_thread.run_sync(control_client.call, path, {
                "op": "echo", "pad": b"\0" * (3 * MiB - 100)})
            assert reply["uid"] == 0
            assert trio.current_time() - started >= timeout
            dropped = await trio.to_thread.run_sync(wire.sock_recv_msg, slow)
        assert not dropped["ok"] and "did not arrive within 1 s" in dropped["error"]
        assert not server.frames.held
        nursery.cancel_scope.cancel()


def test_jobs_per_uid_are_bounded():
    jobs = JobRegistry(MountTable(), trio.CapacityLimiter(1))
    for i in range(MAX_JOBS_PER_USER):
        jobs.create(f"j{i}", 1000, 1000)
    with pytest.raises(JobLimit):
        jobs.create("one-more", 1000, 1000)
    jobs.create("another-users", 1001, 1001)
    jobs.create("roots", 0, 0)
    assert len(jobs.jobs) == MAX_JOBS_PER_USER + 2

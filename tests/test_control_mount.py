"""``ROOT/.quiver``'s mount (mountd.fs.control_mount) in this process: its first start
failing is mountd's failure, while a restart that fails after its process died is
logged and tried again (left to propagate, it would end mountd for every user)."""
from __future__ import annotations

import collections
import errno
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest
import trio

from mountd.datasets.mount_table import MountTable
from mountd.fs.control_fs import ControlFS
from mountd.fs.control_mount import ControlMount
from mountd.fs.job_files import ControlFiles
from mountd.jobs.planner import BatchPlanner
from mountd.jobs.registry import JobRegistry
from mountd.store.content_store import ContentStore
from mountd.view.view_jobs import ViewJobs
from quiverfs.errors import QuietError
from quiverfs.mount_point import is_mounted
from tests.mountd_helpers import lone_services

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


@pytest.fixture
def mount(tmp_path) -> Iterator[ControlMount]:
    """A control mount on ``tmp_path/root/.quiver``, checked unmounted at the end."""
    root = tmp_path / "root"
    (root / ".quiver").mkdir(parents=True)
    services = lone_services(ContentStore(str(tmp_path / "store"), 1 << 20),
                             str(tmp_path / "coordinator"))
    table = MountTable()
    jobs = JobRegistry(table, services.limiter)
    fs = ControlFS(table, services.reader, ControlFiles(jobs, BatchPlanner(services)),
                   ViewJobs(jobs, services))
    m = ControlMount(str(root), fs, collections.Counter())
    yield m
    left = is_mounted(m.mountpoint)
    if left:
        subprocess.run(["fusermount3", "-u", "-z", m.mountpoint], check=False)
    assert not left, f"{m.mountpoint} still mounted"


def _served(mountpoint: str) -> bool:
    """Whether a live control mount answers at ``mountpoint``."""
    try:
        return sorted(os.listdir(mountpoint)) == ["jobs", "views"]
    except OSError:  # the dead mount, before it is detached
        return False


@pytest.mark.parametrize("failure", ["no process", "ends before mounting"])
async def test_a_failed_restart_is_logged_and_tried_again(mount, monkeypatch, caplog, failure):
    real = trio.lowlevel.open_process
    starts = 0

    async def open_process(command: list[str], **kwargs: object) -> trio.Process:
        nonlocal starts
        starts += 1
        if starts == 2:  # the first restart
            if failure == "no process":
                raise OSError(errno.EAGAIN, "no process for now")
            command = [sys.executable, "-c", "pass"]  # the mount never appears
        return await real(command, **kwargs)

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)
    caplog.set_level(logging.INFO, logger="mountd.fs.control_mount")
    async with trio.open_nursery() as nursery:
        await nursery.start(mount.run)
        assert await trio.to_thread.run_sync(_served, mount.mountpoint)
        os.kill(mount._proc.pid, signal.SIGKILL)
        with trio.fail_after(30):
            # mountd detaches the dead mount, fails once, and mounts it again
            while not (starts == 3 and await trio.to_thread.run_sync(_served,
                                                                     mount.mountpoint)):
                await trio.sleep(0.1)
        await mount.stop()
    failed = [r for r in caplog.records if r.exc_info is not None]
    assert len(failed) == 1 and "trying again" in failed[0].getMessage()
    assert issubclass(failed[0].exc_info[0],
                      OSError if failure == "no process" else QuietError)
    assert "mounting it again" in caplog.text and "mounted again" in caplog.text


@pytest.mark.parametrize("failure", ["no process", "ends before mounting"])
async def test_a_failed_first_start_is_mountds(mount, monkeypatch, failure):
    real = trio.lowlevel.open_process

    async def open_process(command: list[str], **kwargs: object) -> trio.Process:
        if failure == "no process":
            raise OSError(errno.EAGAIN, "no process for now")
        return await real([sys.executable, "-c", "pass"], **kwargs)

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)
    async with trio.open_nursery() as nursery:
        with pytest.raises(OSError if failure == "no process" else QuietError):
            await nursery.start(mount.run)


async def test_detaching_without_fusermount3_is_logged_once(mount, tmp_path, monkeypatch,
                                                           caplog):
    monkeypatch.setenv("PATH", str(tmp_path))  # no fusermount3 there
    for _ in range(3):  # a restart detaches each time it tries
        await mount._detach()
    logged = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(logged) == 1 and "fusermount3" in logged[0].getMessage()


async def test_stopping_while_a_restart_starts_its_process_ends_that_process(mount,
                                                                            monkeypatch):
    real = trio.lowlevel.open_process
    starting, go_on = trio.Event(), trio.Event()
    procs: list[trio.Process] = []

    async def open_process(command: list[str], **kwargs: object) -> trio.Process:
        if procs:  # the restart: stop() comes while its process starts
            starting.set()
            await go_on.wait()
        procs.append(await real(command, **kwargs))
        return procs[-1]

    monkeypatch.setattr(trio.lowlevel, "open_process", open_process)
    stopped = trio.Event()

    async def stop() -> None:
        await mount.stop()
        stopped.set()

    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(mount.run)
            os.kill(procs[0].pid, signal.SIGKILL)
            with trio.fail_after(30):
                await starting.wait()
                nursery.start_soon(stop)
                while not mount._stopping:
                    await trio.sleep(0)
                go_on.set()
                await stopped.wait()
                while len(procs) < 2:  # (before, stop() returned before it had started)
                    await trio.sleep(0.01)
            # the restart's process ended before stop() returned, its mount never made
            assert len(procs) == 2 and procs[1].returncode is not None
            assert not is_mounted(mount.mountpoint)
            nursery.cancel_scope.cancel()
    finally:
        for proc in procs:
            if proc.returncode is None:
                proc.kill()


async def test_an_answer_that_cannot_be_packed_is_eio_and_the_mount_goes_on(mount, caplog):
    """A handler's answer msgpack cannot pack (a bug) costs that request EIO; before, its
    TypeError ended the link, and the child serving every user's ``.quiver`` with it."""
    async def listxattr(inode: int, ctx: object) -> object:
        return {b"user.a"}  # a set: msgpack packs no sets

    mount.fs.listxattr = listxattr
    async with trio.open_nursery() as nursery:
        await nursery.start(mount.run)
        child = mount._proc.pid

        def listed() -> int | list[str]:
            try:
                return os.listxattr(mount.mountpoint)
            except OSError as exc:
                return exc.errno

        assert await trio.to_thread.run_sync(listed) == errno.EIO
        assert await trio.to_thread.run_sync(_served, mount.mountpoint)
        assert mount._proc.pid == child and mount._proc.returncode is None
        await mount.stop()
    assert "FUSE control.listxattr: its answer cannot be sent: answered EIO" in caplog.text
    assert "trying again" not in caplog.text and "mounting it again" not in caplog.text

"""A stalled bucket cannot hold mountd: a body that trickles fails within the fetch
deadline, an unmount ends its dataset's fetches, SIGTERM ends mountd at once, and a
mountd killed with loader processes fetching leaves nothing behind. The "bucket" is a
loopback listener that sends one byte at a time (tests/slow_listener.py); the digest is
made against the real emulator."""
from __future__ import annotations

import errno
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from quiverfs.bench.processes import MountdProcess
from tests.mountd_helpers import dataset_counters, make_digest, mount, mountd_factory  # noqa: F401
from tests.slow_listener import SlowListener, slow_listener
from tests.test_loader_pool import fetching, loader_pids

needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

TRICKLE = 1.0  # seconds between two bytes of a stalled body
READERS = 4  # files read at once from the stalled dataset
WAIT = 30.0  # seconds a poll waits for what the test expects, before it fails
STOP_GOAL = 5.0  # seconds SIGTERM may take to end mountd, whatever its fetches do


def wait_for(what: str, check: Callable[[], object], timeout: float = WAIT) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout:g} s waiting for {what}")


@pytest.fixture
def gcs_digest(synthetic_tree, upload, gcs_emulator) -> tuple[bytes, list[str]]:
    """The synthetic tree's digest, made against the emulator, and its files."""
    data = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    files = sorted(os.path.relpath(os.path.join(d, f), synthetic_tree.root)
                   for d, _, names in os.walk(synthetic_tree.root) for f in names)
    return data, files


@pytest.fixture
def listener() -> Iterator[SlowListener]:
    with slow_listener(TRICKLE) as it:
        yield it


class Readers:
    """Threads that each read one file; what each read raised (or None)."""

    def __init__(self, paths: list[str]) -> None:
        self.errors: dict[str, OSError | None] = {}
        self.threads = [threading.Thread(target=self._read, args=(p,), daemon=True)
                        for p in paths]
        for thread in self.threads:
            thread.start()

    def _read(self, path: str) -> None:
        try:
            with open(path, "rb") as f:
                f.read()
            self.errors[path] = None
        except OSError as exc:
            self.errors[path] = exc

    def done(self) -> bool:
        return not any(t.is_alive() for t in self.threads)


def start_stalled(factory, gcs_digest, listener: SlowListener, loaders: int,
                  *args: str) -> tuple[MountdProcess, Readers]:
    """A mountd (``loaders`` loader processes) with the digest mounted against the
    listener, and READERS readers each stalled on a fetch of its own file."""
    m = factory(extra_args=("--loader-processes", str(loaders), "--probe-batches", "0", *args))
    data, files = gcs_digest
    mount(m, data, "syn", emulator_host=listener.url)
    if loaders:
        m.wait_for_loaders()
    readers = Readers([os.path.join(m.root, "syn", p) for p in files[:READERS]])
    wait_for(f"{READERS} stalled fetches", lambda: listener.counts()[1] >= READERS)
    return m, readers


@needs_fuse
@pytest.mark.parametrize("loaders", [0, 1])
def test_a_trickling_body_fails_within_the_fetch_deadline(mountd_factory, gcs_digest,
                                                          listener, loaders):
    """Each read fails with EIO, counted as a bucket error, within a bounded time,
    though a byte arrives every TRICKLE seconds (no socket read times out)."""
    m, readers = start_stalled(mountd_factory, gcs_digest, listener, loaders,
                               "--fetch-deadline", "2")
    wait_for("the stalled reads to fail", readers.done)
    assert [e.errno if e else None for e in readers.errors.values()] == [errno.EIO] * READERS
    assert dataset_counters(m, "syn")["bucket_errors"] == READERS
    assert "was not read within 2 s" in m.log_tail(200)
    wait_for("the stalled connections to close", lambda: listener.counts()[1] == 0)


@needs_fuse
@pytest.mark.parametrize("loaders", [0, 1])
@pytest.mark.parametrize("silent", [False, True], ids=["trickling", "silent"])
def test_umount_ends_the_datasets_fetches(mountd_factory, gcs_digest, loaders, silent):
    """After 'quiver umount', the listener sees every connection closed and no new one;
    the stalled reads fail (the fetch deadline, 30 s by default, is not what ends
    them), whether they wait for a body or for the headers."""
    with slow_listener(TRICKLE, silent) as listener:
        m, readers = start_stalled(mountd_factory, gcs_digest, listener, loaders)
        m.call({"op": "umount", "name": "syn"})
        wait_for("the stalled connections to close", lambda: listener.counts()[1] == 0)
        opened = listener.counts()[0]
        wait_for("the stalled reads to fail", readers.done)
        # EIO, or ENOENT where the read learns that its dataset is gone
        assert all(e is not None and e.errno in (errno.EIO, errno.ENOENT)
                   for e in readers.errors.values()), readers.errors
        assert listener.counts() == (opened, 0)  # none retried
        assert m.status()["datasets"] == []


@needs_fuse
@pytest.mark.parametrize("loaders", [0, 1])
@pytest.mark.parametrize("silent", [False, True], ids=["trickling", "silent"])
def test_sigterm_ends_mountd_within_seconds_during_stalled_fetches(mountd_factory,
                                                                   gcs_digest, loaders,
                                                                   silent):
    """Whether the stalled fetches wait for a body or for the headers, in mountd's
    workers or in loader processes: mountd exits 0 within STOP_GOAL, unmounted, its
    loader processes gone."""
    with slow_listener(TRICKLE, silent) as listener:
        m, readers = start_stalled(mountd_factory, gcs_digest, listener, loaders)
        assert m.proc is not None
        m.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        wait_for("mountd to exit", lambda: m.proc.poll() is not None, timeout=WAIT)
        took = time.monotonic() - started
        assert m.proc.returncode == 0, m.log_tail()
        assert took <= STOP_GOAL, f"mountd took {took:.1f} s to exit after SIGTERM"
        assert not os.path.ismount(m.root)
        assert loader_pids(m) == set()
        wait_for("the stalled reads to end", readers.done)


def control_mount_pids(m: MountdProcess) -> set[int]:
    """The processes serving ROOT/.quiver for mountd ``m``."""
    mountpoint = os.path.join(m.root, ".quiver").encode()
    pids = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if b"mountd.fs.control_mount_process" in argv and mountpoint in argv:
            pids.add(int(entry))
    return pids


@needs_fuse
def test_a_killed_mountd_leaves_no_process_and_a_restart_serves(mountd_factory, gcs_digest,
                                                                  listener, synthetic_tree,
                                                                  gcs_emulator):
    """kill -9 while loader processes are stalled on fetches: they and the control
    mount's process end at once (their pipe and socket to mountd close), and a mountd
    started again on the same root mounts it and serves the dataset's bytes."""
    m, _ = start_stalled(mountd_factory, gcs_digest, listener, 1)
    loaders = loader_pids(m)
    assert any(fetching(pid) for pid in loaders)
    assert control_mount_pids(m)
    m.kill()
    wait_for("the loader processes to exit", lambda: not loader_pids(m), timeout=10.0)
    wait_for("the control mount's process to exit", lambda: not control_mount_pids(m),
             timeout=10.0)

    m2 = mountd_factory(cache_dir=m.cache_dir)  # same root and cache dir, stale mount
    assert [d["name"] for d in m2.status()["datasets"]] == ["syn"]
    data, files = gcs_digest
    mount(m2, data, "fresh", emulator_host=gcs_emulator.host)
    with open(os.path.join(synthetic_tree.root, files[-1]), "rb") as f:
        expected = f.read()
    with open(os.path.join(m2.root, "fresh", files[-1]), "rb") as f:
        assert f.read() == expected

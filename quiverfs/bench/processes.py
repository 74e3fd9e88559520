"""mountd and coordinator child processes for tests, the demo and benchmarks; always
stopped, and their mounts always unmounted."""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from quiverfs import control_client
from quiverfs.errors import QuietError
from quiverfs.mount_point import is_mounted

START_TIMEOUT = 60.0  # seconds
STOP_TIMEOUT = 30.0


def terminate(proc: subprocess.Popen | None) -> int:
    """SIGTERM ``proc`` (SIGKILL if it is still there after STOP_TIMEOUT); its status."""
    if proc is None:
        return 0
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


def unmount(root: str) -> None:
    """Unmount ``root`` if anything is mounted there: politely, then lazily."""
    for args in (["-u"], ["-u", "-z"]):
        if not is_mounted(root):
            return
        subprocess.run(["fusermount3", *args, root], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class MountdProcess:
    """A ``quiver mountd --foreground`` child with its own root, cache dir and socket."""

    def __init__(self, root: str, cache_dir: str, cache_size: str, log_path: str,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None,
                 wrapper: tuple[str, ...] = ()) -> None:
        self.root = os.path.abspath(root)
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.log_path = log_path
        self.socket = os.path.join(cache_dir, "control.sock")
        self.extra_args = extra_args
        self.env = env
        self.wrapper = wrapper  # a command mountd runs under, such as setpriv
        self.proc: subprocess.Popen | None = None

    def argv(self) -> list[str]:
        """The command line that ``start`` runs."""
        return [*self.wrapper, sys.executable, "-m", "quiverfs.cli", "mountd", "--foreground",
                "--root", self.root, "--cache-dir", self.cache_dir,
                "--cache-size", self.cache_size, "--control-socket", self.socket,
                *self.extra_args]

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.argv(), stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, env=self.env)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mountd exited with {self.proc.returncode}: "
                                   f"{self.log_tail()}")
            if is_mounted(self.root) and os.path.exists(self.socket):
                try:
                    self.call({"op": "status"})
                    return
                except QuietError:
                    pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"mountd did not come up: {self.log_tail()}")
            time.sleep(0.05)

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        return control_client.call(self.socket, request, root=self.root)

    def status(self) -> dict[str, Any]:
        return self.call({"op": "status"})

    def wait_for_mode(self, mode: str, timeout: float) -> None:
        """Wait until the coordinator allots one of this node's datasets ``mode`` (the
        cycles are another process's state: polled); RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            cycles = self.call({"op": "cluster"})["cycles"]
            if any(c["mode"] == mode for c in cycles.values()):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no dataset was allotted {mode} within {timeout:g} s: "
                                   f"{cycles}")
            time.sleep(0.1)

    def wait_for_loaders(self, timeout: float = START_TIMEOUT) -> None:
        """Wait until the loader processes of every pool mountd has started are ready for
        requests (the serving pool starts when a dataset in a GCS bucket is mounted; a
        job's own start-up leaves it that time); RuntimeError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            pools = self.status()["loader_processes"]
            started = [p for p in pools.values() if p["running"]]
            if started and all(p["ready"] == p["processes"] for p in started):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"mountd's loader processes were not ready within "
                                   f"{timeout:g} s: {pools}")
            time.sleep(0.05)

    def stop(self) -> int:
        """SIGTERM and wait; return the exit status (the mount is gone afterwards)."""
        rc = terminate(self.proc)
        unmount(self.root)
        return rc

    def kill(self) -> None:
        """SIGKILL, leaving whatever mount state a crash leaves."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, n: int = 20) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except FileNotFoundError:
            return "(no log)"


@contextlib.contextmanager
def running_mountd(workdir: str, cache_size: str = "1G", name: str = "node",
                   extra_args: tuple[str, ...] = ()) -> Iterator[MountdProcess]:
    """A started mountd under ``workdir``/NAME-{mnt,cache}; stopped and unmounted on exit."""
    root = os.path.join(workdir, f"{name}-mnt")
    cache_dir = os.path.join(workdir, f"{name}-cache")
    os.makedirs(root, exist_ok=True)
    os.makedirs(cache_dir, exist_ok=True)
    proc = MountdProcess(root, cache_dir, cache_size, os.path.join(workdir, f"{name}.log"),
                         extra_args)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        unmount(root)


class CoordinatorProcess:
    """A ``quiver coordinator`` child process on a free loopback port."""

    def __init__(self, state_dir: str | None, secret_file: str, log_path: str,
                 heartbeat_timeout: float = 2.0, force_evict_after: float = 30.0,
                 port: int = 0, extra_args: tuple[str, ...] = ()) -> None:
        self.state_dir = state_dir
        self.secret_file = secret_file
        self.log_path = log_path
        self.heartbeat_timeout = heartbeat_timeout
        self.force_evict_after = force_evict_after
        self.port = port or free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.extra_args = extra_args
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        state = ("--state-dir", self.state_dir) if self.state_dir is not None else ()
        argv = [sys.executable, "-m", "quiverfs.cli", "coordinator", "--listen", self.address,
                *state, "--cluster-secret-file", self.secret_file,
                "--heartbeat-timeout", str(self.heartbeat_timeout),
                "--force-evict-after", str(self.force_evict_after), *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"coordinator exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("coordinator did not come up")
            time.sleep(0.05)

    def stop(self) -> int:
        return terminate(self.proc)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

"""Run a mountd as a child process (tests, the demo and benchmarks), and always unmount."""
from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from quiverfs import control_client
from quiverfs.errors import QuietError

START_TIMEOUT = 60.0  # seconds
STOP_TIMEOUT = 30.0


def unmount(root: str) -> None:
    """Unmount ``root`` if anything is mounted there: politely, then lazily."""
    for args in (["-u"], ["-u", "-z"]):
        if not is_mounted(root):
            return
        subprocess.run(["fusermount3", *args, root], check=False,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def is_mounted(root: str) -> bool:
    try:
        return os.path.ismount(root)
    except OSError as exc:
        return exc.errno == errno.ENOTCONN


class MountdProcess:
    """A ``quiver mountd --foreground`` child with its own root, cache dir and socket."""

    def __init__(self, root: str, cache_dir: str, cache_size: str, log_path: str,
                 extra_args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.root = os.path.abspath(root)
        self.cache_dir = cache_dir
        self.cache_size = cache_size
        self.log_path = log_path
        self.socket = os.path.join(cache_dir, "control.sock")
        self.extra_args = extra_args
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        argv = [sys.executable, "-m", "quiverfs.cli", "mountd", "--foreground",
                "--root", self.root, "--cache-dir", self.cache_dir,
                "--cache-size", self.cache_size, "--control-socket", self.socket,
                *self.extra_args]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
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

    def stop(self) -> int:
        """SIGTERM and wait; return the exit status (the mount is gone afterwards)."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        unmount(self.root)
        return self.proc.returncode

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

"""Run a daemon's command line the way systemd runs a ``Type=notify`` unit."""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

from quiverfs.bench.processes import terminate, unmount
from quiverfs.mount_point import is_mounted

READY_TIMEOUT = 60.0  # seconds


class NotifyDaemon:
    """A child whose $NOTIFY_SOCKET is a datagram socket this object holds."""

    def __init__(self, argv: list[str], workdir: str, root: str,
                 env: dict[str, str] | None = None) -> None:
        self.argv = argv
        self.root = root
        self.log_path = os.path.join(workdir, "daemon.log")
        # A short path: a unix socket's name is limited to 107 bytes.
        self._notify_dir = tempfile.mkdtemp(prefix="quiver-notify-")
        self.notify_path = os.path.join(self._notify_dir, "notify.sock")
        self.env = {**os.environ, **(env or {}), "NOTIFY_SOCKET": self.notify_path}
        self.messages: list[str] = []
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start the command and return once it sent READY=1; fail if it exits first."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.bind(self.notify_path)
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=log, env=self.env)
            deadline = time.monotonic() + READY_TIMEOUT
            while "READY=1" not in self.messages:
                if self.proc.poll() is not None:
                    pytest.fail(f"{self.argv} exited {self.proc.returncode} before READY=1:\n"
                                f"{self.log()}")
                if time.monotonic() > deadline:
                    pytest.fail(f"no READY=1 within {READY_TIMEOUT:.0f} s:\n{self.log()}")
                sock.settimeout(0.2)  # to notice an early exit while waiting
                try:
                    self.messages.extend(sock.recv(4096).decode().splitlines())
                except TimeoutError:
                    continue

    def stop(self) -> int:
        """SIGTERM, as systemd stops a unit; the exit status."""
        shutil.rmtree(self._notify_dir, ignore_errors=True)
        return terminate(self.proc)

    def log(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()
        except FileNotFoundError:
            return "(no log)"


@pytest.fixture
def notify_daemon() -> Iterator[Callable[..., NotifyDaemon]]:
    """``notify_daemon(argv, workdir, root, env)``: started until READY=1; at the end
    stopped with SIGTERM, checked for a clean exit and no traceback, and unmounted."""
    started: list[NotifyDaemon] = []

    def start(argv: list[str], workdir: str, root: str,
              env: dict[str, str] | None = None) -> NotifyDaemon:
        daemon = NotifyDaemon(argv, workdir, root, env)
        started.append(daemon)
        daemon.start()
        return daemon

    yield start
    failures = []
    for daemon in started:
        rc = daemon.stop()
        if rc != 0:
            failures.append(f"{daemon.argv} exited {rc}:\n{daemon.log()}")
        if "Traceback" in daemon.log():
            failures.append(f"traceback in the log:\n{daemon.log()}")
        unmount(daemon.root)
        if is_mounted(daemon.root):
            failures.append(f"{daemon.root} is still mounted")
    assert not failures, "\n".join(failures)

"""A real etcd member as a child process on loopback ports, for tests and the cluster
benchmark's coordinator failover: started in a directory of its own, always stopped."""
from __future__ import annotations

import base64
import dataclasses
import json
import os
import shutil
import signal
import ssl
import subprocess
import time
import urllib.request

from quiverfs.bench.processes import free_port, terminate

START_TIMEOUT = 30.0  # seconds for etcd to answer its health check
PREFIX = "/quiver/default/"  # the coordinators' keys with the default --etcd-prefix


def etcd_available() -> bool:
    """Whether the ``etcd`` and ``etcdctl`` commands are installed."""
    return shutil.which("etcd") is not None and shutil.which("etcdctl") is not None


@dataclasses.dataclass(frozen=True)
class EtcdTls:
    """PEM files for an etcd serving its clients over TLS: the CA, etcd's certificate
    and key, and a client's certificate and key that the CA signed."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


class Etcd:
    """An etcd member on two free loopback ports, its data in ``base``; alone, or one of
    the members ``cluster`` names (NAME=PEER_URL, comma-separated). With ``tls``, its
    clients reach it at https and must show a certificate the CA signed; ``args`` are
    more of etcd's options. ``user`` (NAME:PASSWORD) is what ``ctl`` authenticates as
    once auth is enabled."""

    def __init__(self, base: str, name: str = "ha", tls: EtcdTls | None = None,
                 args: tuple[str, ...] = ()) -> None:
        self.base = base
        self.name = name
        self.tls = tls
        self.args = args
        self.user: str | None = None
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.peer = f"http://127.0.0.1:{free_port()}"
        self.cluster = f"{name}={self.peer}"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> None:
        tls = () if self.tls is None else (
            "--cert-file", self.tls.server_cert, "--key-file", self.tls.server_key,
            "--trusted-ca-file", self.tls.ca, "--client-cert-auth")
        with open(os.path.join(self.base, f"{self.name}.log"), "ab") as log:
            self.proc = subprocess.Popen(
                ["etcd", "--name", self.name,
                 "--data-dir", os.path.join(self.base, f"{self.name}.etcd"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", self.peer, "--initial-advertise-peer-urls", self.peer,
                 "--initial-cluster", self.cluster, *tls, *self.args],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        if wait:
            self.wait()

    def wait(self) -> None:
        """Until etcd answers healthy; RuntimeError if it exits or takes START_TIMEOUT."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self._healthy():
            if self.proc.poll() is not None:
                raise RuntimeError(f"etcd exited with {self.proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not come up within {START_TIMEOUT:g} s")
            time.sleep(0.05)

    def quorum(self) -> bool:
        """Whether a linearizable read through this member succeeds."""
        return subprocess.run([*self._etcdctl(), "--command-timeout=1s", "get", "quorum"],
                              capture_output=True,
                              env={**os.environ, "ETCDCTL_API": "3"}).returncode == 0

    def _healthy(self) -> bool:
        context = None
        if self.tls is not None:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=1,
                                        context=context) as reply:
                return json.load(reply).get("health") == "true"
        except (OSError, ValueError):
            return False

    def _etcdctl(self) -> list[str]:
        tls = [] if self.tls is None else [
            "--cacert", self.tls.ca, "--cert", self.tls.client_cert, "--key",
            self.tls.client_key]
        user = [] if self.user is None else ["--user", self.user]
        return ["etcdctl", "--endpoints", self.url, *tls, *user]

    def ctl(self, *args: str) -> str:
        """etcdctl against this etcd: its output."""
        return subprocess.run([*self._etcdctl(), *args], check=True,
                              capture_output=True, text=True,
                              env={**os.environ, "ETCDCTL_API": "3"}).stdout

    def keys(self, prefix: str = PREFIX) -> dict[str, tuple[str, int]]:
        """Every key under ``prefix``: (value, mod_revision)."""
        reply = json.loads(self.ctl("get", "--prefix", prefix, "-w", "json"))
        return {base64.b64decode(kv["key"]).decode():
                (base64.b64decode(kv.get("value", "")).decode(errors="replace"),
                 int(kv["mod_revision"]))
                for kv in reply.get("kvs", [])}

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a test may leave it stopped
        terminate(self.proc)

"""Helpers for tests that run real mountd processes."""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from coordinator.embedded import EmbeddedCoordinator
from digest_tools.create import create_digest
from mountd.cluster.membership import Cluster
from mountd.fetch.services import ReadServices, read_services
from mountd.store.content_store import ContentStore
from quiverfs import control_client
from quiverfs.backends import StorageOptions
from quiverfs.bench.processes import MountdProcess, unmount
from quiverfs.chunk_cycle import FORCE_EVICT_AFTER
from quiverfs.errors import QuietError
from quiverfs.heartbeat import PROBE_BATCHES
from quiverfs.mount_point import is_mounted


MountdFactory = Callable[..., MountdProcess]


@pytest.fixture
def mountd_factory(tmp_path, shared_workdir) -> Iterator[MountdFactory]:
    """Start real mountd processes; each is stopped, checked for a clean exit and unmounted.
    It asks for ``shared_workdir`` so that a test's shared directory, where its mountds
    may mount, is removed after they are unmounted, whatever order the test names them
    in (before, its removal ran first, walked into the live mount, failed on the mount
    point, and left the directory behind)."""
    started: list[MountdProcess] = []

    def start(name: str = "node", cache_size: str = "1G", workdir: str | None = None,
              cache_dir: str | None = None, wrapper: tuple[str, ...] = (),
              extra_args: tuple[str, ...] = ()) -> MountdProcess:
        base = workdir or str(tmp_path)
        root = os.path.join(base, f"{name}-mnt")
        if not is_mounted(root):  # a killed mountd's stale mount answers stat with ENOTCONN
            os.makedirs(root, exist_ok=True)
        cache_dir = cache_dir or os.path.join(base, f"{name}-cache")
        os.makedirs(cache_dir, exist_ok=True)
        m = MountdProcess(root, cache_dir, cache_size, os.path.join(base, f"{name}.log"),
                          extra_args, wrapper=wrapper)
        m.start()
        started.append(m)
        return m

    yield start
    failures = []
    for m in reversed(started):  # a restarted mountd shares its root with the first one
        killed = m.proc is not None and m.proc.returncode == -9
        rc = m.stop()
        if not killed and rc != 0:
            failures.append(f"mountd exited {rc}: {m.log_tail()}")
        if "Traceback" in m.log_tail(1000):
            failures.append(f"traceback in mountd log: {m.log_tail(40)}")
        unmount(m.root)
        if is_mounted(m.root):
            failures.append(f"{m.root} still mounted")
    assert not failures, "\n".join(failures)


def make_digest(src: str, name: str, emulator_host: str | None = None) -> bytes:
    return create_digest(src, name, workers=2, options=StorageOptions(emulator_host=emulator_host))


def mount(m: MountdProcess, data: bytes, name: str, emulator_host: str | None = None,
          **extra: object) -> dict:
    return m.call({"op": "mount", "name": name, "digest": data,
                   "emulator_host": emulator_host, **extra})


def tree_hashes(root: str) -> dict[str, str]:
    """relative path -> sha256 hex of every file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def lone_services(store: ContentStore, state_dir: str) -> ReadServices:
    """The read path of a single node, with its coordinator embedded (for tests of what
    reads and jobs count, without a mount)."""
    limiter = trio.CapacityLimiter(1)
    link = EmbeddedCoordinator(state_dir, FORCE_EVICT_AFTER, PROBE_BATCHES, limiter)
    return read_services(store, limiter, Cluster("node", "local", store.size_limit, link, None))


def read_hashes(root: str, paths: list[str]) -> dict[str, str]:
    """relative path -> sha256 hex of each of ``paths`` under root (through a mount)."""
    out = {}
    for p in paths:
        with open(os.path.join(root, p), "rb") as f:
            out[p] = hashlib.sha256(f.read()).hexdigest()
    return out


def dataset_counters(m: MountdProcess, name: str) -> dict:
    for ds in m.status()["datasets"]:
        if ds["name"] == name:
            return ds["counters"]
    raise KeyError(name)


def run_as(uid: int, gid: int, work: Callable[[], Any]) -> Any:
    """``work()`` in a forked child running as ``uid``/``gid`` (no supplementary groups);
    its JSON-able result. An exception in the child is re-raised here as RuntimeError."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop privileges, work, report, exit without cleanup
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(gid)
            os.setuid(uid)
            try:
                out = {"ok": work()}
            except BaseException as exc:  # reported to the test, which fails with it
                out = {"error": repr(exc)}
            os.write(w, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(w)
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    os.waitpid(pid, 0)
    out = json.loads(b"".join(chunks) or b"{}")
    if "ok" not in out:
        raise RuntimeError(f"as uid {uid}: {out.get('error', 'the child died')}")
    return out["ok"]


def call_as(uid: int, gid: int, socket_path: str, request: dict) -> dict:
    """Send a control request from a forked child running as ``uid``/``gid``."""
    def call() -> dict:
        try:
            reply = control_client.call(socket_path, request)
            return {"ok": True, "reply": {k: v for k, v in reply.items()
                                          if isinstance(v, (str, int, float, bool))}}
        except QuietError as exc:
            return {"ok": False, "error": exc.message, "code": int(exc.exitcode)}
    return run_as(uid, gid, call)


def wait_for(condition: Callable[[], Any], what: str, within: float = 30.0) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)

"""The GCS endpoint is root's setting: a user may name only an endpoint root listed
(``--gcs-endpoint``, ``gcs-endpoint`` in the config file), and nobody an endpoint with a
path, query, fragment or user-info. Real mountd, real CLI, loopback listeners."""
from __future__ import annotations

import contextlib
import os
import shutil
import socketserver
import subprocess
import threading
from collections.abc import Iterator

import pytest

from quiverfs.bench.request_log import RequestLog
from quiverfs.bench.throttle_proxy import UNCAPPED, throttled
from quiverfs.errors import ExitCode, QuietError
from tests.mountd_helpers import (call_as, make_digest, mount, mountd_factory, read_hashes,
                                  run_as, tree_hashes)

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")

USER = 1000


class _Counting(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        with self.server.lock:
            self.server.connections += 1


@contextlib.contextmanager
def listener() -> Iterator[socketserver.ThreadingTCPServer]:
    """A loopback TCP listener that counts the connections it accepts (and says nothing)."""
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Counting)
    server.connections, server.lock = 0, threading.Lock()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def user_mountd(mountd_factory, workdir: str, extra_args: tuple[str, ...] = ()):
    """A mountd whose control socket other uids can reach."""
    m = mountd_factory(workdir=workdir, cache_dir=os.path.join(workdir, "cache"),
                       extra_args=extra_args)
    os.chmod(m.cache_dir, 0o755)
    return m


def test_a_users_mount_naming_an_unlisted_endpoint_is_refused_and_reaches_nothing(
        shared_workdir, mountd_factory, synthetic_tree, upload, gcs_emulator):
    data = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    with listener() as port:
        m = user_mountd(mountd_factory, shared_workdir,
                        ("--gcs-endpoint", gcs_emulator.host))
        host = f"http://127.0.0.1:{port.server_address[1]}"
        reply = call_as(USER, USER, m.socket, {"op": "mount", "name": "syn", "digest": data,
                                               "anonymous": True, "emulator_host": host})
        assert not reply["ok"] and reply["code"] == ExitCode.PERMISSION, reply
        assert "ask root to add it to gcs-endpoint" in reply["error"]
        assert m.status()["datasets"] == []
        assert port.connections == 0


@pytest.mark.parametrize("setting", ["option", "config"])
def test_an_endpoint_root_listed_serves_a_users_dataset(
        shared_workdir, mountd_factory, synthetic_tree, upload, gcs_emulator, monkeypatch,
        setting):
    src = os.path.join(shared_workdir, "src")  # the user's copy, to compare with
    shutil.copytree(synthetic_tree.root, src)
    subprocess.run(["chmod", "-R", "a+rX", src], check=True)
    data = make_digest(upload(src, "syn"), "syn", gcs_emulator.host)
    requests = RequestLog()
    with throttled(gcs_emulator.host, UNCAPPED, request_log=requests) as proxy:
        if setting == "config":
            config = os.path.join(shared_workdir, "quiver.toml")
            with open(config, "w", encoding="utf-8") as f:
                f.write(f'[mountd]\ngcs-endpoint = ["http://127.0.0.1:1", "{proxy.url}/"]\n')
            monkeypatch.setenv("QUIVER_CONFIG", config)
            m = user_mountd(mountd_factory, shared_workdir)
        else:
            m = user_mountd(mountd_factory, shared_workdir, ("--gcs-endpoint", proxy.url))
        reply = call_as(USER, USER, m.socket, {"op": "mount", "name": "syn", "digest": data,
                                               "anonymous": True,
                                               "emulator_host": proxy.url.upper() + "/"})
        assert reply["ok"], reply
        expected = tree_hashes(src)
        got = run_as(USER, USER, lambda: read_hashes(os.path.join(m.root, "syn"),
                                                     sorted(expected)))
        assert got == expected
        downloads = [q for q in requests.requests() if "alt=media" in q.target]
        assert len(downloads) == len(expected)


MALFORMED = ["{base}/prefix", "{base}/storage/v1/b/x/o/", "{base}?alt=json", "{base}/?x=1",
             "{base}?", "{base}#frag", "http://user:pass@127.0.0.1:{port}",
             "http://@127.0.0.1:{port}", "ftp://127.0.0.1:{port}", "127.0.0.1:{port}",
             "{base}/\n/x", "http://127.0.0.1:99999"]


def test_an_endpoint_with_more_than_an_origin_is_refused_even_for_root(
        mountd_factory, synthetic_tree, upload, gcs_emulator):
    data = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    with listener() as port:
        number = port.server_address[1]
        m = mountd_factory()
        for endpoint in MALFORMED:
            bad = endpoint.format(base=f"http://127.0.0.1:{number}", port=number)
            with pytest.raises(QuietError) as info:
                mount(m, data, "syn", bad)
            assert info.value.exitcode == ExitCode.USAGE, bad
            assert "is not a GCS endpoint" in info.value.message, bad
        assert m.status()["datasets"] == []
        # root may name any endpoint that is only an origin
        mount(m, data, "fine", f"http://127.0.0.1:{number}/")
        assert port.connections == 0


def test_the_cli_refuses_a_malformed_endpoint_before_asking_mountd(
        mountd_factory, quiver, synthetic_tree, upload, gcs_emulator, tmp_path, monkeypatch):
    digest_file = str(tmp_path / "syn.qd")
    with open(digest_file, "wb") as f:
        f.write(make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host))
    m = mountd_factory()
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"{gcs_emulator.host}/x?y=1")
    r = quiver("mount", digest_file, "--anonymous", "--root", m.root,
               "--control-socket", m.socket)
    assert r.returncode == ExitCode.USAGE
    assert r.stderr.splitlines() == [
        f"quiver: error: $STORAGE_EMULATOR_HOST '{gcs_emulator.host}/x?y=1' is not a GCS "
        "endpoint: it has a path (/x): give http://HOST:PORT or https://HOST[:PORT], "
        "nothing after the port"]
    assert m.status()["datasets"] == []


def test_mountd_refuses_a_malformed_gcs_endpoint_option(quiver, tmp_path):
    base = ("mountd", "--foreground", "--root", str(tmp_path / "mnt"),
            "--cache-dir", str(tmp_path / "cache"), "--cache-size", "1G")
    r = quiver(*base, "--gcs-endpoint", "http://127.0.0.1:9/x,http://127.0.0.1:8")
    assert r.returncode == ExitCode.USAGE
    assert r.stderr.splitlines() == [
        "quiver: error: --gcs-endpoint 'http://127.0.0.1:9/x' is not a GCS endpoint: it has "
        "a path (/x): give http://HOST:PORT or https://HOST[:PORT], nothing after the port"]
    config = tmp_path / "quiver.toml"
    config.write_text('[mountd]\ngcs-endpoint = ["http://u:p@127.0.0.1:9"]\n')
    r = quiver("--config", str(config), *base)
    assert r.returncode == ExitCode.CONFIG
    assert len(r.stderr.splitlines()) == 1 and "user-info" in r.stderr


def test_a_restart_drops_a_users_registration_whose_endpoint_root_no_longer_lists(
        shared_workdir, mountd_factory, synthetic_tree, upload, gcs_emulator):
    data = make_digest(upload(synthetic_tree.root, "syn"), "syn", gcs_emulator.host)
    m = user_mountd(mountd_factory, shared_workdir, ("--gcs-endpoint", gcs_emulator.host))
    reply = call_as(USER, USER, m.socket, {"op": "mount", "name": "syn", "digest": data,
                                           "anonymous": True,
                                           "emulator_host": gcs_emulator.host})
    assert reply["ok"], reply
    assert m.stop() == 0
    m2 = user_mountd(mountd_factory, shared_workdir)  # the same root and state, no list
    assert m2.status()["datasets"] == []
    assert (f"dropping dataset 'syn': GCS endpoint {gcs_emulator.host} is not one mountd "
            "lets users name") in m2.log_tail(50)

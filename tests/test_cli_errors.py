"""Bad command lines, state and credentials: one ``quiver: error:`` line and a documented
exit code, never a traceback."""
from __future__ import annotations

import contextlib
import copy
import json
import os
import socket
import socketserver
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio

from mountd import cli as mountd_cli
from mountd.control.replies import ClusterReply, MountReply, PrefetchReply, StatusReply
from quiverfs import cli, control_client, job_protocol, wire
from quiverfs import digest as fmt
from quiverfs.bench.processes import terminate, unmount
from quiverfs.dataset_name import check_name
from quiverfs.errors import ExitCode, QuietError
from quiverfs.mount_point import is_mounted
from tests.mountd_helpers import make_digest, mount, mountd_factory  # noqa: F401 (a fixture)
from tests.test_digest_errors import assert_error, unprivileged  # noqa: F401 (a fixture)

HUGE = "1" + "0" * 400
SECRET = "quiver-test-cluster-secret"


def assert_last_line_error(r: subprocess.CompletedProcess, code: ExitCode, *words: str) -> None:
    """Like assert_error, for daemons whose log lines come before the error line."""
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    errors = [line for line in r.stderr.splitlines() if line.startswith("quiver: error: ")]
    assert len(errors) == 1 and r.stderr.splitlines()[-1] == errors[0], r.stderr
    for word in words:
        assert word in errors[0], (word, errors[0])


@pytest.fixture
def secret(monkeypatch) -> str:
    """The cluster secret, in the environment the ``quiver`` subprocesses inherit."""
    monkeypatch.setenv("QUIVER_CLUSTER_SECRET", SECRET)
    return SECRET


@pytest.fixture
def busy_port() -> Iterator[int]:
    """A local TCP port that something is already listening on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


# --- sizes --------------------------------------------------------------------------

@pytest.mark.parametrize("option", ["--cache-size", "--chunk-size"])
def test_mountd_size_with_400_digits(quiver, tmp_path, option: str) -> None:
    r = quiver("mountd", "--root", str(tmp_path), "--cache-dir", str(tmp_path / "cache"),
               "--cache-size", "1G", option, HUGE)  # the last --cache-size is the bad one
    assert_error(r, ExitCode.USAGE, option, "is too large", "at most 1048576T")
    assert not is_mounted(str(tmp_path))


def test_coordinator_budget_with_400_digits(quiver, tmp_path, secret: str) -> None:
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path),
               "--cache-budget", HUGE + "T")
    assert_error(r, ExitCode.USAGE, "--cache-budget", "is too large")


# --- quiver coordinator -------------------------------------------------------------

@pytest.mark.parametrize("contents", [b"not json\n", b'{"nodes": 5}', b"[]", b"\xff\xfe"])
def test_coordinator_with_a_corrupt_state_file(quiver, tmp_path, secret: str,
                                               contents: bytes) -> None:
    (tmp_path / "coordinator.json").write_bytes(contents)
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(tmp_path))
    assert_error(r, ExitCode.DAEMON, str(tmp_path / "coordinator.json"), "is corrupted",
                 "move it aside")
    assert (tmp_path / "coordinator.json").read_bytes() == contents  # left for inspection


def test_coordinator_on_a_port_in_use(quiver, tmp_path, secret: str, busy_port: int) -> None:
    r = quiver("coordinator", "--listen", f"127.0.0.1:{busy_port}", "--state-dir",
               str(tmp_path))
    assert_error(r, ExitCode.USAGE, f"cannot listen on 127.0.0.1:{busy_port}",
                 "Address already in use", "--listen")


def test_coordinator_state_dir_under_a_file(quiver, tmp_path, secret: str) -> None:
    (tmp_path / "file").write_text("x")
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir",
               str(tmp_path / "file" / "state"))
    assert_error(r, ExitCode.PERMISSION, "cannot create state directory", "Not a directory")


@pytest.mark.parametrize("args, words", [
    ((), ("give --state-dir (one coordinator) or --etcd",)),
    (("--state-dir", "STATE", "--etcd", "http://127.0.0.1:2379"), ("not both or neither",)),
    (("--etcd", "ftp://127.0.0.1:2379"), ("invalid --etcd URL 'ftp://127.0.0.1:2379'",
                                          "https://10.0.0.1:2379")),
    (("--etcd", "http://127.0.0.1:2379,127.0.0.1:2380"), ("invalid --etcd URL",)),
    (("--etcd", "http://127.0.0.1"), ("invalid --etcd URL 'http://127.0.0.1'",)),
    (("--etcd", "http://127.0.0.1:2379", "--etcd-prefix", "a/b"),
     ("--etcd-prefix 'a/b' is not valid",)),
    (("--etcd", "http://127.0.0.1:2379", "--lease-ttl", "0"),
     ("--lease-ttl must be at least 1, not 0",)),
    (("--etcd", "http://127.0.0.1:2379", "--advertise", "127.0.0.1:0"),
     ("--advertise port must be at least 1",)),
    (("--state-dir", "STATE", "--etcd-user", "quiver"),
     ("--etcd-user is for --etcd", "leave it out with --state-dir")),
    (("--etcd", "https://127.0.0.1:2379", "--etcd-cert", "cert.pem"),
     ("give --etcd-cert and --etcd-key together",)),
    (("--etcd", "http://127.0.0.1:2379", "--etcd-password-file", "pw"),
     ("give --etcd-user and --etcd-password-file together",)),
    (("--etcd", "http://127.0.0.1:2379", "--etcd-ca", "/etc/ssl/certs/ca-certificates.crt"),
     ("--etcd-ca and --etcd-cert are for https --etcd URLs",)),
])
def test_coordinator_state_options(quiver, tmp_path, secret: str, args: tuple[str, ...],
                                   words: tuple[str, ...]) -> None:
    args = tuple(str(tmp_path / "state") if a == "STATE" else a for a in args)
    r = quiver("coordinator", "--listen", "127.0.0.1:0", *args)
    assert_error(r, ExitCode.USAGE, *words)


def test_coordinator_with_etcd_on_a_wildcard_address_needs_advertise(
        quiver, tmp_path, secret: str) -> None:
    r = quiver("coordinator", "--listen", "0.0.0.0:0", "--etcd", "http://127.0.0.1:2379")
    assert_error(r, ExitCode.USAGE, "is no address a node can reach",
                 "give --advertise HOST:PORT")


def test_coordinator_etcd_url_in_the_config_file(quiver, tmp_path, secret: str) -> None:
    cfg = tmp_path / "quiver.toml"
    cfg.write_text('[coordinator]\netcd = "https://10.0.0.1"\n')
    r = quiver("--config", str(cfg), "coordinator", "--listen", "127.0.0.1:0")
    assert_error(r, ExitCode.CONFIG, str(cfg), "etcd", "invalid --etcd URL")


@pytest.mark.parametrize("option, words", [
    ("--etcd-ca", ("cannot use --etcd-ca",)),
    ("--etcd-cert", ("cannot use --etcd-cert/--etcd-key",)),
    ("--etcd-password-file", ("cannot read --etcd-password-file", "No such file")),
])
def test_coordinator_etcd_files_it_cannot_use(quiver, tmp_path, secret: str, option: str,
                                              words: tuple[str, ...]) -> None:
    """A missing (or, for the certificate, not PEM) file: one line, exit 6, at start."""
    (tmp_path / "not.pem").write_text("not a certificate\n")
    files = {"--etcd-ca": str(tmp_path / "missing.pem"),
             "--etcd-cert": str(tmp_path / "not.pem"),
             "--etcd-password-file": str(tmp_path / "missing")}
    extra = {"--etcd-cert": ("--etcd-key", str(tmp_path / "not.pem")),
             "--etcd-password-file": ("--etcd-user", "quiver")}.get(option, ())
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--etcd", "https://127.0.0.1:2379",
               option, files[option], *extra)
    assert_error(r, ExitCode.PERMISSION, *words)


def test_coordinator_unwritable_state_dir(quiver, tmp_path, secret: str,
                                          unprivileged: tuple[str, ...]) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o555)
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(state),
               prefix=unprivileged)
    assert_error(r, ExitCode.PERMISSION, f"cannot write {state}/coordinator.json",
                 "permission denied")
    assert os.listdir(state) == []


def test_coordinator_state_file_that_cannot_be_read(quiver, tmp_path, secret: str) -> None:
    (tmp_path / "state" / "coordinator.json").mkdir(parents=True)  # a directory in its place
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir",
               str(tmp_path / "state"))
    assert_error(r, ExitCode.PERMISSION, "cannot read coordinator state", "Is a directory")


# --- quiver mountd --listen ---------------------------------------------------------

@pytest.fixture
def coordinator(tmp_path, secret: str) -> Iterator[str]:
    """A running ``quiver coordinator``; its HOST:PORT."""
    proc = subprocess.Popen([sys.executable, "-m", "quiverfs.cli", "coordinator", "--listen",
                             "127.0.0.1:0", "--state-dir", str(tmp_path / "coordinator")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    address = None
    for line in proc.stderr:  # its log; EOF if it dies
        if "coordinator listening on " in line:
            address = line.split("coordinator listening on ")[1].strip()
            break
    try:
        assert address, f"the coordinator did not start (exit {proc.poll()})"
        yield address
    finally:
        rc = terminate(proc)
        proc.stderr.close()
    assert rc == 0


@pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")
@pytest.mark.parametrize("mode", ["--foreground", "background"])
def test_mountd_listen_on_a_port_in_use(quiver, tmp_path, coordinator: str, busy_port: int,
                                        mode: str) -> None:
    root = tmp_path / "mnt"
    root.mkdir()
    try:
        r = quiver("mountd", "--root", str(root), "--cache-dir", str(tmp_path / "cache"),
                   "--cache-size", "1G", "--coordinator", coordinator,
                   "--listen", f"127.0.0.1:{busy_port}",
                   *([mode] if mode == "--foreground" else []))
        assert_last_line_error(r, ExitCode.USAGE, f"cannot listen on 127.0.0.1:{busy_port}",
                               "Address already in use", "--listen")
        assert not is_mounted(str(root))
    finally:
        unmount(str(root))


# --- credentials --------------------------------------------------------------------

@pytest.fixture
def digest_file(tmp_path) -> str:
    path = str(tmp_path / "d.qd")
    fmt.write_atomic(path, fmt.encode("d", "gs://bucket/train",
                                      [fmt.NewItem("a/1.jpg", bytes(32), 1)]))
    return path


@pytest.mark.parametrize("contents,words", [
    ({}, ("missing fields", "client_email", "token_uri")),
    ({"type": "service_account"}, ("missing fields", "client_email")),
    ({"type": "service_account", "client_email": "a@b.c", "token_uri": "https://x"},
     ("private_key",)),
    ([], ("not a JSON object",)),
])
def test_mount_with_incomplete_credentials(quiver, tmp_path, digest_file: str,
                                           contents: object, words: tuple[str, ...]) -> None:
    creds = tmp_path / "key.json"
    creds.write_text(json.dumps(contents))
    r = quiver("mount", digest_file, "--credentials", str(creds), "--root", str(tmp_path),
               "--control-socket", str(tmp_path / "no-mountd.sock"))
    assert_error(r, ExitCode.PERMISSION, f"credentials {creds}", *words)


def test_digest_create_with_incomplete_credentials(quiver, tmp_path) -> None:
    creds = tmp_path / "key.json"
    creds.write_text("{}")
    r = quiver("digest", "create", "gs://bucket/train", "-o", str(tmp_path / "d.qd"),
               "--credentials", str(creds))
    assert_error(r, ExitCode.PERMISSION, "missing fields")
    assert not (tmp_path / "d.qd").exists()


# --- names --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["evil\n", "ok\nevil", "a" * 129, ".hidden", "a/b", None, 5,
                                  b"bytes"])
def test_dataset_name_must_match_as_a_whole(name: object) -> None:
    with pytest.raises(QuietError) as err:
        check_name(name)
    assert err.value.exitcode == ExitCode.USAGE


def test_job_and_batch_names_must_match_as_a_whole() -> None:
    assert job_protocol.JOB_NAME.fullmatch("job-1")
    assert not job_protocol.JOB_NAME.fullmatch("job\n")
    assert job_protocol.BATCH_NAME.fullmatch(job_protocol.batch_name(1, 2))
    assert not job_protocol.BATCH_NAME.fullmatch("e1-b2\n")


@pytest.mark.parametrize("name", ["../x", "a\nb", ".hidden"])
def test_mount_with_an_invalid_name(quiver, tmp_path, digest_file: str, name: str) -> None:
    r = quiver("mount", digest_file, "--name", name, "--root", str(tmp_path),
               "--control-socket", str(tmp_path / "no-mountd.sock"))
    assert_error(r, ExitCode.USAGE, "invalid dataset name", repr(name))


def test_mount_of_a_digest_whose_name_is_invalid(quiver, tmp_path) -> None:
    """A digest made before digest create checked names may carry any name."""
    path = str(tmp_path / "d.qd")
    fmt.write_atomic(path, fmt.encode("../x", "gs://bucket/train",
                                      [fmt.NewItem("a/1.jpg", bytes(32), 1)]))
    r = quiver("mount", path, "--root", str(tmp_path),
               "--control-socket", str(tmp_path / "no-mountd.sock"))
    assert_error(r, ExitCode.USAGE, path, "invalid dataset name '../x'", "pass --name")


@pytest.mark.parametrize("command", ["umount", "prefetch"])
def test_umount_and_prefetch_with_an_invalid_name(quiver, tmp_path, command: str) -> None:
    r = quiver(command, "../x", "--root", str(tmp_path),
               "--control-socket", str(tmp_path / "no-mountd.sock"))
    assert_error(r, ExitCode.USAGE, "invalid dataset name '../x'")


needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


@needs_fuse
def test_control_requests_need_a_valid_name(mountd_factory, digits_tree) -> None:
    m = mountd_factory()
    data = make_digest(digits_tree.root, "digits")
    for name in [None, 5, "../x", "a\nb", ""]:
        with pytest.raises(QuietError) as refused:
            mount(m, data, name)
        assert refused.value.exitcode == ExitCode.USAGE, (name, refused.value.message)
    assert m.status()["datasets"] == []
    assert sorted(os.listdir(m.root)) == [".quiver"]
    mount(m, data, "digits")
    for op in ["umount", "prefetch"]:
        for name in [None, ["digits"], "../digits"]:
            with pytest.raises(QuietError) as refused:
                m.call({"op": op, "name": name})
            assert refused.value.exitcode == ExitCode.USAGE, (op, name)
    assert [ds["name"] for ds in m.status()["datasets"]] == ["digits"]


@needs_fuse
def test_mountd_replies_are_what_the_client_reads(mountd_factory, digits_tree) -> None:
    """The typed replies of the client (mountd.control.replies) match a real mountd's."""
    m = mountd_factory()
    mounted = mount(m, make_digest(digits_tree.root, "digits"), "digits")
    assert control_client.typed(mounted, MountReply, "mount").items == 1797
    prefetch = control_client.typed(m.call({"op": "prefetch", "name": "digits"}),
                                    PrefetchReply, "prefetch")
    assert prefetch.name == "digits"
    status = control_client.typed(m.status(), StatusReply, "status")
    assert [ds.name for ds in status.datasets] == ["digits"]
    assert status.cache.writable
    cluster = control_client.typed(m.call({"op": "cluster"}), ClusterReply, "cluster")
    assert [n.live for n in cluster.nodes] == [True]


# --- replies a client cannot use ----------------------------------------------------

STATUS: dict[str, Any] = {
    "ok": True, "root": "/mnt/quiver", "pid": 7, "data_path": "native",
    "cache": {"used_bytes": 5, "size_limit": 1 << 30, "items": 1, "writable": True,
              "write_error": None, "write_error_since": None, "write_failures": 0},
    "memory": {"uid": 0, "uid_in_use": 10, "per_uid_limit": None, "in_use": 10,
               "total_limit": 1 << 30},
    "counters": {"local_hits": 1, "chunk_wait_s": 0.5},
    "bucket_fetch_causes": {"demand": {"fetches": 1, "bytes": 5}},
    "datasets": [{"name": "d", "items": 1, "bytes": 5, "source": "gs://bucket/train",
                  "counters": {"local_hits": 1},
                  "prefetch": {"finished": True, "done_items": 1, "total_items": 1,
                               "failed": 0}}]}
CLUSTER: dict[str, Any] = {
    "ok": True, "node": "n1", "coordinator_ok": True, "version": 3,
    "nodes": [{"id": "n1", "peer": "127.0.0.1:7001", "live": True, "share": 1.0}],
    "cycles": {"ab" * 32: {"states": ["active", "evicted"], "capacity": 2,
                           "max_resident": 1}},
    "jobs": [{"job": "j1", "epoch": 0, "batches_planned": 1, "batches_per_epoch": 4,
              "counters": {"hits": 1, "chunk_wait_s": 0.25}}]}


REMOVE = object()


def changed(reply: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """A copy of ``reply`` with the field at ``path`` (dotted; a number indexes a list)
    set to ``value``, or removed when ``value`` is REMOVE."""
    out = copy.deepcopy(reply)
    *parents, last = path.split(".")
    node: Any = out
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if value is REMOVE:
        del node[last]
    else:
        node[last] = value
    return out


@contextlib.contextmanager
def fake_mountd(path: str, reply: Any) -> Iterator[list[Any]]:
    """A control socket at ``path`` that answers every request with ``reply``, in the real
    framing (quiverfs.wire): the hostile peer of the client under test. Yields the
    requests it got."""
    requests: list[Any] = []

    class Answer(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            requests.append(wire.sock_recv_msg(self.request))
            self.request.sendall(wire.pack(reply))

    with socketserver.ThreadingUnixStreamServer(path, Answer) as server:
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        try:
            yield requests
        finally:
            server.shutdown()
            thread.join()


@pytest.fixture
def ask_fake(quiver, shared_workdir: str, digest_file: str
             ) -> Callable[..., tuple[subprocess.CompletedProcess, list[Any]]]:
    """``ask_fake(reply, command, *args)``: run ``quiver command`` against a fake mountd
    answering ``reply``; its result and the requests the fake got."""
    path = os.path.join(shared_workdir, "control.sock")  # short: sun_path holds 108 bytes

    def ask(reply: Any, command: str, *args: str
            ) -> tuple[subprocess.CompletedProcess, list[Any]]:
        argv = {"mount": ("mount", digest_file), "umount": ("umount", "d"),
                "prefetch": ("prefetch", "d")}.get(command, (command,))
        with fake_mountd(path, reply) as requests:
            r = quiver(*argv, *args, "--root", shared_workdir, "--control-socket", path)
        return r, requests

    return ask


MALFORMED = [  # (command and options, reply, what the error says)
    (("status",), 5, "not a map"),
    (("status",), [], "not a map"),
    (("status",), "ok", "not a map"),
    (("status",), {"ok": "yes"}, "true or false 'ok'"),
    (("status",), {"ok": False, "code": 99}, "a refusal needs"),
    (("status",), {"ok": False, "code": 99, "error": "e"}, "a refusal needs"),
    (("status",), {"ok": False, "code": "x", "error": "e"}, "a refusal needs"),
    (("status",), {"ok": False, "code": 0, "error": "e"}, "a refusal needs"),
    (("status",), {"ok": False, "code": True, "error": "e"}, "a refusal needs"),
    (("status",), {"ok": False, "code": 8, "error": b"e"}, "a refusal needs"),
    (("status",), {"ok": True}, "missing required field"),
    (("status",), changed(STATUS, "root", REMOVE), "missing required field `root`"),
    (("status",), changed(STATUS, "pid", "7"), "$.pid"),
    (("status",), changed(STATUS, "cache", []), "$.cache"),
    (("status",), changed(STATUS, "cache.items", "x"), "$.cache.items"),
    (("status",), changed(STATUS, "cache.used_bytes", True), "$.cache.used_bytes"),
    (("status",), changed(changed(STATUS, "cache.writable", False),
                          "cache.write_error_since", "yesterday"), "$.cache.write_error_since"),
    (("status",), changed(STATUS, "memory.in_use", "x"), "$.memory.in_use"),
    (("status",), changed(STATUS, "counters", {"local_hits": "many"}), "$.counters"),
    (("status",), changed(STATUS, "counters", {1: 2}), "$.counters"),
    (("status",), changed(STATUS, "bucket_fetch_causes.demand", 1), "bucket_fetch_causes"),
    (("status",), changed(STATUS, "datasets", {}), "$.datasets"),
    (("status",), changed(STATUS, "datasets.0.source", REMOVE), "`source`"),
    (("status",), changed(STATUS, "datasets.0.items", 1.5), "$.datasets[0].items"),
    (("status",), changed(STATUS, "datasets.0.prefetch", []), "$.datasets[0].prefetch"),
    (("status", "--json"), {"ok": True}, "missing required field"),
    (("status", "--json"), STATUS | {"extra": b"\x00"}, "not JSON serializable"),
    (("status", "--cluster"), {"ok": True}, "missing required field"),
    (("status", "--cluster"), changed(CLUSTER, "cycles." + "ab" * 32 + ".states", ["x"]),
     "Invalid enum value 'x'"),
    (("status", "--cluster"), changed(CLUSTER, "cycles." + "ab" * 32 + ".states", [""]),
     "Invalid enum value ''"),
    (("status", "--cluster"), changed(CLUSTER, "nodes.0.id", 1), "$.nodes[0].id"),
    (("status", "--cluster"), changed(CLUSTER, "jobs", None), "$.jobs"),
    (("status", "--cluster", "--json"), changed(CLUSTER, "version", REMOVE), "`version`"),
    (("mount",), {"ok": True}, "missing required field"),
    (("mount",), {"ok": True, "path": 5, "items": 1, "bytes": 1}, "$.path"),
    (("mount",), {"ok": False}, "a refusal needs"),
    (("umount",), 5, "not a map"),
    (("umount",), {"ok": False, "code": 3}, "a refusal needs"),
    (("prefetch",), {"ok": True, "name": "d", "items": "3"}, "$.items"),
    (("prefetch",), {"ok": True, "name": None, "items": 3}, "$.name"),
]


@pytest.mark.parametrize("args,reply,words", MALFORMED)
def test_a_malformed_reply_is_one_line(ask_fake, args: tuple[str, ...], reply: Any,
                                       words: str) -> None:
    r, requests = ask_fake(reply, *args)
    op = {"status": "cluster" if "--cluster" in args else "status"}.get(args[0], args[0])
    assert_error(r, ExitCode.DAEMON, f"mountd sent a malformed reply to {op!r}", words)
    assert [req["op"] for req in requests] == [op]
    assert r.stdout == ""


@pytest.mark.parametrize("args,reply,out", [
    (("status",), STATUS, "root /mnt/quiver (mountd pid 7), cached files served by native "
     "code (data path native)"),
    (("status", "--json"), STATUS, '"root": "/mnt/quiver"'),
    (("status", "--cluster"), CLUSTER, "chunks [A .]"),
    (("mount",), {"ok": True, "path": "/mnt/quiver/d", "items": 1, "bytes": 1},
     "/mnt/quiver/d: 1 items"),
    (("umount",), {"ok": True}, ""),
    (("prefetch",), {"ok": True, "name": "d", "items": 1}, "prefetching 1 items of d"),
])
def test_a_well_formed_reply_is_printed(ask_fake, args: tuple[str, ...], reply: Any,
                                        out: str) -> None:
    """The fake's well-formed replies pass: the failures above are the malformations."""
    r, _ = ask_fake(reply, *args)
    assert r.returncode == 0 and r.stderr == "", r.stderr
    assert out in r.stdout


def test_a_refusal_keeps_its_code_on_one_line(ask_fake) -> None:
    r, _ = ask_fake({"ok": False, "error": "no dataset\nnamed 'd'\r\n", "code": 3}, "umount")
    assert_error(r, ExitCode.NOT_FOUND, "no dataset named 'd'")


# --- numbers and addresses ----------------------------------------------------------

@pytest.mark.parametrize("option,value,words", [
    ("--force-evict-after", "-1", "must be at least 0, not -1"),
    ("--force-evict-after", "nan", "must be a finite number"),
    ("--force-evict-after", "inf", "must be a finite number"),
    ("--force-evict-after", "1e400", "must be a finite number"),
    ("--force-evict-after", "soon", "must be a number"),
    ("--fetch-deadline", "0", "must be more than 0, not 0"),
    ("--fetch-deadline", "inf", "must be a finite number"),
    ("--scrub-mb-s", "-1", "must be at least 0, not -1"),
    ("--scrub-mb-s", "fast", "must be a number, not 'fast'"),
    ("--scrub-mb-s", "nan", "must be a finite number"),
    ("--probe-batches", "-1", "must be at least 0, not -1"),
    ("--probe-batches", "1.5", "must be an integer"),
    ("--listen", "127.0.0.1:99999", "port must be at most 65535, not 99999"),
    ("--listen", "127.0.0.1", "use HOST:PORT"),
    ("--coordinator", "127.0.0.1:99999", "port must be at most 65535"),
    ("--coordinator", "127.0.0.1:0", "port must be at least 1, not 0"),
])
def test_mountd_refuses_a_bad_number_or_address(quiver, tmp_path, secret: str, option: str,
                                                value: str, words: str) -> None:
    cluster = ("--coordinator", "127.0.0.1:7000") if option == "--listen" else ()
    r = quiver("mountd", "--root", str(tmp_path / "missing"), "--cache-dir",
               str(tmp_path / "cache"), "--cache-size", "1G", "--foreground", *cluster,
               option, value)
    assert_error(r, ExitCode.USAGE, option, words)
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize("option,value,words", [
    ("--heartbeat-timeout", "-1", "must be more than 0, not -1"),
    ("--heartbeat-timeout", "0", "must be more than 0, not 0"),
    ("--heartbeat-timeout", "nan", "must be a finite number"),
    ("--reprobe-after", "inf", "must be a finite number"),
    ("--reprobe-after", "-5", "must be more than 0"),
    ("--forget-datasets-after", "0", "must be more than 0, not 0"),
    ("--forget-datasets-after", "inf", "must be a finite number"),
    ("--force-evict-after", "nan", "must be a finite number"),
    ("--probe-batches", "0", "must be at least 1, not 0"),
    ("--cache-budget", "-1", "invalid --cache-budget"),
    ("--listen", "127.0.0.1:70000", "port must be at most 65535"),
])
def test_coordinator_refuses_a_bad_number(quiver, tmp_path, option: str, value: str,
                                          words: str) -> None:
    # No cluster secret: a value wrongly accepted fails at once on the missing secret,
    # whose message does not name the option.
    listen = () if option == "--listen" else ("--listen", "127.0.0.1:0")
    r = quiver("coordinator", *listen, "--state-dir", str(tmp_path / "state"),
               option, value)
    assert_error(r, ExitCode.USAGE, option, words)
    assert not (tmp_path / "state").exists()


@pytest.mark.parametrize("table,setting,words", [
    ("mountd", "force-evict-after = nan", "must be a finite number"),
    ("mountd", "force-evict-after = -1.0", "must be at least 0"),
    ("mountd", "probe-batches = -1", "must be at least 0"),
    ("mountd", "fetch-deadline = -1.0", "must be more than 0"),
    ("mountd", "scrub-mb-s = -8", "must be at least 0, not -8"),
    ("mountd", 'scrub-mb-s = "fast"', "must be an integer or a number, not a string"),
    ("mountd", 'listen = "127.0.0.1:99999"', "port must be at most 65535"),
    ("mountd", 'coordinator = "127.0.0.1:0"', "port must be at least 1"),
    ("coordinator", "heartbeat-timeout = -1", "must be more than 0"),
    ("coordinator", "heartbeat-timeout = nan", "must be a finite number"),
    ("coordinator", "reprobe-after = inf", "must be a finite number"),
    ("coordinator", "forget-datasets-after = -1", "must be more than 0"),
    ("coordinator", "cache-budget = -5", "invalid --cache-budget"),
    ("digest.create", 'name = "../x"', "invalid dataset name"),
])
def test_the_config_file_refuses_the_same_values(quiver, tmp_path, table: str, setting: str,
                                                 words: str) -> None:
    config = tmp_path / "quiver.toml"
    config.write_text(f"[{table}]\n{setting}\n")
    key = setting.split(" = ")[0]
    r = quiver("--config", str(config), "digest", "show", str(tmp_path / "none.qd"))
    assert_error(r, ExitCode.CONFIG, str(config), f"[{table}] {key}", words)


# --- a cache or state directory that takes no writes --------------------------------

@pytest.fixture
def as_root() -> Iterator[Callable[..., None]]:
    """``as_root((do, undo), ...)`` runs each ``do`` command, and its ``undo`` (if any)
    after the test; where root cannot run ``do``, the test is skipped."""
    if os.geteuid() != 0:
        pytest.skip("needs root (mounts, file attributes)")
    undos: list[list[str]] = []

    def run(*steps: tuple[list[str], list[str] | None]) -> None:
        for do, undo in steps:
            r = subprocess.run(do, capture_output=True, text=True, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot run {' '.join(do)}: {r.stderr.strip()}")
            if undo is not None:
                undos.append(undo)

    yield run
    for undo in reversed(undos):
        subprocess.run(undo, check=True)


def read_only(as_root: Callable[..., None], path: str) -> None:
    """Bind-mount ``path`` read-only over itself: root ignores mode bits, not this."""
    as_root((["mount", "--bind", path, path], ["umount", path]),
            (["mount", "-o", "remount,bind,ro", path], None))


def immutable(as_root: Callable[..., None], path: str) -> None:
    """Set the immutable attribute on directory ``path``: no new file, even for root."""
    as_root((["chattr", "+i", path], ["chattr", "-i", path]))


def start_mountd(quiver, tmp_path, *args: str) -> subprocess.CompletedProcess:
    """``quiver mountd`` on tmp_path/mnt with cache tmp_path/cache, expected to fail."""
    root = tmp_path / "mnt"
    root.mkdir(exist_ok=True)
    try:
        r = quiver("mountd", "--root", str(root), "--cache-dir", str(tmp_path / "cache"),
                   "--cache-size", "1G", *args)
        assert not is_mounted(str(root))
    finally:
        unmount(str(root))
    return r


@pytest.mark.parametrize("mode,words", [
    ("--foreground", "cannot write state directory"),
    ("background", "cannot write the log file"),  # CACHE_DIR/mountd.log, before the daemon
])
def test_mountd_with_a_read_only_cache_dir(quiver, tmp_path, as_root, mode: str,
                                           words: str) -> None:
    (tmp_path / "cache").mkdir()
    read_only(as_root, str(tmp_path / "cache"))
    r = start_mountd(quiver, tmp_path, *([mode] if mode == "--foreground" else []))
    assert_last_line_error(r, ExitCode.PERMISSION, words, str(tmp_path / "cache"),
                           "Read-only file system")


def test_mountd_with_a_read_only_state_dir(quiver, tmp_path, as_root) -> None:
    state = tmp_path / "cache" / "state"
    state.mkdir(parents=True)
    read_only(as_root, str(state))
    r = start_mountd(quiver, tmp_path, "--foreground")
    assert_last_line_error(r, ExitCode.PERMISSION, f"cannot write state directory {state}",
                           "Read-only file system")


@pytest.mark.parametrize("sub", ["", "digests", "credentials"])
def test_mountd_with_an_immutable_state_dir(quiver, tmp_path, as_root, sub: str) -> None:
    state = tmp_path / "cache" / "state"
    for d in ("digests", "credentials"):
        (state / d).mkdir(parents=True)
    immutable(as_root, str(state / sub))
    r = start_mountd(quiver, tmp_path, "--foreground")
    assert_last_line_error(r, ExitCode.PERMISSION,
                           f"cannot write state directory {state / sub}:",
                           "Operation not permitted")


def test_mountd_whose_registrations_cannot_be_read(quiver, tmp_path) -> None:
    records = tmp_path / "cache" / "state" / "registrations.json"
    records.mkdir(parents=True)  # a directory where the file should be
    r = start_mountd(quiver, tmp_path, "--foreground")
    assert_last_line_error(r, ExitCode.PERMISSION, f"cannot read {records}",
                           "Is a directory")


def test_mountd_with_a_corrupt_cycle_state_it_cannot_move(quiver, tmp_path, as_root) -> None:
    """The embedded coordinator moves a corrupted state aside; where it cannot, the
    start stops with one line."""
    cycles = tmp_path / "cache" / "state" / "coordinator"
    cycles.mkdir(parents=True)
    (cycles / "coordinator.json").write_text("not json")
    immutable(as_root, str(cycles))
    r = start_mountd(quiver, tmp_path, "--foreground")
    assert_last_line_error(r, ExitCode.PERMISSION, "is corrupted", "mountd cannot do it",
                           "Operation not permitted")


@pytest.mark.parametrize("mode", ["--foreground", "background"])
def test_mountd_control_socket_where_none_can_be_made(quiver, tmp_path, as_root,
                                                      mode: str) -> None:
    (tmp_path / "run").mkdir()
    read_only(as_root, str(tmp_path / "run"))
    sock = tmp_path / "run" / "sub" / "control.sock"
    r = start_mountd(quiver, tmp_path, "--control-socket", str(sock),
                     *([mode] if mode == "--foreground" else []))
    assert_last_line_error(r, ExitCode.PERMISSION, f"cannot create the control socket {sock}",
                           "Read-only file system", "--control-socket")


@pytest.mark.parametrize("also", [None, RuntimeError("a bug")])
def test_a_user_error_raised_in_a_daemons_task_is_one_line(monkeypatch, capsys, also):
    """trio wraps what a task raises in an ExceptionGroup at each nursery it leaves (a
    control mount that cannot be mounted at start, say): the user error is still one
    line and its code; with a bug beside it, the whole group is shown."""
    async def serve() -> None:
        async def cannot_mount() -> None:
            raise QuietError("cannot mount /x/.quiver: see the log", ExitCode.MOUNT)

        async def buggy() -> None:
            raise also

        async with trio.open_nursery() as outer:
            async with trio.open_nursery() as inner:
                inner.start_soon(cannot_mount)
                if also is not None:
                    outer.start_soon(buggy)

    monkeypatch.setattr(mountd_cli, "cmd_status", lambda args: trio.run(serve))
    if also is None:
        assert cli.main(["status"]) == ExitCode.MOUNT
        assert capsys.readouterr().err == "quiver: error: cannot mount /x/.quiver: see the log\n"
    else:
        with pytest.raises(BaseExceptionGroup):
            cli.main(["status"])

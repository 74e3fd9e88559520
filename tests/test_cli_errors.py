"""Bad command lines, state and credentials: one ``quiver: error:`` line and a documented
exit code, never a traceback."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from mountd import job_files
from mountd.registry import check_name
from quiverfs import digest as fmt
from quiverfs.errors import ExitCode, QuietError
from quiverfs.bench.processes import terminate, unmount
from quiverfs.mount_point import is_mounted
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


def test_coordinator_unwritable_state_dir(quiver, tmp_path, secret: str,
                                          unprivileged: tuple[str, ...]) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o555)
    r = quiver("coordinator", "--listen", "127.0.0.1:0", "--state-dir", str(state),
               prefix=unprivileged)
    assert_error(r, ExitCode.PERMISSION, f"cannot write {state}/coordinator.json",
                 "permission denied")
    assert os.listdir(state) == []


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

@pytest.mark.parametrize("name", ["evil\n", "ok\nevil", "a" * 129, ".hidden", "a/b"])
def test_dataset_name_must_match_as_a_whole(name: str) -> None:
    with pytest.raises(QuietError) as err:
        check_name(name)
    assert err.value.exitcode == ExitCode.USAGE


def test_job_and_batch_names_must_match_as_a_whole() -> None:
    assert job_files.JOB_NAME.fullmatch("job-1") and not job_files.JOB_NAME.fullmatch("job\n")
    assert job_files._BATCH_NAME.fullmatch("e1-b2")
    assert not job_files._BATCH_NAME.fullmatch("e1-b2\n")

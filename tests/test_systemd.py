"""The systemd units: they verify, and their Exec lines work when run as written."""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quiverfs.mount_point import is_mounted
from tests.notify_daemon import notify_daemon  # noqa: F401

UNITS = Path(__file__).resolve().parent.parent / "systemd"
MOUNTD_UNIT = UNITS / "quiver-mountd.service"
DATASET_UNIT = UNITS / "quiver-dataset@.service"
COORDINATOR_UNIT = UNITS / "quiver-coordinator.service"
INSTALLED_QUIVER = "/opt/quiver/.venv/bin/quiver"  # where the units expect the venv
QUIVER = os.path.join(os.path.dirname(sys.executable), "quiver")  # this venv's
ETC = "/etc/quiver"
# Each of these gives the service a mount namespace of its own (the FUSE mount would
# be invisible outside it) or closes /dev/fuse.
NAMESPACE_OPTIONS = {
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateMounts",
    "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs",
    "ProtectControlGroups", "ProtectProc", "ProcSubset", "ProtectHostname", "ProtectClock",
    "ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "TemporaryFileSystem",
    "BindPaths", "BindReadOnlyPaths", "MountFlags", "RootDirectory", "RootImage",
    "PrivateUsers", "DeviceAllow", "DevicePolicy", "PrivateNetwork"}


def unit_settings(path: Path) -> list[tuple[str, str, str]]:
    """(section, key, value) of every setting of a unit file, in order."""
    out, section, pending = [], "", ""
    for raw in path.read_text(encoding="utf-8").splitlines():
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, _, value = line.partition("=")
        out.append((section, key.strip(), value.strip()))
    return out


def render(unit: Path, dest: Path, etc: Path) -> Path:
    """A copy of ``unit`` using this venv's quiver and ``etc`` for /etc/quiver."""
    text = unit.read_text(encoding="utf-8")
    assert INSTALLED_QUIVER in text and ETC in text
    dest.mkdir(exist_ok=True)
    out = dest / unit.name
    out.write_text(text.replace(INSTALLED_QUIVER, QUIVER).replace(ETC, str(etc)),
                   encoding="utf-8")
    return out


def exec_lines(unit: Path, key: str, instance: str = "") -> list[tuple[list[str], bool]]:
    """The ``key`` command lines of [Service] as argv, %i expanded; and whether a
    failure is ignored (the ``-`` prefix)."""
    lines = []
    for section, k, value in unit_settings(unit):
        if section == "Service" and k == key:
            ignore = value.startswith("-")
            value = value.lstrip("-")
            assert "%" not in value.replace("%i", "").replace("%%", ""), value
            lines.append((shlex.split(value.replace("%i", instance).replace("%%", "%")),
                          ignore))
    return lines


def run_exec(unit: Path, key: str, instance: str = "") -> None:
    for argv, ignore in exec_lines(unit, key, instance):
        r = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                           stdin=subprocess.DEVNULL)
        assert ignore or r.returncode == 0, (argv, r.stderr)
        assert "Traceback" not in r.stderr


@pytest.fixture
def etc(tmp_path) -> Path:
    """An /etc/quiver whose config points mountd at temporary directories."""
    etc = tmp_path / "etc"
    (etc / "datasets").mkdir(parents=True)
    (tmp_path / "mnt").mkdir()
    (etc / "quiver.toml").write_text(
        f'root = "{tmp_path}/mnt"\n'
        f'control-socket = "{tmp_path}/ctl.sock"\n'
        f'[mountd]\ncache-dir = "{tmp_path}/cache"\ncache-size = "64M"\n', encoding="utf-8")
    return etc


def test_units_verify(tmp_path, etc):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (apt-get install systemd)")
    units = [render(u, tmp_path / "units", etc)
             for u in (MOUNTD_UNIT, DATASET_UNIT, COORDINATOR_UNIT)]
    r = subprocess.run([analyze, "verify", *map(str, units)], capture_output=True, text=True,
                       timeout=60)
    # verify only warns about unknown keys or bad values: any output is a failure.
    assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr


@pytest.mark.parametrize("unit", [MOUNTD_UNIT, DATASET_UNIT], ids=lambda u: u.name)
def test_hardening_keeps_the_host_mount_namespace(unit):
    keys = {key for section, key, _ in unit_settings(unit) if section == "Service"}
    assert not keys & NAMESPACE_OPTIONS


def test_mountd_unit_is_notify_with_restart_and_config():
    settings = {(s, k): v for s, k, v in unit_settings(MOUNTD_UNIT)}
    assert settings[("Service", "Type")] == "notify"
    assert settings[("Service", "Restart")] == "on-failure"
    argv, ignore = exec_lines(MOUNTD_UNIT, "ExecStart")[0]
    assert argv == [INSTALLED_QUIVER, "--config", f"{ETC}/quiver.toml", "mountd",
                    "--foreground"] and not ignore


needs_fuse = pytest.mark.skipif(not os.path.exists("/dev/fuse"), reason="no /dev/fuse")


def start_mountd_unit(notify_daemon, tmp_path: Path, etc: Path):
    unit = render(MOUNTD_UNIT, tmp_path / "units", etc)
    ((argv, _),) = exec_lines(unit, "ExecStart")
    return notify_daemon(argv, str(tmp_path), str(tmp_path / "mnt"))


@needs_fuse
def test_mountd_execstart_mounts_notifies_and_unmounts_on_sigterm(notify_daemon, tmp_path,
                                                                   etc):
    daemon = start_mountd_unit(notify_daemon, tmp_path, etc)
    assert "READY=1" in daemon.messages
    with open("/proc/self/mounts", encoding="utf-8") as f:
        mounts = {line.split()[1]: line.split()[2] for line in f}
    assert mounts[str(tmp_path / "mnt")] == "fuse.quiver"
    assert (tmp_path / "cache" / "store").is_dir()  # the cache dir came from the config
    assert daemon.stop() == 0
    assert not is_mounted(str(tmp_path / "mnt"))


@needs_fuse
def test_dataset_unit_registers_replaces_and_removes(notify_daemon, quiver, tmp_path, etc):
    src = tmp_path / "src" / "cls"
    src.mkdir(parents=True)
    (src / "a.jpg").write_bytes(b"alpha")
    (src / "b.jpg").write_bytes(b"beta")
    r = quiver("digest", "create", str(src.parent), "-o", str(etc / "datasets" / "syn.qd"))
    assert r.returncode == 0, r.stderr
    start_mountd_unit(notify_daemon, tmp_path, etc)
    unit = render(DATASET_UNIT, tmp_path / "units", etc)
    mounted = tmp_path / "mnt" / "syn" / "cls"

    for _ in range(2):  # the second start replaces what the first registered
        run_exec(unit, "ExecStartPre", "syn")
        run_exec(unit, "ExecStart", "syn")
        assert (mounted / "a.jpg").read_bytes() == b"alpha"
        assert (mounted / "b.jpg").read_bytes() == b"beta"
    run_exec(unit, "ExecStop", "syn")
    assert not (tmp_path / "mnt" / "syn").exists()

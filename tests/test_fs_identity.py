"""Opening a user's paths from a root daemon: what ``open_regular`` follows and refuses,
with openat2 and with the walk by hand that stands in for it on older kernels."""
from __future__ import annotations

import errno
import os

import pytest

from quiverfs import fs_identity
from quiverfs.fs_identity import NOBODY, UserIdentity, acting_as, open_regular


@pytest.fixture(params=["openat2", "walk"])
def resolver(request, monkeypatch) -> str:
    """Each test runs once with openat2 and once with the walk by hand."""
    if request.param == "openat2":
        fd = open_regular(__file__)  # first use: finds out whether the kernel has it
        os.close(fd)
        if not fs_identity._have_openat2:
            pytest.skip("this kernel has no openat2")
    monkeypatch.setattr(fs_identity, "_have_openat2", request.param == "openat2")
    return request.param


@pytest.fixture
def tree(tmp_path) -> str:
    """data/f.bin, and links to it of every ordinary kind."""
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "f.bin").write_bytes(b"content")
    os.symlink(str(data / "f.bin"), data / "absolute")
    os.symlink("f.bin", data / "relative")
    os.symlink("../relative", data / "sub" / "up")
    os.symlink("sub", data / "dirlink")
    os.symlink("loop", data / "loop")
    return str(data)


def read(path: str) -> bytes:
    fd = open_regular(path)
    try:
        return os.read(fd, 100)
    finally:
        os.close(fd)


@pytest.mark.parametrize("rel", ["f.bin", "absolute", "relative", "sub/up", "dirlink/up",
                                 "sub/../f.bin", "./sub/./up"])
def test_ordinary_paths_and_links_open(resolver, tree, rel):
    assert read(os.path.join(tree, rel)) == b"content"


def test_a_relative_path_opens_from_the_working_directory(resolver, tree, monkeypatch):
    monkeypatch.chdir(tree)
    assert read("sub/up") == b"content"


def test_a_symlink_loop_is_eloop(resolver, tree):
    with pytest.raises(OSError) as info:
        read(os.path.join(tree, "loop"))
    assert info.value.errno == errno.ELOOP


def test_a_directory_is_not_a_regular_file(resolver, tree):
    with pytest.raises(OSError) as info:
        read(os.path.join(tree, "sub"))
    assert info.value.errno == errno.EINVAL


@pytest.mark.parametrize("kind", ["fd", "devfd", "root", "cwd", "mem", "environ",
                                  "link-to-fd", "link-to-proc"])
def test_proc_and_its_magic_links_are_refused(resolver, tree, kind, tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"mountd's own")
    fd = os.open(secret, os.O_RDONLY)
    try:
        path = {"fd": f"/proc/self/fd/{fd}", "devfd": f"/dev/fd/{fd}",
                "root": f"/proc/self/root{secret}", "cwd": "/proc/self/cwd",
                "mem": "/proc/self/mem", "environ": "/proc/self/environ",
                "link-to-fd": os.path.join(tree, "to-fd"),
                "link-to-proc": os.path.join(tree, "to-proc")}[kind]
        os.symlink(f"/proc/self/fd/{fd}", os.path.join(tree, "to-fd"))
        os.symlink("/proc/self/environ", os.path.join(tree, "to-proc"))
        with pytest.raises(OSError) as info:
            read(path)
        assert info.value.errno in (errno.ELOOP, errno.EACCES, errno.EINVAL)
    finally:
        os.close(fd)


def test_each_step_is_checked_as_the_user(resolver, shared_workdir):
    data = os.path.join(shared_workdir, "data")
    os.makedirs(os.path.join(data, "sub"))
    with open(os.path.join(data, "f.bin"), "wb") as f:
        f.write(b"content")
    os.symlink("../f.bin", os.path.join(data, "sub", "up"))
    path = os.path.join(data, "sub", "up")
    nobody = UserIdentity(NOBODY, NOBODY)

    def read_as_nobody() -> bytes:
        with acting_as(nobody):
            return read(path)

    assert read_as_nobody() == b"content"
    for denied, mode in ((data, 0o700), (os.path.join(data, "f.bin"), 0o600)):
        os.chmod(denied, mode)  # root's alone: nobody may not pass, but root may
        with pytest.raises(PermissionError):
            read_as_nobody()
        assert read(path) == b"content"
        os.chmod(denied, 0o755)
    assert read_as_nobody() == b"content"


def test_a_fifo_is_refused_without_blocking(resolver, tree):
    os.mkfifo(os.path.join(tree, "fifo"))
    with pytest.raises(OSError) as info:
        read(os.path.join(tree, "fifo"))
    assert info.value.errno == errno.EINVAL


def test_a_file_of_a_served_device_is_refused_unopened(resolver, tree, monkeypatch):
    served = os.stat(tree).st_dev
    monkeypatch.setattr(fs_identity, "_served_devices", {served})
    for rel in ("f.bin", "sub/up"):
        with pytest.raises(fs_identity.PathRefused) as info:
            read(os.path.join(tree, rel))
        assert "in mountd's own mount" in info.value.strerror
    monkeypatch.setattr(fs_identity, "_served_devices", {served + 1})
    assert read(os.path.join(tree, "f.bin")) == b"content"

"""Every bad input to ``quiver digest``: one line on stderr, its exit code, no leftovers."""
from __future__ import annotations

import os
import random
import shutil
import struct
import subprocess

import pytest

from quiverfs import digest as fmt
from quiverfs.errors import ExitCode, QuietError

# Running as root bypasses file permissions; dropping these capabilities from the
# bounding set makes the command obey them while still reaching the root-owned venv.
NO_DAC = ("setpriv", "--bounding-set=-dac_override,-dac_read_search",
          "--inh-caps=-dac_override,-dac_read_search", "--")


def assert_error(r: subprocess.CompletedProcess, code: ExitCode, *words: str) -> None:
    """One ``quiver: error:`` line naming the problem, the exit code, and no traceback."""
    assert r.returncode == code, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr + r.stdout
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("quiver: error: "), r.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


@pytest.fixture
def out_dir(tmp_path) -> str:
    """An empty directory for the digest a failing create must not leave behind."""
    path = tmp_path / "out"
    path.mkdir()
    return str(path)


def create_fails(quiver, src: str, out_dir: str, code: ExitCode, *words: str,
                 prefix: tuple[str, ...] = ()) -> None:
    r = quiver("digest", "create", src, "-o", os.path.join(out_dir, "d.qd"), prefix=prefix)
    assert_error(r, code, *words)
    assert os.listdir(out_dir) == []  # neither the digest nor a temp file


def tree(root, files: dict[str, bytes]) -> str:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return str(root)


# --- bad sources --------------------------------------------------------------------

def test_nonexistent_source(quiver, tmp_path, out_dir: str) -> None:
    create_fails(quiver, str(tmp_path / "nope"), out_dir, ExitCode.NOT_FOUND, "nope",
                 "does not exist")


def test_source_is_a_file(quiver, tmp_path, out_dir: str) -> None:
    (tmp_path / "f.jpg").write_bytes(b"x")
    create_fails(quiver, str(tmp_path / "f.jpg"), out_dir, ExitCode.BAD_INPUT,
                 "not a directory")


def test_empty_tree(quiver, tmp_path, out_dir: str) -> None:
    (tmp_path / "empty" / "cat").mkdir(parents=True)
    create_fails(quiver, str(tmp_path / "empty"), out_dir, ExitCode.BAD_INPUT, "no files")


@pytest.fixture
def unprivileged() -> tuple[str, ...]:
    """A command prefix under which file permissions apply, also when tests run as root."""
    if os.geteuid() != 0:
        return ()
    if shutil.which("setpriv") is None:
        pytest.skip("running as root and setpriv (util-linux) is missing: cannot make a "
                    "file unreadable")
    return NO_DAC


def test_unreadable_file(quiver, tmp_path, out_dir: str, unprivileged) -> None:
    src = tree(tmp_path / "src", {"cat/1.jpg": b"a", "cat/2.jpg": b"b"})
    os.chmod(os.path.join(src, "cat/2.jpg"), 0)
    create_fails(quiver, src, out_dir, ExitCode.PERMISSION, "cat/2.jpg", "permission denied",
                 prefix=unprivileged)


def test_unreadable_directory(quiver, tmp_path, out_dir: str, unprivileged) -> None:
    src = tree(tmp_path / "src", {"cat/1.jpg": b"a", "dog/2.jpg": b"b"})
    os.chmod(os.path.join(src, "dog"), 0)
    try:
        create_fails(quiver, src, out_dir, ExitCode.PERMISSION, "dog", "permission denied",
                     prefix=unprivileged)
    finally:
        os.chmod(os.path.join(src, "dog"), 0o755)  # so pytest can clean it up


def test_symlink_loop_to_a_parent(quiver, tmp_path, out_dir: str) -> None:
    src = tree(tmp_path / "src", {"cat/1.jpg": b"a"})
    os.symlink("..", os.path.join(src, "cat", "up"))
    create_fails(quiver, src, out_dir, ExitCode.BAD_INPUT, "cat/up", "symlink loop")


def test_symlink_to_itself(quiver, tmp_path, out_dir: str) -> None:
    src = tree(tmp_path / "src", {"cat/1.jpg": b"a"})
    os.symlink("self", os.path.join(src, "cat", "self"))
    create_fails(quiver, src, out_dir, ExitCode.BAD_INPUT, "cat/self", "symlink loop")


def test_dangling_symlink(quiver, tmp_path, out_dir: str) -> None:
    src = tree(tmp_path / "src", {"cat/1.jpg": b"a"})
    os.symlink("gone.jpg", os.path.join(src, "cat", "2.jpg"))
    create_fails(quiver, src, out_dir, ExitCode.NOT_FOUND, "cat/2.jpg", "does not exist")


def test_non_utf8_file_name(quiver, tmp_path, out_dir: str) -> None:
    src = tree(tmp_path / "src", {"cat/1.jpg": b"a"})
    with open(os.path.join(os.fsencode(src), b"cat", b"caf\xe9.jpg"), "wb") as f:
        f.write(b"latin-1 name")
    create_fails(quiver, src, out_dir, ExitCode.BAD_INPUT, "caf\\xe9.jpg", "not a UTF-8 name")


def test_missing_bucket(quiver, gcs_emulator, out_dir: str) -> None:
    create_fails(quiver, "gs://no-such-bucket-q/train", out_dir, ExitCode.NOT_FOUND,
                 "bucket gs://no-such-bucket-q does not exist")


def test_unsupported_uri(quiver, out_dir: str) -> None:
    create_fails(quiver, "s3://bucket/train", out_dir, ExitCode.USAGE, "unsupported")


# --- bad options and outputs --------------------------------------------------------

@pytest.fixture
def src(tmp_path) -> str:
    return tree(tmp_path / "src", {"cat/1.jpg": b"a", "dog/2.jpg": b"b"})


@pytest.mark.parametrize("workers", ["0", "-3"])
def test_create_workers_below_one(quiver, src: str, out_dir: str, workers: str) -> None:
    r = quiver("digest", "create", src, "-o", os.path.join(out_dir, "d.qd"),
               "--workers", workers)
    assert_error(r, ExitCode.USAGE, "--workers must be at least 1")
    assert os.listdir(out_dir) == []


def test_verify_workers_zero(quiver, src: str, out_dir: str) -> None:
    out = os.path.join(out_dir, "d.qd")
    assert quiver("digest", "create", src, "-o", out).returncode == 0
    assert_error(quiver("digest", "verify", out, "--workers", "0"), ExitCode.USAGE,
                 "--workers must be at least 1")


def test_negative_label_level(quiver, src: str, out_dir: str) -> None:
    r = quiver("digest", "create", src, "-o", os.path.join(out_dir, "d.qd"),
               "--label-level", "-1")
    assert_error(r, ExitCode.USAGE, "--label-level")
    assert os.listdir(out_dir) == []


def test_output_directory_missing(quiver, src: str, tmp_path) -> None:
    r = quiver("digest", "create", src, "-o", str(tmp_path / "nodir" / "d.qd"))
    assert_error(r, ExitCode.NOT_FOUND, "does not exist")
    assert not (tmp_path / "nodir").exists()


def test_output_is_a_directory(quiver, src: str, out_dir: str) -> None:
    r = quiver("digest", "create", src, "-o", out_dir)
    assert_error(r, ExitCode.USAGE, "is a directory")
    assert os.listdir(out_dir) == []


# --- bad digests --------------------------------------------------------------------

@pytest.fixture
def good_digest(quiver, src: str, tmp_path) -> bytes:
    out = str(tmp_path / "good.qd")
    assert quiver("digest", "create", src, "-o", out).returncode == 0
    with open(out, "rb") as f:
        return f.read()


def bad_digest_everywhere(quiver, path: str, code: ExitCode, *words: str) -> None:
    """show, verify and diff (either side) all refuse ``path`` the same way."""
    for args in (["show", path], ["show", path, "--json", "--entries"], ["verify", path],
                 ["diff", path, path]):
        assert_error(quiver("digest", *args), code, path, *words)


def write(path, data: bytes) -> str:
    path.write_bytes(data)
    return str(path)


def test_truncated_digest(quiver, good_digest: bytes, tmp_path) -> None:
    path = write(tmp_path / "t.qd", good_digest[:len(good_digest) // 2])
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST, "truncated")


def test_digest_truncated_inside_the_preamble(quiver, good_digest: bytes, tmp_path) -> None:
    path = write(tmp_path / "t.qd", good_digest[:20])
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST, "truncated")


def test_corrupted_digest(quiver, good_digest: bytes, tmp_path) -> None:
    data = bytearray(good_digest)
    data[-5] ^= 0x01
    path = write(tmp_path / "c.qd", bytes(data))
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST, "corrupted")


def test_any_flipped_byte_is_detected(good_digest: bytes) -> None:
    positions = list(range(fmt._PREAMBLE.size)) + random.Random(5).sample(
        range(fmt._PREAMBLE.size, len(good_digest)), 40)
    for pos in positions:
        data = bytearray(good_digest)
        data[pos] ^= 0xFF
        with pytest.raises(QuietError) as err:
            fmt.decode(bytes(data))
        assert err.value.exitcode == ExitCode.BAD_DIGEST, pos


@pytest.mark.parametrize("name,data", [
    ("image.png", b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR" + bytes(100)),
    ("meta.json", b'{"name": "imagenet", "items": 3}\n'),
    ("empty.qd", b""),
])
def test_foreign_file(quiver, tmp_path, name: str, data: bytes) -> None:
    path = write(tmp_path / name, data)
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST, "not a Quiver digest")


def test_future_format_version(quiver, good_digest: bytes, tmp_path) -> None:
    # The checksum covers the header and columns, not the preamble, so after rewriting
    # the version the checksum still holds and the version is the only thing wrong.
    data = bytearray(good_digest)
    struct.pack_into("<H", data, len(fmt.MAGIC), fmt.FORMAT_VERSION + 1)
    fmt.decode(good_digest)  # the original is valid
    path = write(tmp_path / "future.qd", bytes(data))
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST,
                          f"version {fmt.FORMAT_VERSION + 1} is newer", "upgrade Quiver")


def test_nonexistent_digest(quiver, tmp_path) -> None:
    bad_digest_everywhere(quiver, str(tmp_path / "missing.qd"), ExitCode.NOT_FOUND,
                          "does not exist")


def test_digest_path_is_a_directory(quiver, tmp_path) -> None:
    bad_digest_everywhere(quiver, str(tmp_path), ExitCode.BAD_DIGEST, "is a directory")


def test_diff_with_one_bad_side(quiver, good_digest: bytes, tmp_path) -> None:
    good = write(tmp_path / "good2.qd", good_digest)
    missing = str(tmp_path / "missing.qd")
    assert_error(quiver("digest", "diff", good, missing), ExitCode.NOT_FOUND, missing)
    assert_error(quiver("digest", "diff", missing, good), ExitCode.NOT_FOUND, missing)

"""Every bad input to ``quiver digest``: one line on stderr, its exit code, no leftovers."""
from __future__ import annotations

import hashlib
import os
import random
import shutil
import struct
import subprocess

import msgpack
import pytest

from quiverfs import digest as fmt
from quiverfs.digest_checks import (FORMAT_VERSION, HASH_LEN, MAGIC, MAX_ITEM_BYTES,
                                    MAX_LABEL_LEVEL, MAX_TOTAL_BYTES, PREAMBLE)
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


@pytest.mark.parametrize("name", ["../x", "a\nb", "ok\n", ".hidden", "a/b", "", "x" * 129])
def test_create_with_an_invalid_name(quiver, src: str, out_dir: str, name: str) -> None:
    r = quiver("digest", "create", src, "-o", os.path.join(out_dir, "d.qd"), "--name", name)
    assert_error(r, ExitCode.USAGE, "invalid dataset name", repr(name))
    assert os.listdir(out_dir) == []


@pytest.mark.parametrize("dirname", [".hidden", "my data", "caf\u00e9"])
def test_create_whose_default_name_is_invalid(quiver, tmp_path, out_dir: str,
                                              dirname: str) -> None:
    src = tree(tmp_path / dirname, {"cat/1.jpg": b"a"})
    create_fails(quiver, src, out_dir, ExitCode.USAGE, f"invalid dataset name {dirname!r}",
                 "last component", "pass --name")
    out = os.path.join(out_dir, "d.qd")
    assert quiver("digest", "create", src, "-o", out, "--name", "named").returncode == 0
    assert fmt.load(out).name == "named"


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
    positions = list(range(PREAMBLE.size)) + random.Random(5).sample(
        range(PREAMBLE.size, len(good_digest)), 40)
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
    struct.pack_into("<H", data, len(MAGIC), FORMAT_VERSION + 1)
    fmt.decode(good_digest)  # the original is valid
    path = write(tmp_path / "future.qd", bytes(data))
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST,
                          f"version {FORMAT_VERSION + 1} is newer", "upgrade Quiver")


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


# --- crafted digests: well checksummed, hostile contents -----------------------------

def craft(paths: list[bytes], sizes: list[int] | None = None, keys: list[bytes] | None = None,
          offsets: list[int] | None = None, source: str = "file:///data",
          header: dict | None = None, columns: dict[str, bytes] | None = None) -> bytes:
    """A digest file with the given contents, packed by hand so that encode's checks do
    not stop it; ``header`` and ``columns`` replace fields of the ones built."""
    def u64(values: list[int]) -> bytes:
        return struct.pack(f"<{len(values)}Q", *values)

    def strings(blobs: list[bytes]) -> tuple[bytes, bytes]:
        ends = [0]
        for b in blobs:
            ends.append(ends[-1] + len(b))
        return u64(ends), b"".join(blobs)

    n = len(paths)
    cols = {"hashes": bytes(HASH_LEN * n), "sizes": u64(sizes or [1] * n)}
    cols["path_offsets"], cols["paths"] = strings(paths)
    cols["label_index"] = struct.pack(f"<{n}I", *[0] * n)
    if keys is not None:
        cols["loc_key_offsets"], cols["loc_keys"] = strings(keys)
    if offsets is not None:
        cols["loc_offsets"] = u64(offsets)
    cols.update(columns or {})
    table, pos = {}, 0
    for name, data in cols.items():
        table[name] = [pos, len(data)]
        pos += len(data)
    head = {"name": "hostile", "source": source, "count": n, "label_level": 1,
            "labels": [""], "columns": table, **(header or {})}
    packed = msgpack.packb(head, use_bin_type=True)
    body = packed + b"".join(cols.values())
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(packed),
                         hashlib.sha256(body).digest()) + body


GOOD_PATHS = [b"a/1.jpg", b"a/2.jpg", b"b/3.jpg"]

# case: (craft's keyword arguments, words the one-line error must contain)
HOSTILE: dict[str, tuple[dict, tuple[str, ...]]] = {
    "size 2**63": (dict(paths=GOOD_PATHS, sizes=[1, 1 << 63, 1]),
                   ("'a/2.jpg' has size 9223372036854775808", "bound")),
    "size 2**64-1": (dict(paths=GOOD_PATHS, sizes=[1, 1, 2**64 - 1]),
                     ("'b/3.jpg' has size 18446744073709551615", "bound")),
    "key with ..": (dict(paths=GOOD_PATHS, keys=[b"a/1.jpg", b"../../etc/shadow", b"x"]),
                    ("object key '../../etc/shadow' of 'a/2.jpg'", "relative")),
    "absolute key": (dict(paths=GOOD_PATHS, keys=[b"/etc/shadow"] * 3),
                     ("object key '/etc/shadow'", "absolute")),
    "short loc_key_offsets": (
        dict(paths=GOOD_PATHS, keys=GOOD_PATHS, columns={"loc_key_offsets": bytes(16)}),
        ("column 'loc_key_offsets' holds 16 bytes", "3 entries need 32")),
    "loc_keys shorter than its offsets": (
        dict(paths=GOOD_PATHS, keys=GOOD_PATHS, columns={"loc_keys": b"a/1.jpg"}),
        ("object key offsets",)),
    "short loc_offsets": (dict(paths=GOOD_PATHS, offsets=[0, 0, 0],
                               columns={"loc_offsets": bytes(8)}),
                          ("column 'loc_offsets' holds 8 bytes", "3 entries need 24")),
    "loc_offsets past the bound": (dict(paths=GOOD_PATHS, offsets=[0, 2**64 - 1, 0]),
                                   ("'a/2.jpg' starts at byte 18446744073709551615",)),
    "duplicate paths": (dict(paths=[b"a/1.jpg", b"a/1.jpg"]), ("duplicate path 'a/1.jpg'",)),
    "file and directory": (dict(paths=[b"a", b"a-b", b"a/b"]),
                           ("path 'a' is both a file and a directory",)),
    "dot component": (dict(paths=[b"a/./b"]), ("path 'a/./b' has a '.' component",)),
    "dotdot component": (dict(paths=[b"a/../../x"]), ("path 'a/../../x'", "'..' component")),
    "dotdot path": (dict(paths=[b".."]), ("path '..'", "'..' component")),
    "empty path": (dict(paths=[b"", b"a"]), ("path 0 is empty",)),
    "a//b": (dict(paths=[b"a//b"]), ("path 'a//b' has an empty component",)),
    "absolute path": (dict(paths=[b"/etc/passwd"]), ("path '/etc/passwd' is absolute",)),
    "trailing slash": (dict(paths=[b"a/"]), ("path 'a/' ends with '/'",)),
    "non-UTF-8 path": (dict(paths=[b"a/caf\xe9.jpg"]), ("'a/caf\\\\xe9.jpg' is not valid UTF-8",)),
    "unsorted paths": (dict(paths=[b"b/1", b"a/1"]),
                       ("not sorted: 'b/1' comes before 'a/1'",)),
    "NUL in a path": (dict(paths=[b"a\0b"]), ("path 'a\\x00b' contains a NUL byte",)),
    "long component": (dict(paths=[b"a/" + b"x" * 256]), ("longer than 255 bytes",)),
    "path offsets outside the blob": (
        dict(paths=GOOD_PATHS, columns={"path_offsets": struct.pack("<4Q", 0, 7, 14, 99)}),
        ("path offsets do not run upwards",)),
    "decreasing path offsets": (
        dict(paths=GOOD_PATHS, columns={"path_offsets": struct.pack("<4Q", 0, 14, 7, 21)}),
        ("path offsets do not run upwards",)),
    "label index out of range": (
        dict(paths=GOOD_PATHS, columns={"label_index": struct.pack("<3I", 0, 5, 0)}),
        ("label of 'a/2.jpg' is number 5, but the header lists 1",)),
    "count not an integer": (dict(paths=GOOD_PATHS, header={"count": "3"}), ("'count'",)),
    "negative count": (dict(paths=GOOD_PATHS, header={"count": -1}), ("'count'",)),
    "count as a bool": (dict(paths=GOOD_PATHS[:1], header={"count": True}), ("'count'",)),
    "name not a string": (dict(paths=GOOD_PATHS, header={"name": 7}), ("'name'",)),
    "source not a string": (dict(paths=GOOD_PATHS, header={"source": ["x"]}), ("'source'",)),
    "label_level not an integer": (dict(paths=GOOD_PATHS, header={"label_level": "1"}),
                                   ("'label_level'",)),
    "label_level out of range": (dict(paths=GOOD_PATHS, header={"label_level": 10**9}),
                                 ("'label_level'", "from 0 to 2048")),
    "labels not strings": (dict(paths=GOOD_PATHS, header={"labels": [1]}), ("'labels'",)),
    "columns not a map": (dict(paths=GOOD_PATHS, header={"columns": [1, 2]}), ("'columns'",)),
    "column entry not a pair": (
        dict(paths=GOOD_PATHS, header={"columns": {"hashes": "x"}}),
        ("column table entry of 'hashes' is not [offset, length]",)),
    "unknown column": (dict(paths=GOOD_PATHS, columns={"extra": b"x"}),
                       ("unknown column 'extra'",)),
    "unsupported source": (dict(paths=GOOD_PATHS, source="s3://bucket/train"),
                           ("source 's3://bucket/train'",)),
    "relative source": (dict(paths=GOOD_PATHS, source="data/train"), ("source 'data/train'",)),
    "source climbing out": (dict(paths=GOOD_PATHS, source="gs://bucket/../other"),
                            ("source 'gs://bucket/../other'",)),
    "source without a bucket": (dict(paths=GOOD_PATHS, source="gs:///train"),
                                ("source 'gs:///train'",)),
    "source with a newline": (dict(paths=GOOD_PATHS, source="file:///data\nx"),
                              ("source 'file:///data\\nx'",)),
}


def test_crafted_digest_of_good_contents_decodes() -> None:
    d = fmt.decode(craft(GOOD_PATHS, sizes=[1, 2, 3], keys=[b"p/0", b"p/0", b"p/1"],
                         offsets=[0, 1, 0]))
    assert [(e.path, e.size, e.location.uri, e.location.offset) for e in d.entries()] == [
        ("a/1.jpg", 1, "file:///data/p/0", 0), ("a/2.jpg", 2, "file:///data/p/0", 1),
        ("b/3.jpg", 3, "file:///data/p/1", 0)]


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_digest_is_refused(case: str) -> None:
    kwargs, words = HOSTILE[case]
    with pytest.raises(QuietError) as err:
        fmt.decode(craft(**kwargs), where="d.qd")
    message = err.value.message
    assert err.value.exitcode == ExitCode.BAD_DIGEST, message
    assert "\n" not in message and message.startswith("d.qd: ")
    assert message.endswith(": recreate it with 'quiver digest create'"), message
    for word in words:
        assert word in message, (word, message)


def test_header_that_is_not_a_map() -> None:
    packed = msgpack.packb(["hostile"])
    data = PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(packed),
                         hashlib.sha256(packed).digest()) + packed
    with pytest.raises(QuietError) as err:
        fmt.decode(data)
    assert err.value.exitcode == ExitCode.BAD_DIGEST and "header is not a map" in str(err.value)


def test_total_size_over_the_bound() -> None:
    n = MAX_TOTAL_BYTES // MAX_ITEM_BYTES + 1  # each item within its own bound
    data = craft([b"%06d" % i for i in range(n)], sizes=[MAX_ITEM_BYTES] * n)
    with pytest.raises(QuietError) as err:
        fmt.decode(data)
    assert err.value.exitcode == ExitCode.BAD_DIGEST
    assert f"add up to {n * MAX_ITEM_BYTES} bytes" in str(err.value)


@pytest.mark.parametrize("paths,words", [
    (["a//b"], "'a//b' has an empty component"),
    (["/etc/passwd"], "'/etc/passwd' is absolute"),
    (["x/"], "'x/' ends with '/'"),
    (["a/./b"], "'.' component"),
    (["../x"], "'..' component"),
    ([""], "path 0 is empty"),
    (["a", "a/b"], "'a' is both a file and a directory"),
    (["a/1", "a/1"], "duplicate path 'a/1'"),
    (["caf\udce9.jpg"], "is not a UTF-8 name"),
    (["a/" + "x" * 256], "longer than 255 bytes"),
])
def test_encode_refuses_what_decode_refuses(paths: list[str], words: str) -> None:
    items = [fmt.NewItem(p, bytes(32), 1) for p in paths]
    with pytest.raises(QuietError) as err:
        fmt.encode("n", "file:///data", items)
    assert err.value.exitcode == ExitCode.BAD_INPUT
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("source,key,size,label_level,words", [
    ("data", None, 1, 1, "source 'data'"),
    ("file:///data", "../x", 1, 1, "object key '../x'"),
    ("file:///data", None, MAX_ITEM_BYTES + 1, 1, "bound on an item"),
    ("file:///data", None, -1, 1, "negative"),
    ("file:///data", None, 1, MAX_LABEL_LEVEL + 1, "'label_level'"),
])
def test_encode_refuses_bad_items(source: str, key: str | None, size: int, label_level: int,
                                  words: str) -> None:
    with pytest.raises(QuietError) as err:
        fmt.encode("n", source, [fmt.NewItem("a/1", bytes(32), size, key=key)], label_level)
    assert err.value.exitcode == ExitCode.BAD_INPUT
    assert words in str(err.value), str(err.value)


@pytest.mark.parametrize("case", ["non-UTF-8 path", "size 2**64-1", "key with .."])
def test_cli_refuses_hostile_digests(quiver, tmp_path, case: str) -> None:
    kwargs, words = HOSTILE[case]
    path = write(tmp_path / "hostile.qd", craft(**kwargs))
    bad_digest_everywhere(quiver, path, ExitCode.BAD_DIGEST, *words)

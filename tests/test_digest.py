"""Digest files: format, determinism, labels, and the ``quiver digest`` commands."""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest

from digest_tools.create import create_digest
from quiverfs import digest as fmt
from quiverfs.backends import StorageOptions
from quiverfs.bench.data import Tree
from quiverfs.bench.emulator import Emulator
from quiverfs.errors import ExitCode, QuietError


def tree_files(root: str) -> dict[str, bytes]:
    """Every file under ``root`` by '/'-separated relative path."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            path = os.path.join(d, n)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root).replace(os.sep, "/")] = f.read()
    return out


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture
def small_tree(tmp_path) -> str:
    """A tree with classes, a nested file and a file at the root (no label)."""
    root = tmp_path / "small"
    for rel, data in {"cat/1.jpg": b"meow", "cat/2.jpg": b"purr", "dog/1.jpg": b"woof",
                      "dog/sub/3.jpg": b"wag", "README": b"top-level file"}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return str(root)


# --- format -------------------------------------------------------------------------

def test_encode_decode_round_trip() -> None:
    items = [fmt.NewItem("b/x.jpg", hashlib.sha256(b"x").digest(), 1, key="packs/p0", offset=0),
             fmt.NewItem("a/y.jpg", hashlib.sha256(b"yy").digest(), 2, key="packs/p0",
                         offset=1),
             fmt.NewItem("ünï/cödé.png", hashlib.sha256(b"zzz").digest(), 3, key="packs/p1",
                         offset=4096)]
    d = fmt.decode(fmt.encode("ds", "gs://bucket/pre", items))
    assert (d.name, d.source, len(d), d.total_bytes) == ("ds", "gs://bucket/pre", 3, 6)
    assert [e.as_dict() for e in d.entries()] == [
        {"path": "a/y.jpg", "label": "a", "hash": sha(b"yy"), "size": 2,
         "location": {"uri": "gs://bucket/pre/packs/p0", "offset": 1, "length": 2}},
        {"path": "b/x.jpg", "label": "b", "hash": sha(b"x"), "size": 1,
         "location": {"uri": "gs://bucket/pre/packs/p0", "offset": 0, "length": 1}},
        {"path": "ünï/cödé.png", "label": "ünï", "hash": sha(b"zzz"), "size": 3,
         "location": {"uri": "gs://bucket/pre/packs/p1", "offset": 4096, "length": 3}},
    ]
    some = [2, 0, 2]  # many at once, as one at a time (a non-ASCII path among them)
    assert d.paths_of(some) == ["ünï/cödé.png", "a/y.jpg", "ünï/cödé.png"]
    assert d.hashes_of(some) == [d.hash(i) for i in some] == [
        hashlib.sha256(b).digest() for b in (b"zzz", b"yy", b"zzz")]


def test_plain_items_store_no_location_columns() -> None:
    data = fmt.encode("ds", "file:///d", [fmt.NewItem("c/1", b"\0" * 32, 5)])
    d = fmt.decode(data)
    assert d.loc_keys is None and d.loc_offsets is None
    assert d.location(0) == fmt.Location("file:///d/c/1", 0, 5)


def test_encode_is_independent_of_item_order() -> None:
    items = [fmt.NewItem(f"c{i % 3}/{i}.jpg", hashlib.sha256(bytes([i])).digest(), i)
             for i in range(50)]
    assert fmt.encode("n", "file:///s", items) == fmt.encode("n", "file:///s", items[::-1])


def test_duplicate_paths_are_refused() -> None:
    item = fmt.NewItem("a/1", b"\0" * 32, 1)
    with pytest.raises(QuietError) as err:
        fmt.encode("n", "file:///s", [item, item])
    assert err.value.exitcode == ExitCode.BAD_INPUT


def test_empty_digest_round_trips() -> None:
    d = fmt.decode(fmt.encode("n", "file:///s", []))
    assert (len(d), d.total_bytes, list(d.entries())) == (0, 0, [])


def test_identity_is_the_content_checksum() -> None:
    a = fmt.decode(fmt.encode("n", "file:///s", [fmt.NewItem("a/1", b"\1" * 32, 1)]))
    b = fmt.decode(fmt.encode("n", "file:///s", [fmt.NewItem("a/1", b"\2" * 32, 1)]))
    assert len(a.identity) == 64 and a.identity != b.identity


# --- labels -------------------------------------------------------------------------

@pytest.mark.parametrize("path,level,label", [
    ("cat/1.jpg", 1, "cat"), ("cat/sub/1.jpg", 1, "cat"), ("1.jpg", 1, ""),
    ("train/cat/1.jpg", 2, "cat"), ("train/1.jpg", 2, ""), ("cat/1.jpg", 0, ""),
])
def test_label_rule(path: str, level: int, label: str) -> None:
    assert fmt.label_for(path, level) == label


def test_digits_labels_are_the_class_directories(digits_tree: Tree) -> None:
    d = fmt.decode(create_digest(digits_tree.root, "digits", workers=4))
    assert d.labels == [str(i) for i in range(10)]
    assert all(e.label == e.path.split("/")[0] for e in d.entries())
    assert len(d) == digits_tree.files == 1797


def test_label_level_two(small_tree: str, tmp_path) -> None:
    nested = tmp_path / "nested"
    shutil.copytree(small_tree, nested / "train")
    d = fmt.decode(create_digest(str(nested), None, workers=2, label_level=2))
    assert {e.path: e.label for e in d.entries()} == {
        "train/cat/1.jpg": "cat", "train/cat/2.jpg": "cat", "train/dog/1.jpg": "dog",
        "train/dog/sub/3.jpg": "dog", "train/README": ""}


# --- create -------------------------------------------------------------------------

def test_create_records_every_file(synthetic_tree: Tree) -> None:
    files = tree_files(synthetic_tree.root)
    d = fmt.decode(create_digest(synthetic_tree.root, "syn", workers=3))
    assert len(d) == synthetic_tree.files == len(files)
    assert d.total_bytes == synthetic_tree.bytes
    assert len([x for x in d.labels if x]) == synthetic_tree.classes
    for e in d.entries():
        assert e.hash == sha(files[e.path]), e.path
        assert e.size == len(files[e.path])
        assert e.location == fmt.Location(f"file://{synthetic_tree.root}/{e.path}", 0, e.size)


@pytest.mark.parametrize("workers", [1, 2, 7])
def test_create_is_deterministic_across_worker_counts(synthetic_tree: Tree,
                                                       workers: int) -> None:
    reference = create_digest(synthetic_tree.root, "syn", workers=4)
    assert create_digest(synthetic_tree.root, "syn", workers=workers) == reference


def test_cli_create_twice_gives_byte_identical_files(quiver, digits_tree: Tree,
                                                     tmp_path) -> None:
    outs = [str(tmp_path / "a.qd"), str(tmp_path / "b.qd")]
    for out, workers in zip(outs, ["1", "5"]):
        r = quiver("digest", "create", digits_tree.root, "-o", out, "--workers", workers)
        assert r.returncode == 0, r.stderr
        assert "1797 items" in r.stdout
    with open(outs[0], "rb") as a, open(outs[1], "rb") as b:
        assert a.read() == b.read()
    assert sorted(os.listdir(tmp_path)) == ["a.qd", "b.qd"]  # no temp files left


def test_default_name_is_the_last_source_component(quiver, small_tree: str, tmp_path) -> None:
    out = str(tmp_path / "d.qd")
    assert quiver("digest", "create", small_tree + "/", "-o", out).returncode == 0
    assert fmt.load(out).name == "small"
    assert quiver("digest", "create", small_tree, "-o", out, "--name", "mine").returncode == 0
    assert fmt.load(out).name == "mine"


# --- show ---------------------------------------------------------------------------

@pytest.fixture
def small_digest(quiver, small_tree: str, tmp_path) -> str:
    out = str(tmp_path / "small.qd")
    r = quiver("digest", "create", small_tree, "-o", out, "--name", "small")
    assert r.returncode == 0, r.stderr
    return out


def test_show_json(quiver, small_digest: str, small_tree: str) -> None:
    r = quiver("digest", "show", small_digest, "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    files = tree_files(small_tree)
    assert info["name"] == "small"
    assert info["source"] == f"file://{small_tree}"
    assert info["items"] == len(files) == 5
    assert info["bytes"] == sum(len(v) for v in files.values())
    assert info["labels"] == 2
    assert "entries" not in info


def test_show_json_entries(quiver, small_digest: str, small_tree: str) -> None:
    r = quiver("digest", "show", small_digest, "--json", "--entries")
    assert r.returncode == 0, r.stderr
    entries = json.loads(r.stdout)["entries"]
    files = tree_files(small_tree)
    assert [e["path"] for e in entries] == sorted(files)
    for e in entries:
        data = files[e["path"]]
        assert e["hash"] == sha(data) and e["size"] == len(data)
        assert e["label"] == ("" if e["path"] == "README" else e["path"].split("/")[0])
        assert e["location"] == {"uri": f"file://{small_tree}/{e['path']}", "offset": 0,
                                 "length": len(data)}


def test_show_text(quiver, small_digest: str, small_tree: str) -> None:
    r = quiver("digest", "show", small_digest, "--entries")
    assert r.returncode == 0, r.stderr
    assert "name:     small" in r.stdout and "items:    5" in r.stdout
    assert f"{sha(b'woof')}           4  dog              dog/1.jpg" in r.stdout
    assert f"{sha(b'top-level file')}          14  -                README" in r.stdout


# --- verify -------------------------------------------------------------------------

def test_verify_unchanged_tree(quiver, small_digest: str) -> None:
    r = quiver("digest", "verify", small_digest)
    assert (r.returncode, r.stdout.strip()) == (0, "all 5 items match")


def test_verify_lists_each_mismatched_and_missing_item(quiver, small_digest: str,
                                                       small_tree: str) -> None:
    with open(os.path.join(small_tree, "cat/1.jpg"), "wb") as f:
        f.write(b"MEOW")  # same size, other content
    with open(os.path.join(small_tree, "dog/sub/3.jpg"), "ab") as f:
        f.write(b"!")  # other size
    os.unlink(os.path.join(small_tree, "cat/2.jpg"))
    os.unlink(os.path.join(small_tree, "README"))
    r = quiver("digest", "verify", small_digest)
    assert r.returncode == ExitCode.MISMATCH
    lines = r.stdout.splitlines()
    assert [line.split(": ")[:2] for line in lines] == [
        ["missing", "README"], ["mismatch", "cat/1.jpg"], ["missing", "cat/2.jpg"],
        ["mismatch", "dog/sub/3.jpg"]]
    assert r.stderr.strip() == f"4 of 5 items do not match {small_digest}"


# --- diff ---------------------------------------------------------------------------

def test_diff_identical(quiver, small_digest: str, tmp_path) -> None:
    copy = str(tmp_path / "copy.qd")
    shutil.copy(small_digest, copy)
    r = quiver("digest", "diff", small_digest, copy)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "0 removed, 0 added, 0 changed, 5 distinct contents shared"


def test_diff_reports_removed_added_and_changed(quiver, small_digest: str, small_tree: str,
                                               tmp_path) -> None:
    os.unlink(os.path.join(small_tree, "cat/2.jpg"))
    with open(os.path.join(small_tree, "dog/1.jpg"), "wb") as f:
        f.write(b"bark")
    with open(os.path.join(small_tree, "dog/2.jpg"), "wb") as f:
        f.write(b"meow")  # same content as cat/1.jpg
    after = str(tmp_path / "after.qd")
    assert quiver("digest", "create", small_tree, "-o", after).returncode == 0
    r = quiver("digest", "diff", small_digest, after)
    assert r.returncode == ExitCode.MISMATCH
    assert r.stdout.splitlines() == ["- cat/2.jpg", "+ dog/2.jpg", "~ dog/1.jpg",
                                     "1 removed, 1 added, 1 changed, "
                                     "3 distinct contents shared"]
    r = quiver("digest", "diff", small_digest, after, "--json")
    assert r.returncode == ExitCode.MISMATCH
    assert json.loads(r.stdout) == {"only_a": ["cat/2.jpg"], "only_b": ["dog/2.jpg"],
                                    "changed": ["dog/1.jpg"], "shared_content": 3,
                                    "identical": False}


# --- gs:// sources ------------------------------------------------------------------

def test_gs_digest_matches_the_local_digest(quiver, synthetic_tree: Tree, upload,
                                            gcs_emulator: Emulator, tmp_path) -> None:
    uri = upload(synthetic_tree.root, "imagenet/train")
    local_out, gs_out = str(tmp_path / "local.qd"), str(tmp_path / "gs.qd")
    assert quiver("digest", "create", synthetic_tree.root, "-o", local_out).returncode == 0
    r = quiver("digest", "create", uri, "-o", gs_out, "--anonymous", "--workers", "4")
    assert r.returncode == 0, r.stderr
    local, remote = fmt.load(local_out), fmt.load(gs_out)
    assert (remote.source, remote.name) == (uri, "train")
    assert remote.labels == local.labels
    for a, b in zip(local.entries(), remote.entries(), strict=True):
        assert (a.path, a.label, a.hash, a.size) == (b.path, b.label, b.hash, b.size)
        assert b.location == fmt.Location(f"{uri}/{b.path}", 0, b.size)
    assert quiver("digest", "diff", local_out, gs_out).returncode == 0


def test_verify_gs_digest(gcs_emulator: Emulator, synthetic_tree: Tree, upload,
                          tmp_path) -> None:
    from digest_tools.verify import verify_digest

    uri = upload(synthetic_tree.root, "v")
    opts = StorageOptions(emulator_host=gcs_emulator.host)
    d = fmt.decode(create_digest(uri, None, workers=4, options=opts))
    assert verify_digest(d, workers=4, options=opts) == []

"""Digests, what a dataset holds by content hash: the model (a loaded Digest and its
records), and making, reading and writing digest files.

The file's layout, its bounds and the checks that let mountd (as root) decode any user's
digest are ``quiverfs.digest_checks``'s; ``encode`` runs the same checks on what it writes.

The label of an item is the directory ``label_level`` levels under the root
(``label_level`` = 1: the first directory, i.e. the ImageFolder class); items not
that deep have the label "".
"""
from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator, Sequence

import msgpack

from quiverfs.digest_checks import (FORMAT_VERSION, HASH_LEN, MAGIC, PREAMBLE, CheckedDigest,
                                    InvalidDigest, check, parse)
from quiverfs.errors import ExitCode, QuietError


def _u64_bytes(values: Sequence[int]) -> bytes:
    arr = array.array("Q", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _u32_bytes(values: Sequence[int]) -> bytes:
    arr = array.array("I", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


@dataclasses.dataclass(frozen=True)
class Location:
    """Where an item's bytes live: an object URI, and a range inside it."""

    uri: str
    offset: int
    length: int

    def as_dict(self) -> dict:
        return {"uri": self.uri, "offset": self.offset, "length": self.length}


@dataclasses.dataclass(frozen=True)
class Entry:
    """One item of a digest, as a record (for display and tests; not for hot loops)."""

    path: str
    label: str
    hash: str
    size: int
    location: Location

    def as_dict(self) -> dict:
        return {"path": self.path, "label": self.label, "hash": self.hash, "size": self.size,
                "location": self.location.as_dict()}


@dataclasses.dataclass(frozen=True)
class NewItem:
    """An item as digest creation finds it, before it is written."""

    path: str
    digest: bytes
    size: int
    key: str | None = None  # object key, when it differs from path
    offset: int = 0


class Digest:
    """A loaded digest: columns kept as compact arrays, records built on demand."""

    def __init__(self, checked: CheckedDigest) -> None:
        self.name = checked.name
        self.source = checked.source
        self.label_level = checked.label_level
        self.labels = checked.labels
        self.hashes = checked.hashes
        self.sizes = checked.sizes
        self.path_offsets = checked.path_offsets
        self.paths_blob = checked.paths
        self.label_index = checked.label_index
        self.loc_keys = checked.loc_keys
        self.loc_offsets = checked.loc_offsets
        self.identity = checked.identity  # hex SHA-256 of the file's contents after the preamble
        self.n_dirs = checked.n_dirs  # directories its paths make, the root included
        self.data = checked.data  # the file it was decoded from (its columns are views of it)
        self.total_bytes = sum(self.sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def path(self, i: int) -> str:
        return bytes(self.paths_blob[self.path_offsets[i]:self.path_offsets[i + 1]]).decode()

    def hash(self, i: int) -> bytes:
        return bytes(self.hashes[i * HASH_LEN:(i + 1) * HASH_LEN])

    def paths_of(self, items: Iterable[int]) -> list[str]:
        """``path`` of each of ``items``: a segment's thousands at half the cost."""
        blob, offsets = self.paths_blob, self.path_offsets
        return [str(blob[offsets[i]:offsets[i + 1]], "utf-8") for i in items]

    def hashes_of(self, items: Iterable[int]) -> list[bytes]:
        """``hash`` of each of ``items``, as ``paths_of``."""
        hashes = self.hashes
        return [bytes(hashes[i * HASH_LEN:(i + 1) * HASH_LEN]) for i in items]

    def label(self, i: int) -> str:
        return self.labels[self.label_index[i]]

    def key(self, i: int) -> str:
        if self.loc_keys is None:
            return self.path(i)
        offsets, blob = self.loc_keys
        return bytes(blob[offsets[i]:offsets[i + 1]]).decode()

    def location(self, i: int) -> Location:
        offset = self.loc_offsets[i] if self.loc_offsets is not None else 0
        return Location(f"{self.source.rstrip('/')}/{self.key(i)}", offset, self.sizes[i])

    def entry(self, i: int) -> Entry:
        return Entry(self.path(i), self.label(i), self.hash(i).hex(), self.sizes[i],
                     self.location(i))

    def entries(self) -> Iterator[Entry]:
        return (self.entry(i) for i in range(len(self)))

    def summary(self) -> dict:
        return {"name": self.name, "source": self.source, "items": len(self),
                "bytes": self.total_bytes, "labels": len([x for x in self.labels if x]),
                "label_level": self.label_level, "identity": self.identity,
                "format_version": FORMAT_VERSION}


def label_for(path: str, level: int) -> str:
    """The label rule: the directory ``level`` levels under the root, or "" if none."""
    parts = path.split("/")
    return parts[level - 1] if level >= 1 and len(parts) > level else ""


def encode(name: str, source: str, items: Sequence[NewItem], label_level: int = 1) -> bytes:
    """Serialize items (any order) into the digest file format; same input, same bytes.

    Raises QuietError(BAD_INPUT) for anything ``decode`` would refuse (a path that is not
    canonical, a duplicate, a file that is also a directory, an unsupported source...).
    """
    items = sorted(items, key=lambda it: it.path)
    labels = sorted({label_for(it.path, label_level) for it in items})
    label_pos = {lab: i for i, lab in enumerate(labels)}
    columns: dict[str, bytes] = {}
    try:
        path_bytes = [it.path.encode() for it in items]
        columns["hashes"] = b"".join(it.digest for it in items)
        columns["sizes"] = _u64_bytes([it.size for it in items])
        columns["path_offsets"], columns["paths"] = _pack_strings(path_bytes)
        columns["label_index"] = _u32_bytes([label_pos[label_for(it.path, label_level)]
                                             for it in items])
        if any(it.key is not None and it.key != it.path for it in items):
            columns["loc_key_offsets"], columns["loc_keys"] = _pack_strings(
                [(it.key or it.path).encode() for it in items])
        if any(it.offset for it in items):
            columns["loc_offsets"] = _u64_bytes([it.offset for it in items])
    except UnicodeEncodeError as exc:
        raise QuietError(f"cannot make a digest of {source}: {exc.object!r} is not a UTF-8 "
                         "name", ExitCode.BAD_INPUT) from None
    except OverflowError:
        raise QuietError(f"cannot make a digest of {source}: an item size or offset is "
                         "negative or does not fit 64 bits", ExitCode.BAD_INPUT) from None
    table, pos = {}, 0
    for col, data in columns.items():
        table[col] = [pos, len(data)]
        pos += len(data)
    header = {"name": name, "source": source, "count": len(items),
              "label_level": label_level, "labels": labels, "columns": table}
    area = b"".join(columns.values())
    try:
        check(header, area)  # the same checks as decode, so what we write can be read
    except InvalidDigest as exc:
        raise QuietError(f"cannot make a digest of {source}: {exc}", ExitCode.BAD_INPUT) from None
    packed = msgpack.packb(header, use_bin_type=True)
    body = packed + area
    return PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(packed),
                         hashlib.sha256(body).digest()) + body


def _pack_strings(strings: list[bytes]) -> tuple[bytes, bytes]:
    offsets = [0]
    for s in strings:
        offsets.append(offsets[-1] + len(s))
    return _u64_bytes(offsets), b"".join(strings)


def decode(data: bytes, where: str = "digest") -> Digest:
    """Parse and check a digest file's bytes (``digest_checks.parse``); raise
    QuietError(BAD_DIGEST) on any problem. A digest that decodes can be mounted and
    listed without surprises."""
    return Digest(parse(data, where))


def load(path: str) -> Digest:
    """Read and check a digest file."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise QuietError(f"digest {path} does not exist: check the path",
                         ExitCode.NOT_FOUND) from None
    except IsADirectoryError:
        raise QuietError(f"{path} is a directory, not a digest file", ExitCode.BAD_DIGEST) from None
    except PermissionError:
        raise QuietError(f"digest {path} is not readable: check its permissions",
                         ExitCode.PERMISSION) from None
    return decode(data, where=path)


def write_atomic(path: str, data: bytes) -> None:
    """Write to a temporary file beside ``path``, fsync, then rename over it."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".quiver-", suffix=".tmp", dir=directory)
    except FileNotFoundError:
        raise QuietError(f"cannot write {path}: directory {directory} does not exist",
                         ExitCode.NOT_FOUND) from None
    except PermissionError:
        raise QuietError(f"cannot write {path}: permission denied", ExitCode.PERMISSION) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, IsADirectoryError):
            raise QuietError(f"cannot write {path}: it is a directory; give a file name",
                             ExitCode.USAGE) from None
        raise
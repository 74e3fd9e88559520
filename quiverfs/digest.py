"""The digest file: what a dataset holds, by content hash.

Layout (all integers little-endian)::

    b"QUIVERDG"  u16 version  u32 header_len  sha256(header + columns)  header  columns

The header is a msgpack map of metadata and a column table ``{name: [offset, length]}``
(offsets relative to the first column byte). Columns are raw arrays, so loading a
1.3 M-entry digest is one read, one SHA-256 and a few zero-copy views:

=============  ==========================================================
hashes         32-byte SHA-256 of each item, entry order
sizes          u64 size of each item
path_offsets   u64 offsets of each path in ``paths`` (N + 1 of them)
paths          UTF-8 relative paths, concatenated; entries sorted by path
label_index    u32 index into the header's ``labels`` list
loc_keys       (optional) object keys, like ``paths``; absent: key == path
loc_offsets    (optional) u64 byte offset of the item inside its object; absent: 0
=============  ==========================================================

The label of an item is the directory ``label_level`` levels under the root
(``label_level`` = 1: the first directory, i.e. the ImageFolder class); items not
that deep have the label "".
"""
from __future__ import annotations

import array
import dataclasses
import hashlib
import os
import struct
import sys
import tempfile
from collections.abc import Iterator, Sequence

import msgpack

from quiverfs.errors import ExitCode, QuietError

MAGIC = b"QUIVERDG"
FORMAT_VERSION = 1
_PREAMBLE = struct.Struct("<8sHI32s")
HASH_LEN = 32


def _u64(data: bytes | memoryview) -> array.array:
    arr = array.array("Q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def _u64_bytes(values: Sequence[int]) -> bytes:
    arr = array.array("Q", values)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def _u32(data: bytes | memoryview) -> array.array:
    arr = array.array("I")
    if arr.itemsize != 4:
        arr = array.array("L")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


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

    def __init__(self, name: str, source: str, label_level: int, labels: list[str],
                 hashes: bytes | memoryview, sizes: array.array, path_offsets: array.array,
                 paths: bytes | memoryview, label_index: array.array,
                 loc_keys: tuple[array.array, bytes | memoryview] | None = None,
                 loc_offsets: array.array | None = None, identity: str = "") -> None:
        self.name = name
        self.source = source
        self.label_level = label_level
        self.labels = labels
        self.hashes = hashes
        self.sizes = sizes
        self.path_offsets = path_offsets
        self.paths_blob = paths
        self.label_index = label_index
        self.loc_keys = loc_keys
        self.loc_offsets = loc_offsets
        self.identity = identity  # hex SHA-256 of the file's contents after the preamble
        self.total_bytes = sum(sizes)

    def __len__(self) -> int:
        return len(self.sizes)

    def path(self, i: int) -> str:
        return bytes(self.paths_blob[self.path_offsets[i]:self.path_offsets[i + 1]]).decode()

    def hash(self, i: int) -> bytes:
        return bytes(self.hashes[i * HASH_LEN:(i + 1) * HASH_LEN])

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
    """Serialize items (any order) into the digest file format; same input, same bytes."""
    items = sorted(items, key=lambda it: it.path)
    for a, b in zip(items, items[1:]):
        if a.path == b.path:
            raise QuietError(f"duplicate path {a.path!r} in digest", ExitCode.BAD_INPUT)
    labels = sorted({label_for(it.path, label_level) for it in items})
    label_pos = {lab: i for i, lab in enumerate(labels)}
    columns: dict[str, bytes] = {}
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
    table, pos = {}, 0
    for col, data in columns.items():
        table[col] = [pos, len(data)]
        pos += len(data)
    header = msgpack.packb({"name": name, "source": source, "count": len(items),
                            "label_level": label_level, "labels": labels,
                            "columns": table}, use_bin_type=True)
    body = header + b"".join(columns.values())
    return _PREAMBLE.pack(MAGIC, FORMAT_VERSION, len(header),
                          hashlib.sha256(body).digest()) + body


def _pack_strings(strings: list[bytes]) -> tuple[bytes, bytes]:
    offsets = [0]
    for s in strings:
        offsets.append(offsets[-1] + len(s))
    return _u64_bytes(offsets), b"".join(strings)


def decode(data: bytes, where: str = "digest") -> Digest:
    """Parse and check a digest file's bytes; raise QuietError(BAD_DIGEST) on any problem."""
    def bad(problem: str) -> QuietError:
        return QuietError(f"{where}: {problem}", ExitCode.BAD_DIGEST)

    if not data or data[:len(MAGIC)] != MAGIC[:len(data)]:
        raise bad("not a Quiver digest (make one with 'quiver digest create')")
    if len(data) < _PREAMBLE.size:
        raise bad("truncated: recreate it")
    magic, version, header_len, checksum = _PREAMBLE.unpack_from(data)
    if version > FORMAT_VERSION:
        raise bad(f"digest format version {version} is newer than this Quiver supports "
                  f"({FORMAT_VERSION}): upgrade Quiver")
    if version < 1:
        raise bad(f"unknown digest format version {version}")
    body = memoryview(data)[_PREAMBLE.size:]
    if hashlib.sha256(body).digest() != checksum:
        raise bad("checksum mismatch: the file is truncated or corrupted; recreate it")
    try:
        header = msgpack.unpackb(body[:header_len], raw=False)
        count = int(header["count"])
        cols = {name: body[header_len + off:header_len + off + ln]
                for name, (off, ln) in header["columns"].items()}
        labels = list(header["labels"])
        digest = Digest(
            name=str(header["name"]), source=str(header["source"]),
            label_level=int(header["label_level"]), labels=labels,
            hashes=cols["hashes"], sizes=_u64(cols["sizes"]),
            path_offsets=_u64(cols["path_offsets"]), paths=cols["paths"],
            label_index=_u32(cols["label_index"]),
            loc_keys=((_u64(cols["loc_key_offsets"]), cols["loc_keys"])
                      if "loc_keys" in cols else None),
            loc_offsets=_u64(cols["loc_offsets"]) if "loc_offsets" in cols else None,
            identity=checksum.hex())
    except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
        raise bad(f"malformed contents ({type(exc).__name__}): recreate it") from None
    if (len(digest.hashes) != count * HASH_LEN or len(digest.sizes) != count
            or len(digest.path_offsets) != count + 1 or len(digest.label_index) != count
            or (count and max(digest.label_index) >= len(labels))):
        raise bad("column lengths disagree with the entry count: recreate it")
    return digest


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

"""What a well-formed digest file is, and checking untrusted bytes against it.

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

``parse`` trusts nothing in the file (mountd, as root, decodes any user's digest) and
``quiverfs.digest.encode`` refuses the same things with ``check``; docs/cli.md lists what
is checked. Building a Digest from what ``parse`` returns is ``quiverfs.digest``'s.
"""
from __future__ import annotations

import array
import bisect
import dataclasses
import hashlib
import itertools
import operator
import re
import struct
import sys
from collections.abc import Callable, Iterator

import msgpack

from quiverfs.backends import check_key, normalize_uri
from quiverfs.errors import ExitCode, QuietError

MAGIC = b"QUIVERDG"
FORMAT_VERSION = 1
PREAMBLE = struct.Struct("<8sHI32s")
HASH_LEN = 32

# Bounds a digest must respect. mountd (root) decodes digests from any local user, so
# every number is bounded where its sums and offsets stay far from 2**63 (st_size, file
# offsets and counters are signed 64-bit), and every name within what Linux can open.
MAX_ITEM_BYTES = 1 << 40  # 1 TiB: far above any training item
MAX_TOTAL_BYTES = 1 << 56  # 64 PiB for a whole dataset
MAX_OBJECT_BYTES = 1 << 48  # where an item may start inside its object (GCS objects: 5 TiB)
MAX_PATH_BYTES = 4096  # PATH_MAX, for paths and object keys
MAX_NAME_BYTES = 255  # NAME_MAX, for each path component
MAX_LABEL_LEVEL = MAX_PATH_BYTES // 2  # no deeper level exists in a path of that length

# name: (bytes per entry, entries beyond the count, required); 0 bytes: a string blob
_COLUMNS = {"hashes": (HASH_LEN, 0, True), "sizes": (8, 0, True),
            "path_offsets": (8, 1, True), "paths": (0, 0, True), "label_index": (4, 0, True),
            "loc_key_offsets": (8, 1, False), "loc_keys": (0, 0, False),
            "loc_offsets": (8, 0, False)}
# Strings joined at a time when checking a column: bytes.join holds an 80-byte buffer
# record per item, which for a whole column would cost more than the column itself.
_JOIN_BATCH = 1 << 14
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def _u64(data: bytes | memoryview) -> array.array:
    arr = array.array("Q")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


def _u32(data: bytes | memoryview) -> array.array:
    arr = array.array("I")
    if arr.itemsize != 4:
        arr = array.array("L")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr


@dataclasses.dataclass(frozen=True)
class CheckedDigest:
    """A digest's header fields and columns, every one checked; the columns are views of
    the file's bytes, or compact arrays."""

    name: str
    source: str
    label_level: int
    labels: list[str]
    hashes: bytes | memoryview
    sizes: array.array
    path_offsets: array.array
    paths: bytes | memoryview
    label_index: array.array
    loc_keys: tuple[array.array, bytes | memoryview] | None
    loc_offsets: array.array | None
    identity: str  # hex SHA-256 of the file's contents after the preamble ("": no file)
    n_dirs: int  # directories its paths make, the root included
    data: bytes  # the file it was decoded from (its columns are views of it), or b""


def decode_peak(data: bytes) -> int:
    """The most decoding ``data`` may allocate at once, from the preamble alone: the
    header becomes Python objects of up to 80 bytes a byte (an empty map is one byte);
    the path and key checks hold each string as an object, up to 4 bytes a column byte."""
    if len(data) < PREAMBLE.size:
        return 0
    header = min(PREAMBLE.unpack_from(data)[2], len(data) - PREAMBLE.size)
    return 80 * header + 4 * (len(data) - header)


def parse(data: bytes, where: str = "digest") -> CheckedDigest:
    """Parse and check a digest file's bytes; raise QuietError(BAD_DIGEST) on any problem.

    Every field is checked (types, column lengths, offsets, canonical sorted paths, keys,
    size bounds), so a digest that decodes can be mounted and listed without surprises.
    """
    def bad(problem: str) -> QuietError:
        return QuietError(f"{where}: {problem}", ExitCode.BAD_DIGEST)

    if not data or data[:len(MAGIC)] != MAGIC[:len(data)]:
        raise bad("not a Quiver digest (make one with 'quiver digest create')")
    if len(data) < PREAMBLE.size:
        raise bad("truncated: recreate it")
    magic, version, header_len, checksum = PREAMBLE.unpack_from(data)
    if version > FORMAT_VERSION:
        raise bad(f"digest format version {version} is newer than this Quiver supports "
                  f"({FORMAT_VERSION}): upgrade Quiver")
    if version < 1:
        raise bad(f"unknown digest format version {version}")
    body = memoryview(data)[PREAMBLE.size:]
    if hashlib.sha256(body).digest() != checksum:
        raise bad("checksum mismatch: the file is truncated or corrupted; recreate it")
    try:
        if header_len > len(body):
            raise InvalidDigest(f"the header length {header_len} runs past the end of the file")
        try:
            header = msgpack.unpackb(body[:header_len], raw=False)
        except (ValueError, msgpack.UnpackException) as exc:  # UnicodeDecodeError is one
            raise InvalidDigest(f"the header is not valid msgpack ({type(exc).__name__})") from None
        return check(header, body[header_len:], checksum.hex(), data)
    except InvalidDigest as exc:
        raise bad(f"{exc}: recreate it with 'quiver digest create'") from None


class InvalidDigest(Exception):
    """What is wrong with a digest's contents, phrased for its user (one line)."""


def check(header: object, area: bytes | memoryview, identity: str = "",
          data: bytes = b"") -> CheckedDigest:
    """Check a decoded header and its column area (of the file ``data``, when decoding);
    raise InvalidDigest on any problem, else return what they describe."""
    if not isinstance(header, dict):
        raise InvalidDigest("the header is not a map")
    name, source, count, label_level, labels = (
        header.get(k) for k in ("name", "source", "count", "label_level", "labels"))
    if not isinstance(name, str):
        raise InvalidDigest("header field 'name' is not a string")
    if not isinstance(source, str):
        raise InvalidDigest("header field 'source' is not a string")
    _check_source(source)
    if not _is_int(count) or count < 0:
        raise InvalidDigest("header field 'count' is not a non-negative integer")
    if not _is_int(label_level) or not 0 <= label_level <= MAX_LABEL_LEVEL:
        raise InvalidDigest(f"header field 'label_level' is not an integer from 0 to "
                            f"{MAX_LABEL_LEVEL}")
    if not isinstance(labels, list) or not all(isinstance(x, str) for x in labels):
        raise InvalidDigest("header field 'labels' is not a list of strings")
    cols = _columns(header.get("columns"), area, count)
    path_offsets = _u64(cols["path_offsets"])
    n_dirs = _check_paths(cols["paths"], path_offsets)

    def path(i: int) -> str:
        """Entry ``i``'s path, quoted for a message."""
        return _show(bytes(cols["paths"][path_offsets[i]:path_offsets[i + 1]]))

    sizes = _u64(cols["sizes"])
    _check_sizes(sizes, path)
    label_index = _u32(cols["label_index"])
    if count and max(label_index) >= len(labels):
        i = label_index.index(max(label_index))
        raise InvalidDigest(f"the label of {path(i)} is number {label_index[i]}, but "
                            f"the header lists {len(labels)}")
    loc_keys = None
    if "loc_keys" in cols:
        loc_keys = (_u64(cols["loc_key_offsets"]), cols["loc_keys"])
        _check_keys(_strings(loc_keys[1], loc_keys[0], "object key"), path)
    loc_offsets = None
    if "loc_offsets" in cols:
        loc_offsets = _u64(cols["loc_offsets"])
        if count and max(loc_offsets) > MAX_OBJECT_BYTES:
            i = loc_offsets.index(max(loc_offsets))
            raise InvalidDigest(f"{path(i)} starts at byte {loc_offsets[i]} of its "
                                f"object, beyond the {MAX_OBJECT_BYTES}-byte bound")
    return CheckedDigest(name=name, source=source, label_level=label_level, labels=labels,
                         hashes=cols["hashes"], sizes=sizes, path_offsets=path_offsets,
                         paths=cols["paths"], label_index=label_index, loc_keys=loc_keys,
                         loc_offsets=loc_offsets, identity=identity, n_dirs=n_dirs,
                         data=data)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # msgpack's true is a bool


def _check_source(source: str) -> None:
    """A canonical ``file:///PATH`` or ``gs://BUCKET[/PREFIX]``, as digest creation writes."""
    try:
        canonical = normalize_uri(source) == source
    except QuietError:  # a scheme no backend reads
        canonical = False
    if canonical and source.startswith("gs://"):
        bucket, _, prefix = source[len("gs://"):].partition("/")
        canonical = bool(bucket) and (not prefix or _is_key(prefix))
    if not canonical or _CONTROL.search(source):
        raise InvalidDigest(f"source {source!r} is not a file:///PATH or gs://BUCKET[/PREFIX] URI "
                            "in canonical form")


def _is_key(key: str) -> bool:
    """Whether the backends accept ``key`` (relative, no empty, '.' or '..' component)."""
    try:
        check_key(key)
    except ValueError:
        return False
    return True


def _columns(table: object, area: bytes | memoryview, count: int
             ) -> dict[str, bytes | memoryview]:
    """The column table checked against the format and the entry count; name -> bytes."""
    if not isinstance(table, dict):
        raise InvalidDigest("header field 'columns' is not a map")
    for col, span in table.items():
        if col not in _COLUMNS:
            raise InvalidDigest(f"unknown column {col!r}")
        if not (isinstance(span, list) and len(span) == 2 and all(
                _is_int(x) and x >= 0 for x in span)):
            raise InvalidDigest(f"the column table entry of {col!r} is not [offset, length]")
        if span[0] + span[1] > len(area):
            raise InvalidDigest(f"column {col!r} runs past the end of the file")
    missing = [c for c in _COLUMNS if c not in table and _COLUMNS[c][2]]
    if ("loc_keys" in table) != ("loc_key_offsets" in table):
        missing.append("loc_key_offsets" if "loc_keys" in table else "loc_keys")
    if missing:
        raise InvalidDigest(f"missing column(s) {', '.join(missing)}")
    for col, (per_entry, extra, _) in _COLUMNS.items():
        if per_entry and col in table and table[col][1] != (count + extra) * per_entry:
            raise InvalidDigest(f"column {col!r} holds {table[col][1]} bytes, but {count} entries "
                                f"need {(count + extra) * per_entry}")
    return {col: area[off:off + length] for col, (off, length) in table.items()}


def _strings(blob: bytes | memoryview, offsets: array.array, what: str) -> list[bytes]:
    """Split a string column at checked offsets; each string of bounded length, without
    NUL bytes, and valid UTF-8."""
    if (offsets[0] != 0 or offsets[-1] != len(blob)
            or not all(map(operator.le, offsets, itertools.islice(offsets, 1, None)))):
        raise InvalidDigest(f"the {what} offsets do not run upwards from 0 to the end of "
                            "their column")
    raw = bytes(blob)
    pieces = [raw[a:b] for a, b in zip(offsets, itertools.islice(offsets, 1, None))]
    if pieces and max(map(len, pieces)) > MAX_PATH_BYTES:
        i = next(i for i, p in enumerate(pieces) if len(p) > MAX_PATH_BYTES)
        raise InvalidDigest(f"{what} {i} is longer than {MAX_PATH_BYTES} bytes")
    if b"\0" in raw:
        i = bisect.bisect_right(offsets, raw.index(b"\0")) - 1
        raise InvalidDigest(f"{what} {_show(pieces[i])} contains a NUL byte")
    del raw  # the pieces are copies: free the column's worth
    # '/' is ASCII, so a framed batch is valid UTF-8 exactly when each of its strings
    # is: one C-speed decode per batch instead of one call per entry.
    if not all(map(_is_utf8, _framed_batches(pieces))):
        bad = next(p for p in pieces if not _is_utf8(p))
        raise InvalidDigest(f"{what} {_show(bad)} is not valid UTF-8")
    return pieces


def _framed_batches(strings: list[bytes]) -> Iterator[bytes]:
    """The strings in batches, each joined and framed in '/': ``/s0/s1/.../``."""
    for i in range(0, len(strings), _JOIN_BATCH):
        yield b"/".join([b"", *strings[i:i + _JOIN_BATCH], b""])


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode()
    except UnicodeDecodeError:
        return False
    return True


def _check_paths(blob: bytes | memoryview, offsets: array.array) -> int:
    """Paths are canonical, sorted and unique, and no file is also a directory; the
    number of directories they make, the root included."""
    paths = _strings(blob, offsets, "path")
    if b"" in paths:
        raise InvalidDigest(f"path {paths.index(b'')} is empty")
    # Many paths at once: a few C-speed searches find any bad component (with no empty
    # path, each hit lies in one path); then find which path it was.
    if any(map(_component_problem, _framed_batches(paths))):
        p, why = next((p, why) for p in paths if (why := _component_problem(b"/" + p + b"/")))
        raise InvalidDigest(f"path {_show(p)} {why}")
    if paths and max(map(len, paths)) > MAX_NAME_BYTES:
        for p in paths:
            if max(map(len, p.split(b"/"))) > MAX_NAME_BYTES:
                raise InvalidDigest(f"path {_show(p)} has a component longer than "
                                    f"{MAX_NAME_BYTES} bytes")
    if not all(map(bytes.__lt__, paths, itertools.islice(paths, 1, None))):
        a, b = next((a, b) for a, b in zip(paths, paths[1:]) if not a < b)
        raise InvalidDigest(f"duplicate path {_show(a)}" if a == b else
                            f"paths are not sorted: {_show(a)} comes before {_show(b)}")
    return _count_dirs(paths)


def _count_dirs(paths: list[bytes]) -> int:
    """The directories ``paths`` make, the root included; none may also be a file.

    Memory stays linear in the paths: a set of every directory's full path would hold
    each path's ancestors, quadratic in its depth (1000 times the digest's size for
    paths 2000 levels deep). With NUL (never in a path) for '/', a directory and all
    under it sort together, so one was seen exactly when the previous file directory
    is it or lies under it.
    """
    n_dirs, previous = 1, b""
    for dirname in sorted({p.rpartition(b"/")[0].replace(b"/", b"\0") for p in paths}):
        node = dirname
        while node and not (previous == node or previous.startswith(node + b"\0")):
            n_dirs += 1
            d = node.replace(b"\0", b"/")
            i = bisect.bisect_left(paths, d)
            if i < len(paths) and paths[i] == d:
                raise InvalidDigest(f"path {_show(d)} is both a file and a directory of other "
                                    "paths")
            node = node.rpartition(b"\0")[0]
        previous = dirname
    return n_dirs


def _component_problem(framed: bytes) -> str | None:
    """Why the path(s) in ``framed`` ('/' + path + '/') are not canonical, or None."""
    if framed.startswith(b"//"):
        return "is absolute (starts with '/')"
    if framed.endswith(b"//"):
        return "ends with '/'"
    if b"//" in framed:
        return "has an empty component ('//')"
    if b"/./" in framed:
        return "has a '.' component"
    if b"/../" in framed:
        return "has a '..' component"
    return None


def _check_sizes(sizes: array.array, path: Callable[[int], str]) -> None:
    """Each item, and all of them together, within the bounds."""
    if sizes and max(sizes) > MAX_ITEM_BYTES:
        i = sizes.index(max(sizes))
        raise InvalidDigest(f"{path(i)} has size {sizes[i]}, over the "
                            f"{MAX_ITEM_BYTES}-byte bound on an item")
    if sum(sizes) > MAX_TOTAL_BYTES:
        raise InvalidDigest(f"the items add up to {sum(sizes)} bytes, over the "
                            f"{MAX_TOTAL_BYTES}-byte bound on a dataset")


def _check_keys(keys: list[bytes], path: Callable[[int], str]) -> None:
    """Every object key stays inside the source (the backends' own rule)."""
    for key in dict.fromkeys(keys):  # pack files make most keys repeat; first one first
        if not _is_key(key.decode()):
            raise InvalidDigest(f"the object key {_show(key)} of {path(keys.index(key))} "
                                "is not a relative key inside the source (absolute, or with an "
                                "empty, '.' or '..' component)")


def _show(s: bytes) -> str:
    """A path or key from a digest, quoted for a one-line message."""
    return repr(s.decode(errors="backslashreplace"))

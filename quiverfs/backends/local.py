"""``file:///path`` backend: a local directory (the embedded default)."""
from __future__ import annotations

import errno
import logging
import os
from collections.abc import Iterator
from typing import BinaryIO

from quiverfs.backends.base import Backend, ObjectInfo, check_key
from quiverfs.errors import ExitCode, QuietError
from quiverfs.fs_identity import (IdentityUnavailable, PathRefused, UserIdentity, acting_as,
                                  open_regular)

log = logging.getLogger(__name__)

BLOCK = 1 << 20


def os_error(exc: OSError, what: str) -> QuietError:
    """Turn an OSError into the QuietError a user should see."""
    if isinstance(exc, IdentityUnavailable):
        return QuietError(str(exc), ExitCode.PERMISSION)
    if exc.errno in (errno.ENOENT, errno.ENOTDIR):
        return QuietError(f"{what} does not exist: check the path", ExitCode.NOT_FOUND)
    if isinstance(exc, PathRefused):
        return QuietError(f"{what} is {exc.strerror}: name a file of the dataset",
                          ExitCode.PERMISSION)
    if exc.errno in (errno.EACCES, errno.EPERM):
        return QuietError(f"{what} is not readable (permission denied): fix its permissions",
                          ExitCode.PERMISSION)
    if exc.errno == errno.ELOOP:
        return QuietError(f"{what} is a symlink loop, or a link into /proc (which mountd "
                          "does not follow): point it at a regular file", ExitCode.BAD_INPUT)
    return QuietError(f"{what}: {exc.strerror}", ExitCode.BACKEND)


class LocalBackend(Backend):
    """Objects are files under a directory; keys are paths relative to it.

    With ``read_as``, every object is opened with that user's file-system identity, so
    a root daemon reads only what the user could read at that moment."""

    def __init__(self, root: str, read_as: UserIdentity | None = None) -> None:
        self.root = os.path.abspath(root)
        self.uri = "file://" + self.root
        self.read_as = read_as

    def _path(self, key: str) -> str:
        return os.path.join(self.root, *check_key(key).split("/"))

    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        path = self._path(key)
        try:
            with acting_as(self.read_as):
                fd = open_regular(path)
        except OSError as exc:
            raise os_error(exc, path) from None
        try:
            if length is None:
                length = os.fstat(fd).st_size - offset
            chunks = []
            while length > 0:
                piece = os.pread(fd, min(length, 16 * BLOCK), offset)
                if not piece:
                    break
                chunks.append(piece)
                offset += len(piece)
                length -= len(piece)
            return b"".join(chunks)
        except OSError as exc:
            raise os_error(exc, path) from None
        finally:
            os.close(fd)

    def stream_into(self, key: str, sink: BinaryIO) -> int:
        path = self._path(key)
        total = 0
        try:
            with acting_as(self.read_as):
                fd = open_regular(path)
            with open(fd, "rb", buffering=0) as f:
                while piece := f.read(BLOCK):
                    sink.write(piece)
                    total += len(piece)
        except OSError as exc:
            raise os_error(exc, path) from None
        return total

    def list(self) -> Iterator[ObjectInfo]:
        """Walk the tree, following symlinks; loops, unreadable dirs and non-UTF-8 names fail."""
        if not os.path.isdir(self.root):
            if os.path.exists(self.root):
                raise QuietError(f"{self.root} is not a directory: give a dataset directory",
                                 ExitCode.BAD_INPUT)
            raise QuietError(f"source {self.root} does not exist: check the path",
                             ExitCode.NOT_FOUND)
        yield from self._walk("", frozenset())

    def _walk(self, rel: str, ancestors: frozenset[tuple[int, int]]) -> Iterator[ObjectInfo]:
        path = os.path.join(self.root, rel) if rel else self.root
        try:
            st = os.stat(path)
            entries = sorted(os.scandir(path), key=lambda e: e.name)
        except OSError as exc:
            raise os_error(exc, path) from None
        ident = (st.st_dev, st.st_ino)
        if ident in ancestors:
            raise QuietError(f"{path} is a symlink loop (it leads back to a parent): "
                             "remove the link", ExitCode.BAD_INPUT)
        ancestors = ancestors | {ident}
        for entry in entries:
            key = f"{rel}/{entry.name}" if rel else entry.name
            try:
                key.encode("utf-8")
            except UnicodeEncodeError:
                raise QuietError(
                    f"{os.fsencode(os.path.join(self.root, key))!r} is not a UTF-8 name: "
                    "rename it", ExitCode.BAD_INPUT) from None
            try:
                est = entry.stat(follow_symlinks=True)
            except OSError as exc:
                raise os_error(exc, entry.path) from None
            if entry.is_dir(follow_symlinks=True):
                yield from self._walk(key, ancestors)
            elif entry.is_file(follow_symlinks=True):
                yield ObjectInfo(key, est.st_size)

    def stat(self, key: str) -> ObjectInfo:
        path = self._path(key)
        try:
            with acting_as(self.read_as):
                fd = open_regular(path)
        except OSError as exc:
            raise os_error(exc, path) from None
        try:
            return ObjectInfo(key, os.fstat(fd).st_size)
        finally:
            os.close(fd)

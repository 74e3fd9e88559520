"""The storage backend interface: read an object (or a byte range of it), list, stat."""
from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator
from typing import BinaryIO

from quiverfs.fs_identity import UserIdentity

# Seconds an item's read from a bucket may take in all, retries included. A GCS bucket
# serves an item of tens of megabytes in about a second and answers a retried error
# within a few; past this, a reader is better served an error than kept waiting on a
# source that trickles (mountd's --fetch-deadline sets it).
FETCH_DEADLINE = 30.0


@dataclasses.dataclass(frozen=True)
class ObjectInfo:
    """One object under a backend's root: its key (relative, '/'-separated) and size."""

    key: str
    size: int


@dataclasses.dataclass(frozen=True)
class StorageOptions:
    """How to reach a backend; travels with a dataset registration and never leaves it.

    ``credentials_info`` is a parsed service-account JSON; ``emulator_host`` points
    the GCS client at an emulator (``http://127.0.0.1:PORT``); ``anonymous`` asks for
    unauthenticated access (public buckets, emulators); ``read_as`` is the user whose
    file-system identity opens local files (None: the caller's own);
    ``fetch_deadline`` bounds a bucket read's seconds, retries included (the node's
    setting, not the registration's).
    """

    credentials_info: dict | None = None
    emulator_host: str | None = None
    anonymous: bool = False
    read_as: UserIdentity | None = None
    fetch_deadline: float = FETCH_DEADLINE


class Backend(abc.ABC):
    """A root of objects (a directory, or a bucket prefix) addressed by relative keys."""

    uri: str

    @abc.abstractmethod
    def read(self, key: str, offset: int = 0, length: int | None = None) -> bytes:
        """Return ``length`` bytes of object ``key`` from ``offset`` (all of it if None)."""

    @abc.abstractmethod
    def stream_into(self, key: str, sink: BinaryIO) -> int:
        """Write the whole object to ``sink`` in bounded pieces; return the bytes written."""

    @abc.abstractmethod
    def list(self) -> Iterator[ObjectInfo]:
        """Yield every object under the root (any order)."""

    @abc.abstractmethod
    def stat(self, key: str) -> ObjectInfo:
        """Return the object's info; raise QuietError(NOT_FOUND) if it does not exist."""

    def object_uri(self, key: str) -> str:
        """The full URI of ``key``, for messages and digests."""
        return f"{self.uri.rstrip('/')}/{key}"

    def abort(self) -> None:
        """End the reads in flight and refuse new ones, without blocking: a dataset
        unmounted, or mountd stopping, waits for no stalled read. The default reads
        nothing that can stall."""

    def close(self) -> None:
        """Release connections; the default has none."""


def check_key(key: str) -> str:
    """Reject keys that are absolute, empty, or climb out of the root with '..'."""
    parts = key.split("/")
    if not key or key.startswith("/") or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"invalid object key {key!r}")
    return key

"""Storage backends chosen by URI: ``file:///path`` and ``gs://bucket/prefix``."""
from __future__ import annotations

import os

from quiverfs.backends.base import Backend, ObjectInfo, StorageOptions, check_key
from quiverfs.errors import ExitCode, QuietError

__all__ = ["Backend", "ObjectInfo", "StorageOptions", "check_key", "open_backend",
           "normalize_uri"]


def normalize_uri(src: str) -> str:
    """Accept a plain path, ``file://`` or ``gs://``; return a canonical URI."""
    if src.startswith("gs://"):
        return src.rstrip("/")
    if src.startswith("file://"):
        src = src[len("file://"):]
    elif "://" in src:
        raise QuietError(f"unsupported storage URI {src!r}: use a path, file:///PATH or "
                         "gs://BUCKET/PREFIX", ExitCode.USAGE)
    return "file://" + os.path.abspath(src)


def open_backend(uri: str, options: StorageOptions | None = None) -> Backend:
    """Return the backend for ``uri`` (see normalize_uri for the accepted forms)."""
    uri = normalize_uri(uri)
    if uri.startswith("gs://"):
        from quiverfs.backends.gcs import GCSBackend  # the GCS client is slow to import

        return GCSBackend(uri, options)
    from quiverfs.backends.local import LocalBackend

    return LocalBackend(uri[len("file://"):], options.read_as if options else None)

"""How a training job and mountd talk through the mount: the names of the control area
``ROOT/.quiver``, the formats of a job's files, and the manifest of a mini-batch.

The client is ``quiverfs.torch`` (and any plain reader of a substitutable view, which
names its job with ``JOB_ENV``); the daemon side is mountd's control filesystem, its
batch planner and its views. Both import the names from here, so neither can drift.
"""
from __future__ import annotations

import re

import msgspec

CONTROL_NAME = ".quiver"  # ROOT/.quiver
JOBS_NAME = "jobs"  # ROOT/.quiver/jobs/JOB: a sampler's job
VIEWS_NAME = "views"  # ROOT/.quiver/views/NAME: a view's files, opened by hash
JOB_FILES = ("config", "report", "error", "stats", "paths", "next")  # in ROOT/.quiver/jobs/JOB
# Whole names, matched with fullmatch ('$' would also accept a trailing newline).
JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # a sampler job's directory
BATCH_NAME = re.compile(r"e(\d{1,5})-b(\d{1,7})")  # JOB/eE-bI: batch I of epoch E
# JOB/next: the batch asked for, "EPOCH BATCH"; " ahead" where the job asks while it
# still reads the batches before (an epoch's first segment may then be long)
ASK = re.compile(r"(\d{1,5}) (\d{1,7})( ahead)?")
JOB_ENV = "QUIVER_JOB"  # a view's reader names its job with this environment variable
VIEWS = ("exact", "substitutable")  # quiver mount DIGEST --view VIEW
DEFAULT_SCAN_FACTOR = 10  # how far past its next items a sampler looks for cached ones


def batch_name(epoch: int, batch: int) -> str:
    """The name of the job file that holds batch ``batch`` of ``epoch``."""
    return f"e{epoch}-b{batch}"


def ask_line(epoch: int, batch: int, ahead: bool = False) -> bytes:
    """The last line of a write to JOB/next: which batch's manifest its reads return
    (``ahead``: asked while the job still reads the batches before it)."""
    return f"{epoch} {batch}{' ahead' if ahead else ''}\n".encode()


def report_line(epoch: int, batch: int, seconds: float) -> str:
    """A line of JOB/report (or of a JOB/next write): the time the job spent on a batch."""
    return f"{epoch} {batch} {seconds:.6f}\n"


class Manifest(msgspec.Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """The manifest of one mini-batch, as mountd's batch planner made it."""

    epoch: int
    batch: int
    hits: int  # how many of its items were planned as cache hits
    paths: list[str]  # per item, relative to the job's prefix
    labels: list[str]
    hashes: list[str]  # hex SHA-256
    # where the job's items are all cached: the paths of the batches after this one,
    # planned already, in the job's order (the job asks again for the first after them)
    segment: list[list[str]] = []


class ManifestError(ValueError):
    """A manifest that is not one: the reply of a mountd from another version."""


def encode_manifest(manifest: Manifest) -> bytes:
    return msgspec.json.encode(manifest)


def decode_manifest(data: bytes) -> Manifest:
    """The manifest in ``data``; ManifestError names what is wrong with it."""
    try:
        manifest = msgspec.json.decode(data, type=Manifest)
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ManifestError(f"a malformed manifest ({exc})") from None
    n = len(manifest.paths)
    if len(manifest.labels) != n or len(manifest.hashes) != n or not 0 <= manifest.hits <= n:
        raise ManifestError(f"a malformed manifest ({n} paths, {len(manifest.labels)} "
                            f"labels, {len(manifest.hashes)} hashes, {manifest.hits} hits)")
    return manifest

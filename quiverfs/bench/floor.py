"""The floor for ``quiver bench read``: libfuse's own minimal C FUSE server on the same files.

libfuse ships ``passthrough_ll.c`` among its examples (Debian: in ``libfuse3-dev``, which
``make`` installs to build the native data plane): a low-level, multi-threaded server
that mirrors a directory, answering READ by splicing from the backing file. Built here
with the system's gcc and libfuse, mounted over a copy of the benchmark's tree with
``cache=always`` (mountd's caching: kernel entry and attribute timeouts of a day, pages
kept), it is what the kernel and libfuse cost with no cache logic at all: the floor
mountd's data plane is measured against.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator

from quiverfs.bench.processes import terminate, unmount
from quiverfs.mount_point import is_mounted

EXAMPLE = "/usr/share/doc/libfuse3-dev/examples/passthrough_ll.c"
MAX_THREADS = 64  # libfuse starts threads as requests wait, up to this (its default: 10)
MOUNT_TIMEOUT = 10.0
MISSING = (f"{EXAMPLE} is not installed (Debian: apt-get install libfuse3-dev gcc): "
           "the floor pass and its floor_* keys are left out")


def build(workdir: str) -> str | None:
    """passthrough_ll compiled into ``workdir``; its path, None where its source or
    the compiler is missing."""
    if not os.path.exists(EXAMPLE) or not shutil.which("gcc") or not shutil.which("pkg-config"):
        return None
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                           capture_output=True, text=True).stdout.split()
    binary = os.path.join(workdir, "passthrough_ll")
    subprocess.run(["gcc", "-O2", "-o", binary, EXAMPLE, *flags], check=True,
                   capture_output=True)
    return binary


@contextlib.contextmanager
def mounted(binary: str, source: str, workdir: str) -> Iterator[tuple[str, int]]:
    """``source`` mirrored by passthrough_ll at a fresh mount point (no pages of an
    earlier mount); (mount point, server pid). Unmounted and stopped on exit."""
    root = tempfile.mkdtemp(prefix="floor-", dir=workdir)
    options = f"source={source},cache=always,max_threads={MAX_THREADS}"
    proc = subprocess.Popen([binary, "-f", "-o", options, root], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + MOUNT_TIMEOUT
        while not is_mounted(root, fuse_only=True):
            if proc.poll() is not None:
                raise RuntimeError(f"passthrough_ll exited with {proc.returncode}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"passthrough_ll did not mount {root} in "
                                   f"{MOUNT_TIMEOUT:.0f} s")
            time.sleep(0.05)
        yield root, proc.pid
    finally:
        unmount(root)
        terminate(proc)
        os.rmdir(root)

"""The floor for ``quiver bench read`` and the view of ``quiver bench substitution``:
libfuse's own minimal C FUSE server on the same files.

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


# The floor for a substitutable view's files: the kernel may cache their names but not
# their attributes (a view file's size is the served item's), and not their pages
# (another job's open of the inode reads other bytes). passthrough_ll has one timeout
# for both: its replies' attribute timeouts are set to 0 here, and it is mounted with
# ``cache=never`` (direct I/O) and a day's timeout (names), as mountd's view is.
VIEW_PATCH = (("e->attr_timeout = lo->timeout;", "e->attr_timeout = 0;", 1),  # lookup
              ("e.attr_timeout = lo->timeout;", "e.attr_timeout = 0;", 1),  # mknod, link
              ("fuse_reply_attr(req, &buf, lo->timeout);", "fuse_reply_attr(req, &buf, 0);", 1))
VIEW_OPTIONS = "cache=never,timeout=86400"
EXACT_OPTIONS = "cache=always"


def build(workdir: str, view: bool = False) -> str | None:
    """passthrough_ll compiled into ``workdir`` (with ``view``, patched as VIEW_PATCH
    says); its path, None where its source or the compiler is missing."""
    if not os.path.exists(EXAMPLE) or not shutil.which("gcc") or not shutil.which("pkg-config"):
        return None
    flags = subprocess.run(["pkg-config", "--cflags", "--libs", "fuse3"], check=True,
                           capture_output=True, text=True).stdout.split()
    name = "passthrough_ll_view" if view else "passthrough_ll"
    source = EXAMPLE
    if view:
        with open(EXAMPLE, encoding="utf-8") as f:
            text = f.read()
        for old, new, count in VIEW_PATCH:
            if text.count(old) != count:
                raise RuntimeError(f"{EXAMPLE} has {text.count(old)} of {old!r}, not "
                                   f"{count}: the view floor's patch does not apply")
            text = text.replace(old, new)
        source = os.path.join(workdir, f"{name}.c")
        with open(source, "w", encoding="utf-8") as f:
            f.write(text)
    binary = os.path.join(workdir, name)
    # the example's own headers (passthrough_helpers.h) beside it
    subprocess.run(["gcc", "-O2", "-I", os.path.dirname(EXAMPLE), "-o", binary, source,
                    *flags], check=True, capture_output=True)
    return binary


@contextlib.contextmanager
def mounted(binary: str, source: str, workdir: str, caching: str = EXACT_OPTIONS
            ) -> Iterator[tuple[str, int]]:
    """``source`` mirrored by passthrough_ll at a fresh mount point (no pages of an
    earlier mount), with ``caching`` (EXACT_OPTIONS or VIEW_OPTIONS); (mount point,
    server pid). Unmounted and stopped on exit."""
    root = tempfile.mkdtemp(prefix="floor-", dir=workdir)
    options = f"source={source},{caching},max_threads={MAX_THREADS}"
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

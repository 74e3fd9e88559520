"""What is mounted where, from ``/proc/self/mounts``: shared by mountd and its harnesses."""
from __future__ import annotations

import os


def is_mounted(root: str, fuse_only: bool = False) -> bool:
    """Whether something (a FUSE filesystem, with ``fuse_only``) is mounted at ``root``;
    true for a dead FUSE mount too, which ``os.path.ismount`` cannot see."""
    root = os.path.abspath(root)
    with open("/proc/self/mounts", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            target = fields[1].replace("\\040", " ")
            if target == root and (not fuse_only or fields[2].startswith("fuse")):
                return True
    return False


def mount_device(root: str) -> str | None:
    """The ``MAJOR:MINOR`` of the filesystem mounted at ``root`` (the topmost one), from
    ``/proc/self/mountinfo``, without touching the mount itself; None if nothing is."""
    root = os.path.abspath(root)
    found = None
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if fields[4].replace("\\040", " ") == root:
                found = fields[2]
    return found

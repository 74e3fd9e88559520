"""The limits of mountd's two FUSE connections, the datasets' (``ROOT``) and
``ROOT/.quiver``'s (mountd.fs.control_mount_process), and how they are set in the kernel.

A read that waits for a fetch holds one of pyfuse3's request tasks and, where the kernel
sent it in the background (a readahead, an asynchronous direct read), one of the
connection's background requests, for as long as the fetch takes. One uid has at most
WAITING_READS_PER_UID such reads, on both connections together
(mountd.fetch.fair_share.WaitingReads); both connections are sized from that bound, so
that a user whose source stalls holds a part of what every user's requests pass
through, never all of it.
"""
from __future__ import annotations

import logging
import os
import subprocess

from mountd.fetch.fair_share import WAITING_READS_PER_UID

log = logging.getLogger(__name__)

READAHEAD_KB = 1024  # the kernel reads items up to this size in one FUSE READ
# Background requests the kernel keeps in flight to a connection: four uids' reads
# waiting for fetches. Beyond it, every user's background requests wait in the kernel's
# queue, before the daemon sees them, for whatever holds the requests in flight.
MAX_BACKGROUND = 4 * WAITING_READS_PER_UID
# FUSE requests a connection's process handles at once: every background request, and
# room beside them for the foreground ones (lookups, opens, and reads the kernel waits
# for, which every read of ROOT/.quiver's direct-I/O files is). Idle tasks end.
FUSE_TASKS = MAX_BACKGROUND + 256
FUSECTL = "/sys/fs/fuse/connections"  # the FUSE control filesystem


def tune_connection(device: str, readahead_kb: int | None = None) -> None:
    """As root, once the connection's INIT is answered (its reply can only lower
    these): let the kernel keep MAX_BACKGROUND background requests in flight to the
    mount with ``device`` (``MAJOR:MINOR``), and read up to ``readahead_kb`` in one FUSE
    READ where given. The kernel's defaults (12, and 128 KiB) would let a user whose
    reads wait for a slow source hold every background request, and make many
    concurrent readers read a page per request. A setting that cannot be written is
    logged and kept. Blocking."""
    settings = {}
    if readahead_kb is not None:
        settings[f"/sys/class/bdi/{device}/read_ahead_kb"] = readahead_kb
    _mount_fusectl()
    connection = f"{FUSECTL}/{device.split(':')[1]}"
    settings[f"{connection}/max_background"] = MAX_BACKGROUND
    settings[f"{connection}/congestion_threshold"] = MAX_BACKGROUND * 3 // 4
    for path, value in settings.items():
        try:
            with open(path, "w", encoding="ascii") as f:
                f.write(str(value))
        except OSError as exc:
            log.info("kept the kernel's %s (%s)", path, exc.strerror or exc)


def _mount_fusectl() -> None:
    """Mount the FUSE control filesystem, which holds each connection's settings, where
    nothing has (systemd does at boot; a container or a minimal VM may not)."""
    if os.path.ismount(FUSECTL) or not os.path.isdir(FUSECTL):
        return
    try:
        done = subprocess.run(["mount", "-t", "fusectl", "fusectl", FUSECTL],
                              capture_output=True, text=True, check=False)
    except OSError as exc:  # no mount(8) on this system
        log.info("cannot mount %s: %s", FUSECTL, exc.strerror or exc)
        return
    if done.returncode != 0:
        log.info("cannot mount %s: %s", FUSECTL, done.stderr.strip() or done.returncode)

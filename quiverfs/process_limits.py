"""Resource limits a daemon sets for itself at start."""
from __future__ import annotations

import ctypes
import logging
import resource

log = logging.getLogger(__name__)

# Descriptors a daemon asks for: connection caps keep its sockets far below this, so
# the store and backends always have descriptors in reserve.
WANTED_OPEN_FILES = 65536
# Blocks of at least this many bytes get pages of their own, which free() returns.
LARGE_BLOCK = 1 << 20
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter for that size


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files towards WANTED_OPEN_FILES (never above the
    hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard,
                                                                          WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        log.debug("open files limit raised from %d to %d", soft, wanted)


def return_large_blocks() -> None:
    """Make glibc give blocks of LARGE_BLOCK bytes or more pages of their own, returned to
    the system when freed. Left to itself, glibc raises that threshold to the largest
    block freed so far (up to 32 MiB), and the heap's trim threshold to twice that: after
    one large control request, the next ones' frames and copies come from the heap and
    stay there once freed (54 MB for a 25 MB digest registered again). Setting it fixes
    both thresholds. Elsewhere than glibc, nothing is changed."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    if not mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK):
        log.debug("mallopt(M_MMAP_THRESHOLD) refused: glibc keeps its own thresholds")

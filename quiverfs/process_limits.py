"""Resource limits a daemon sets for itself at start."""
from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

# Descriptors a daemon asks for: connection caps keep its sockets far below this, so
# the store and backends always have descriptors in reserve.
WANTED_OPEN_FILES = 65536


def raise_open_file_limit() -> None:
    """Raise the soft limit on open files towards WANTED_OPEN_FILES (never above the
    hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = WANTED_OPEN_FILES if hard == resource.RLIM_INFINITY else min(hard,
                                                                          WANTED_OPEN_FILES)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        log.debug("open files limit raised from %d to %d", soft, wanted)

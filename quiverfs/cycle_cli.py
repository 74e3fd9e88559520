"""Command-line options of the chunk cycle and probing, shared by ``quiver coordinator``
and ``quiver mountd`` (whose coordinator runs embedded without ``--coordinator``)."""
from __future__ import annotations

import argparse

from quiverfs.chunk_cycle import FORCE_EVICT_AFTER
from quiverfs.heartbeat import PROBE_BATCHES


def add_cycle_options(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                      applies: str = "") -> None:
    """``--force-evict-after`` and ``--probe-batches``; ``applies`` says when they do."""
    p.add_argument("--force-evict-after", type=float, default=FORCE_EVICT_AFTER,
                   help=f"seconds a marked chunk may outlive its first release{applies} "
                   "(default %(default)s)")
    p.add_argument("--probe-batches", type=int, default=PROBE_BATCHES,
                   help=f"mini-batches a job runs without cache hits when probed{applies} "
                   "(default %(default)s)")

"""Command-line options of the chunk cycle and probing, shared by ``quiver coordinator``
and ``quiver mountd`` (whose coordinator runs embedded without ``--coordinator``)."""
from __future__ import annotations

import argparse

from quiverfs.chunk_cycle import FORCE_EVICT_AFTER
from quiverfs.heartbeat import PROBE_BATCHES
from quiverfs.option_types import FloatAtLeast, IntAtLeast


def add_cycle_options(p: argparse.ArgumentParser | argparse._ArgumentGroup,
                      applies: str = "", min_probe_batches: int = 0) -> None:
    """``--force-evict-after`` and ``--probe-batches``; ``applies`` says when they do,
    ``min_probe_batches`` whether 0 (no probing) is allowed."""
    p.add_argument("--force-evict-after", type=FloatAtLeast("--force-evict-after", 0),
                   default=FORCE_EVICT_AFTER,
                   help=f"seconds a marked chunk may outlive its first release{applies} "
                   "(default %(default)s)")
    p.add_argument("--probe-batches", type=IntAtLeast("--probe-batches", min_probe_batches),
                   default=PROBE_BATCHES,
                   help=f"mini-batches a job runs without cache hits when probed{applies} "
                   f"(default %(default)s{'; 0: never probe' if not min_probe_batches else ''})")

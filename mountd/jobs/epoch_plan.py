"""One job's epoch as its batch planner holds it (``mountd.jobs.planner``)."""
from __future__ import annotations

import dataclasses
from typing import Any

from mountd.jobs.substitution import Batch, EpochSampler
from quiverfs.chunk_cycle import EpochRef


@dataclasses.dataclass(eq=False)
class EpochPlan:
    """The sampler of a job's epoch, its per-chunk counts, and what was planned of it and
    not yet handed out. Only the planner changes it; the job reads it for its reports."""

    epoch: int
    sampler: EpochSampler
    ref: EpochRef
    first_segment: int  # batches the epoch's first segment hands out at most
    # batch -> its manifest; a segment's batch until a reader asks for its own
    manifests: dict[int, bytes | Batch] = dataclasses.field(default_factory=dict)
    # first batch -> (the reply handing out a segment from it, batches it covers)
    segments: dict[int, tuple[bytes, int]] = dataclasses.field(default_factory=dict)
    gave_up_on: tuple[Any, ...] | None = None  # cycle state a chunk wait timed out in

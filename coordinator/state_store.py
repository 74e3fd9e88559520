"""The coordinator's state file, ``STATE_DIR/coordinator.json``: its JSON form, reading it
back at a start (older forms included) and writing it atomically.

Everything but the nodes' reports is saved, with how long each node and dataset had
been silent (seconds the coordinator ran since it last heard from or of it,
``run_clock``), so a restart revives no node that was dead, and goes on counting those
silences where they were: the time it was down counts for none.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Iterable
from typing import Any

from coordinator.state_records import DatasetState, Node
from quiverfs.chunk_cycle import ChunkCycle
from quiverfs.digest import write_atomic
from quiverfs.errors import ExitCode, QuietError
from quiverfs.heartbeat import CacheMode

log = logging.getLogger(__name__)

TIMELINE_KEEP = 5000  # chunk-state events kept per dataset


class StateCorrupted(QuietError):
    """The state file cannot be read back: not JSON, or not the shape this writes."""

    def __init__(self, path: str, exc: Exception) -> None:
        super().__init__(f"coordinator state {path} is corrupted ({type(exc).__name__}): "
                         "move it aside to start afresh (nodes and their datasets register "
                         "again with their next heartbeat)", ExitCode.DAEMON)
        self.path = path


@dataclasses.dataclass
class Saved:
    """What a state file holds: the membership version, the nodes and the datasets."""

    version: int
    nodes: dict[str, Node]
    datasets: dict[str, DatasetState]


class StateStore:
    """The state file in ``state_dir``, which it creates if missing."""

    def __init__(self, state_dir: str) -> None:
        try:
            os.makedirs(state_dir, exist_ok=True)
        except OSError as exc:
            raise QuietError(f"cannot create state directory {state_dir}: {exc.strerror}",
                             ExitCode.PERMISSION) from None
        self.path = os.path.join(state_dir, "coordinator.json")
        self.save_error: str | None = None  # why the last save failed, until one works

    def load(self, force_after: float, now: float) -> Saved | None:
        """What the file holds, its cycles forcing evictions after ``force_after``
        seconds and its silences ending at ``now`` (on the RunClock); None without a
        file. Raises StateCorrupted, or QuietError where the file cannot be read."""
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return None
        except OSError as exc:  # permission denied, a directory in its place, a disk error
            raise QuietError(f"cannot read coordinator state {self.path}: "
                             f"{exc.strerror or exc}", ExitCode.PERMISSION) from None
        except ValueError as exc:  # not JSON, or not UTF-8
            raise StateCorrupted(self.path, exc) from None
        try:
            return _restore(data, force_after, now)
        except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
            raise StateCorrupted(self.path, exc) from None

    def save(self, data: bytes) -> None:
        """Write ``data`` as the state file now (atomically); raises OSError or QuietError."""
        write_atomic(self.path, data)

    def write(self, data: bytes) -> None:
        """Write ``data`` as the state file, or log why not: the state lives on in
        memory, and the next change tries again (a full disk must not stop a daemon)."""
        try:
            write_atomic(self.path, data)
        except (OSError, QuietError) as exc:
            if self.save_error is None:
                log.warning("cannot save %s (%s): the state is kept in memory until a "
                            "save works", self.path, exc)
            self.save_error = str(exc)
        else:
            if self.save_error is not None:
                log.info("saved %s again", self.path)
            self.save_error = None


def encode(version: int, nodes: Iterable[Node], datasets: Iterable[DatasetState],
           now: float) -> bytes:
    """The state file's contents for this membership version, nodes and datasets, their
    silences as of ``now`` (on the RunClock)."""
    data = {"version": version,
            "nodes": [node_record(n, max(now - n.last_seen, 0.0)) for n in nodes],
            "datasets": [dataset_record(d, max(now - d.last_reported, 0.0), TIMELINE_KEEP)
                         for d in datasets]}
    return json.dumps(data).encode()


def node_record(n: Node, silent_s: float) -> dict[str, Any]:
    """One node's JSON record, silent for ``silent_s`` seconds."""
    return {"id": n.id, "peer": n.peer, "capacity": n.capacity, "silent_s": silent_s}


def dataset_record(d: DatasetState, unreported_s: float, timeline_keep: int
                   ) -> dict[str, Any]:
    """One dataset's JSON record, unreported for ``unreported_s`` seconds, with the last
    ``timeline_keep`` events of its cycle."""
    return {"identity": d.identity, "name": d.name, "unreported_s": unreported_s,
            "cycle": d.cycle.snapshot(),
            "loaders": {str(c): n for c, n in d.loaders.items()},
            "done": {str(c): sorted(n) for c, n in d.done.items()},
            "mode": d.mode.value,
            "timeline": d.cycle.timeline[-timeline_keep:]}


def _restore(data: dict, force_after: float, now: float) -> Saved:
    """What the file's JSON ``data`` holds; KeyError, TypeError, ValueError... where it
    is not the shape this writes."""
    silences = _silences(data["nodes"])
    nodes = {n["id"]: restore_node(n, silences[n["id"]], now) for n in data["nodes"]}
    datasets = {d["identity"]: restore_dataset(d, force_after, now)
                for d in data["datasets"]}
    return Saved(int(data.get("version", 0)), nodes, datasets)


def restore_node(n: dict, silent_s: float, now: float) -> Node:
    """The node of record ``n``, silent for ``silent_s`` seconds at ``now``; TypeError
    where its fields are not what ``node_record`` writes."""
    if not (isinstance(n["id"], str) and isinstance(n["peer"], str)
            and isinstance(n["capacity"], int) and not isinstance(n["capacity"], bool)):
        raise TypeError("a node record's id, peer or capacity is of the wrong type")
    return Node(n["id"], n["peer"], n["capacity"], now - silent_s)


def restore_dataset(d: dict, force_after: float, now: float) -> DatasetState:
    """The dataset of record ``d``, its cycle forcing evictions after ``force_after``
    seconds, its silence ending at ``now``; KeyError, TypeError, ValueError... where
    it is not the shape ``dataset_record`` writes."""
    cycle = ChunkCycle.restore(d["cycle"], force_after)
    cycle.timeline = [tuple(e) for e in d.get("timeline", [])]
    loaders, done = d["loaders"], d["done"]
    if isinstance(loaders, list):  # written by a two-chunk cycle: its one load
        loaders = {str(c): loaders for c in cycle.loading}
        done = {str(c): done for c in cycle.loading}
    # Written before datasets were forgotten: its time counts from this start.
    unreported = saved_silence(d.get("unreported_s", 0.0), f"dataset {d['identity']}")
    return DatasetState(
        d["identity"], d["name"], cycle,
        {int(c): list(n) for c, n in loaders.items() if int(c) in cycle.loading},
        {int(c): set(n) for c, n in done.items() if int(c) in cycle.loading},
        mode=CacheMode(d.get("mode", CacheMode.COOP)), last_reported=now - unreported)


def _silences(nodes: list[dict]) -> dict[str, float]:
    """Each saved node's silence in seconds. A file written with wall-clock last-seen
    times has them measured back from its latest (about when it was written, as it was
    written at least once a heartbeat timeout); one written before those were kept,
    an infinite silence: never heard from (a live node joins again with its next
    heartbeat)."""
    if all("silent_s" in n for n in nodes):
        return {n["id"]: saved_silence(n["silent_s"], f"node {n['id']}") for n in nodes}
    seen = {n["id"]: float(n.get("last_seen", -math.inf)) for n in nodes}
    if any(math.isnan(t) or t == math.inf for t in seen.values()):
        raise ValueError("a node's last_seen is not a time")
    latest = max(seen.values(), default=0.0)
    return {node: latest - t if math.isfinite(t) else math.inf for node, t in seen.items()}


def saved_silence(value: Any, what: str) -> float:
    """A saved silence: finite, at least 0; else ValueError (TypeError) naming ``what``."""
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what}: silence of {seconds} s")
    return seconds

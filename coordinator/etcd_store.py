"""The coordinator's state in etcd (``--etcd``), in place of its state file.

Under ``/quiver/PREFIX/``: ``version`` (the membership version), ``nodes/ID`` and
``datasets/IDENTITY``, each holding the JSON record ``coordinator.state_store`` writes
for it in the file, and ``leader`` (``coordinator.leadership``). A record is written
only when it changed, in one transaction guarded by the leader key (``Fence``): a
deposed leader's write changes nothing. Silences are saved as 0 while within a heartbeat
timeout and rounded up to whole timeouts past it, so a live node's record is not
rewritten at each heartbeat, a dead one's once a timeout, and a node live when saved is
live when restored (it gets a full timeout) while a dead one stays dead.
"""
from __future__ import annotations

import json
import logging
import math
from typing import Any

from coordinator import state_store
from coordinator.etcd_client import EtcdClient, Fence, KeyValue
from coordinator.state import CoordinatorState
from coordinator.state_store import Saved

TIMELINE_KEEP = 200  # chunk-state events kept per dataset (what ``status`` shows)
MAX_OPS = 100  # keys per transaction: etcd refuses more than 128 by default
# Bytes of values per transaction, and of one record: etcd refuses a request over 1.5 MiB
# by default (--max-request-bytes), and a refused record must not hold back the others.
MAX_BYTES = 1 << 20
RESTORE_ERRORS = (KeyError, TypeError, ValueError, IndexError, AttributeError)

log = logging.getLogger(__name__)


class MalformedKey(Exception):
    """A key under the prefix whose value is not what this coordinator writes."""

    def __init__(self, key: str, why: str) -> None:
        super().__init__(f"etcd key {key} is malformed ({why}): this coordinator will "
                         "not lead on state it cannot read; fix or delete the key "
                         f"(etcdctl del {key})")
        self.key = key


class EtcdState:
    """The state's keys in etcd, and what this coordinator last wrote to each."""

    def __init__(self, client: EtcdClient, prefix: str, heartbeat_timeout: float) -> None:
        self.client = client
        self.root = f"/quiver/{prefix}/"
        self.leader_key = self.root + "leader"
        self.heartbeat_timeout = heartbeat_timeout
        self.written: dict[str, bytes] = {}  # key -> value, as etcd holds it
        self.transactions = 0  # writes that etcd applied
        self.keys_written = 0  # keys put or deleted by them
        self.bytes_written = 0  # the values they put
        self._oversize: set[str] = set()  # records too large for etcd, logged once each

    def fetch(self) -> list[KeyValue]:
        """Every key under the prefix (blocking)."""
        return self.client.get_prefix(self.root)

    def restore(self, kvs: list[KeyValue], force_after: float, now: float) -> Saved:
        """The state ``kvs`` hold, restored at ``now``; raises MalformedKey naming the
        first key it cannot read. What they hold is then taken as written."""
        saved = Saved(0, {}, {})
        written = {}
        for kv in sorted(kvs, key=lambda kv: kv.key):
            name = kv.key[len(self.root):]
            kind, _, ident = name.partition("/")
            if name != "version" and (kind not in ("nodes", "datasets") or not ident):
                continue  # the leader key, or none of ours: never written here
            try:
                record = json.loads(kv.value)
                if name == "version":
                    saved.version = _integer(record["version"])
                elif kind == "nodes":
                    node = state_store.restore_node(
                        record, state_store.saved_silence(record["silent_s"], name), now)
                    _same(node.id, ident)
                    saved.nodes[ident] = node
                else:
                    dataset = state_store.restore_dataset(record, force_after, now)
                    _same(dataset.identity, ident)
                    saved.datasets[ident] = dataset
            except RESTORE_ERRORS as exc:
                raise MalformedKey(kv.key, f"{type(exc).__name__}: {exc}") from None
            written[kv.key] = kv.value
        self.written = written
        return saved

    def diff(self, state: CoordinatorState, now: float) -> tuple[dict[str, bytes], list[str]]:
        """The keys to put (their values) and to delete for etcd to hold ``state``."""
        records = {self.root + "version": _encode({"version": state.version})}
        for n in state.nodes.values():
            records[f"{self.root}nodes/{n.id}"] = _encode(state_store.node_record(
                n, self._rounded(now - n.last_seen)))
        for d in state.datasets.values():
            key = f"{self.root}datasets/{d.identity}"
            record = _encode(state_store.dataset_record(
                d, self._rounded(now - d.last_reported), TIMELINE_KEEP))
            if len(record) <= MAX_BYTES:
                records[key] = record
                self._oversize.discard(key)
            elif key not in self._oversize:
                # Not saved, and an older record deleted: a new leader starts this
                # cycle afresh rather than going back to where it once was.
                self._oversize.add(key)
                log.warning("dataset %s: its state (%d bytes, %d chunks) is over %d bytes: "
                            "not kept in etcd, a new leader starts its chunk cycle afresh",
                            d.name, len(record), d.cycle.n_chunks, MAX_BYTES)
        puts = {k: v for k, v in records.items() if self.written.get(k) != v}
        return puts, [k for k in self.written if k not in records]

    def write(self, fence: Fence, puts: dict[str, bytes], deletes: list[str]) -> bool:
        """Apply ``puts`` and ``deletes`` in transactions guarded by ``fence`` (blocking);
        False where the fence no longer holds: nothing more is written. Raises
        EtcdUnavailable."""
        ops: list[tuple[str, bytes | None]] = [*puts.items(), *((k, None) for k in deletes)]
        for batch in _batches(ops):
            if not self.client.fenced(fence, {k: v for k, v in batch if v is not None},
                                      [k for k, v in batch if v is None]):
                return False
            self.transactions += 1
            self.keys_written += len(batch)
            self.bytes_written += sum(len(v) for _, v in batch if v is not None)
            for key, value in batch:
                if value is None:
                    self.written.pop(key, None)
                else:
                    self.written[key] = value
        return True

    def _rounded(self, silence: float) -> float:
        """A silence as saved: 0 within a heartbeat timeout, else whole timeouts up."""
        timeout = self.heartbeat_timeout
        return 0.0 if silence <= timeout else math.ceil(silence / timeout) * timeout


def _batches(ops: list[tuple[str, bytes | None]]) -> list[list[tuple[str, bytes | None]]]:
    """``ops`` cut into transactions of at most MAX_OPS keys and about MAX_BYTES."""
    batches: list[list[tuple[str, bytes | None]]] = [[]]
    size = 0
    for key, value in ops:
        n = len(key) + len(value or b"")
        if batches[-1] and (len(batches[-1]) == MAX_OPS or size + n > MAX_BYTES):
            batches.append([])
            size = 0
        batches[-1].append((key, value))
        size += n
    return batches


def _encode(record: dict[str, Any]) -> bytes:
    return json.dumps(record, sort_keys=True, separators=(",", ":")).encode()


def _integer(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"not a count: {value!r}")
    return value


def _same(recorded: str, ident: str) -> None:
    if recorded != ident:
        raise ValueError(f"the record is of {recorded!r}, not of {ident!r}")

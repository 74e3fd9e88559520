"""Substitutable sampling (paper §4.7, Algorithm 1): one rank's epoch, exactly once.

The rank's shard is visited in a seeded random order. For each mini-batch the
sampler scans ahead (10x the batch size by default, more when few items are cached)
for items that are cached and not yet consumed, fills the batch with those hits and
leaves the misses pending for a later pass. When the scan finds too few hits it
picks a random subset of pending items for the caller to fetch (cooperative miss
handling: other jobs then hit them). Every item of the shard is placed in exactly
one batch of the epoch, whatever the cache does in between.

Given the chunk of every item, a batch can take its hits from one chunk first (the
oldest resident one): the jobs then finish a chunk before the next, so it can be
evicted and the next one loaded while they read the other, which is what double
buffering needs.

When the cache holds everything, nothing needs substituting: ``place_in_order`` places
the next batches of pending items in the visiting order itself (a segment of exact
batches), and the epoch stays exactly once whichever way each batch was planned.
"""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Generator
from typing import TypeVar

import numpy as np

from quiverfs.job_protocol import DEFAULT_SCAN_FACTOR

T = TypeVar("T")
# A planning step: yields candidate items, is sent which may be hits, returns a T.
Planning = Generator[np.ndarray, np.ndarray, T]

SCAN_BLOCK = 256  # items whose cache state is asked for at once
PROBE_SCAN = 4  # blocks a probe batch looks through for items that are not cached
EWMA = 0.2  # weight of the newest scan in the hit-rate estimate


def epoch_shard(universe: np.ndarray, seed: int, epoch: int, rank: int,
                world_size: int) -> np.ndarray:
    """The rank's items for an epoch, in visiting order: disjoint across ranks, their
    union is the universe (like DistributedSampler without padding)."""
    rng = np.random.default_rng([seed, epoch])
    return universe[rng.permutation(len(universe))][rank::world_size]


@dataclasses.dataclass
class Batch:
    """A planned mini-batch: cached items, and items the caller must fetch first."""

    index: int
    hits: list[int]
    fetch: list[int]

    @property
    def items(self) -> list[int]:
        return self.hits + self.fetch


class EpochSampler:
    """One rank's epoch: plans batches in order, each item exactly once."""

    def __init__(self, order: np.ndarray, batch_size: int, seed: int,
                 scan_factor: int = DEFAULT_SCAN_FACTOR,
                 chunk_of: np.ndarray | None = None) -> None:
        if batch_size < 1:
            raise ValueError("batch size must be at least 1")
        self.order = order  # item indices in visiting order
        self.batch_size = batch_size
        self.scan_factor = scan_factor
        self.n_batches = math.ceil(len(order) / batch_size)
        self._consumed = np.zeros(len(order), dtype=bool)
        self._pass = np.arange(len(order))  # positions of this pass, in order
        self._cursor = 0
        self._remaining = len(order)
        self._rng = np.random.default_rng([seed, len(order), 7])
        self._hit_rate = 1.0
        self.planned = 0  # batches planned so far
        self.hits = 0
        self.fetched = 0
        self._head = 0  # no position before it is pending
        # Whether the last batch planned was all hits, found in a row (no miss passed
        # over, none to fetch): then the items after it are likely cached too.
        self.all_hits = True
        if chunk_of is not None:  # positions grouped by chunk, in visiting order
            chunks = chunk_of[order]
            self._by_chunk = np.argsort(chunks, kind="stable")
            self._chunk_start = np.searchsorted(chunks[self._by_chunk],
                                                np.arange(int(chunk_of.max(initial=0)) + 2))
            self._chunk_cursor = self._chunk_start[:-1].copy()  # first maybe-pending one

    @property
    def remaining(self) -> int:
        return self._remaining

    def remaining_items(self) -> np.ndarray:
        """Items of the shard not yet placed in a batch."""
        return self.order[~self._consumed]

    def _scan_budget(self, need: int) -> int:
        adaptive = math.ceil(1.5 * need / max(self._hit_rate, 0.01))
        return min(self._remaining, max(self.scan_factor * self.batch_size, adaptive))

    def _block(self, want: int, left: int) -> int:
        """How many items to ask about for ``want`` more hits, at the recent hit rate (a
        look-up costs: a fully cached dataset should not pay for SCAN_BLOCK of them)."""
        return min(SCAN_BLOCK, left, math.ceil(1.5 * want / max(self._hit_rate, 0.01)))

    def _next_block(self, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """Up to ``limit`` pass indices from the cursor (never across passes) and their
        unconsumed positions; starts a new pass over the pending items at the end."""
        if self._cursor >= len(self._pass):
            self._pass = np.flatnonzero(~self._consumed)
            self._cursor = 0
        idx = np.arange(self._cursor, min(len(self._pass), self._cursor + limit))
        idx = idx[~self._consumed[self._pass[idx]]]
        return idx, self._pass[idx]

    def _pending_positions(self, n: int) -> np.ndarray:
        """Positions of the first ``n`` pending items in visiting order (fewer at the
        end of the epoch)."""
        found: list[np.ndarray] = []
        got, start = 0, self._head
        while got < n and start < len(self.order):
            stop = min(len(self.order), start + max(2 * (n - got), SCAN_BLOCK))
            free = np.flatnonzero(~self._consumed[start:stop])[:n - got] + start
            found.append(free)
            got += len(free)
            start = stop
        positions = np.concatenate(found) if found else np.zeros(0, dtype=np.int64)
        self._head = int(positions[0]) if len(positions) else start
        return positions

    def pending_in_order(self, n: int) -> np.ndarray:
        """The first ``n`` pending items in visiting order (fewer at the end of the
        epoch), not placed."""
        return self.order[self._pending_positions(n)]

    def place_in_order(self, n_batches: int) -> list[Batch]:
        """Place the next ``n_batches`` batches of pending items in visiting order, all
        as hits (the caller found them cached): no substitution."""
        if self.planned + n_batches > self.n_batches:
            raise IndexError(f"the epoch has {self.n_batches - self.planned} batches left")
        size = self.batch_size
        positions = self._pending_positions(min(n_batches * size, self._remaining))
        self._consumed[positions] = True
        if len(positions):
            self._head = int(positions[-1]) + 1
        items = self.order[positions].tolist()
        self.hits += len(items)
        self.all_hits = True
        return [self._placed(len(hits), hits, [])
                for hits in (items[k:k + size] for k in range(0, len(items), size))]

    def pending_in(self, chunk: int) -> np.ndarray:
        """Items of ``chunk`` not yet placed (the sampler must have been given
        ``chunk_of``)."""
        positions = self._by_chunk[self._chunk_start[chunk]:self._chunk_start[chunk + 1]]
        return self.order[positions[~self._consumed[positions]]]

    def _hits_from_chunk(self, chunk: int, need: int, budget: int) -> Planning[list[int]]:
        """Up to ``need`` cached pending items of ``chunk`` in visiting order, scanning at
        most ``budget`` of its pending items; marked consumed."""
        end = int(self._chunk_start[chunk + 1])
        cur = int(self._chunk_cursor[chunk])
        while cur < end and self._consumed[self._by_chunk[cur]]:
            cur += 1
        self._chunk_cursor[chunk] = cur
        hits: list[int] = []
        while len(hits) < need and cur < end and budget > 0:
            block = self._by_chunk[cur:min(end, cur + self._block(need - len(hits), budget))]
            cur += len(block)
            positions = block[~self._consumed[block]]
            budget -= len(positions)
            if not len(positions):
                continue
            cached = np.asarray((yield self.order[positions]), dtype=bool)
            taken = positions[np.flatnonzero(cached)[:need - len(hits)]]
            self._consumed[taken] = True
            hits.extend(self.order[taken].tolist())
        return hits

    def planning(self, prefer: Callable[[np.ndarray], np.ndarray] | None = None,
                 first_chunk: int | None = None, probe: bool = False) -> Planning[Batch]:
        """Plan the next batch, as a generator: it yields blocks of candidate items and
        is sent back which of them may be served as hits (cached, or held by their
        owner); it returns the Batch. The caller asks the store in between, so no
        thread waits on another while it does. ``prefer(items)`` ranks misses, higher
        fetched first (the chunk being loaded before the rest); hits come from
        ``first_chunk`` first (the sampler must have been given ``chunk_of``).

        A ``probe`` batch takes no hits: its ``fetch`` items are pending items that are
        not cached, ``prefer`` ranks first (misses the cache needs anyway, which other
        jobs then hit), and only where too few of those turn up, its ``hits`` are other
        pending items, cached or not looked up, to be read as misses all the same."""
        if not self._remaining:
            raise IndexError("the epoch has no more batches")
        need = min(self.batch_size, self._remaining)
        self.all_hits = False
        if probe:
            fetch, forced = yield from self._probe_misses(need, prefer)
            return self._placed(need, forced, fetch)
        budget = self._scan_budget(need)
        hits: list[int] = []
        if first_chunk is not None:
            hits = yield from self._hits_from_chunk(first_chunk, need, budget)
        scanned = passed = 0
        while len(hits) < need and scanned < budget:
            idx, positions = self._next_block(self._block(need - len(hits), budget - scanned))
            if not len(idx):
                self._cursor = len(self._pass)  # this pass is used up
                continue
            cached = np.asarray((yield self.order[positions]), dtype=bool)
            hit_at = np.flatnonzero(cached)[:need - len(hits)]
            if len(hit_at) == need - len(hits) and len(hit_at):
                used = hit_at[-1] + 1  # stop right after the last hit taken
            else:
                used = len(idx)
            self._cursor = int(idx[used - 1]) + 1
            scanned += used
            passed += used - len(hit_at)
            self._consumed[positions[hit_at]] = True
            hits.extend(self.order[positions[hit_at]].tolist())
        if scanned:
            self._hit_rate = (1 - EWMA) * self._hit_rate + EWMA * (len(hits) / scanned)
        fetch = self._choose_misses(need - len(hits), prefer)
        self.hits += len(hits)
        self.all_hits = not passed and not fetch
        return self._placed(need, hits, fetch)

    def _placed(self, need: int, hits: list[int], fetch: list[int]) -> Batch:
        self._remaining -= need
        batch = Batch(self.planned, hits, fetch)
        self.planned += 1
        self.fetched += len(fetch)
        return batch

    def _probe_misses(self, n: int, prefer: Callable[[np.ndarray], np.ndarray] | None
                      ) -> Planning[tuple[list[int], list[int]]]:
        """``n`` pending items for a probe batch, higher ``prefer`` ranks first: those
        not cached among the first PROBE_SCAN blocks, then the others in rank order;
        marked consumed."""
        pending = self._ranked_pending(prefer)
        uncached: list[int] = []
        scanned = 0
        while len(uncached) < n and scanned < min(len(pending), PROBE_SCAN * SCAN_BLOCK):
            block = pending[scanned:scanned + SCAN_BLOCK]
            scanned += len(block)
            cached = np.asarray((yield self.order[block]), dtype=bool)
            uncached.extend(block[~cached][:n - len(uncached)].tolist())
        taken = set(uncached)
        others = [int(p) for p in pending[:n + len(taken)] if int(p) not in taken]
        others = others[:n - len(uncached)]
        self._consumed[uncached + others] = True
        return self.order[uncached].tolist(), self.order[others].tolist()

    def plan(self, is_cached: Callable[[np.ndarray], np.ndarray],
             prefer: Callable[[np.ndarray], np.ndarray] | None = None,
             first_chunk: int | None = None) -> Batch:
        """``planning`` driven to its end with ``is_cached(items)`` answering each block."""
        steps = self.planning(prefer, first_chunk)
        items, batch = advance(steps, None)
        while batch is None:
            items, batch = advance(steps, is_cached(items))
        return batch

    def _choose_misses(self, n: int, prefer: Callable[[np.ndarray], np.ndarray] | None
                       ) -> list[int]:
        """A random subset of pending items, higher ``prefer`` ranks first; marked
        consumed."""
        if n <= 0:
            return []
        chosen = self._ranked_pending(prefer)[:n]
        self._consumed[chosen] = True
        return self.order[chosen].tolist()

    def _ranked_pending(self, prefer: Callable[[np.ndarray], np.ndarray] | None
                        ) -> np.ndarray:
        """Positions of the pending items in random order, higher ``prefer`` ranks
        first."""
        pending = np.flatnonzero(~self._consumed)
        self._rng.shuffle(pending)
        if prefer is not None:
            rank = np.asarray(prefer(self.order[pending]), dtype=np.int64)
            pending = pending[np.argsort(-rank, kind="stable")]
        return pending


def advance(steps: Planning[T], answer: np.ndarray | None
            ) -> tuple[np.ndarray | None, T | None]:
    """Run a planning generator one step: send ``answer`` (None to start it); either the
    next items it asks about (and None), or None and its result."""
    try:
        items = next(steps) if answer is None else steps.send(answer)
    except StopIteration as done:
        return None, done.value
    return items, None

"""The memory registrations take, estimated before anything is built, and its limits.

What a registration holds is one shared copy per digest identity (mountd.datasets.shared_digests):
the decoded digest (its file's bytes, which its columns are views of, and the arrays
decoded from them), the dataset's tree, and for a substitutable view the view's pools.
Their bytes are estimated from the decoded digest alone (``digest_cost``), by a formula
whose constants were measured with tracemalloc (docs/security.md, "Memory").

Charging: a copy is charged once to each uid that has a registration using it, however
many it has, and once to the total of all users; its pools likewise, to the uids with a
substitutable registration of it. Root is not held to the per-uid limit (root is
trusted), but its registrations count toward the total, which binds everyone.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Iterable

import numpy as np

from mountd.datasets.registry import Registration
from quiverfs.digest import Digest
from quiverfs.errors import ExitCode, QuietError
from quiverfs.sizes import human

TOTAL_SHARE_DEFAULT = 4  # the total defaults to physical memory over this
# Bytes of one copy beyond the digest file and its arrays, by what it holds (measured
# figures: docs/security.md, "Memory"). The tree holds, per entry, its name, its slots
# in lists, its entry in its directory's dict and sorted list, and its node number; per
# directory, a dict and a list of its own and its entry in its parent's. Names are
# charged at the bytes of the digest's paths, four times over where some name is not
# ASCII (a str stores every character at its widest one's width), with a wider header.
ENTRY_BYTES = 256
DIR_BYTES = 500
WIDE_NODE_BYTES = 32
COPY_BYTES = 16 << 10  # objects of a copy whatever its size
# A view's pools, per item (about 29 B measured, with 200,000 items in 100 pools): its
# pool number (4), its place among its pool's members (8), whether its pool has others
# (1), its pool's bound (8) if alone, its place by hash and its hash's first 8 bytes (16).
POOL_ITEM_BYTES = 40


@dataclasses.dataclass(frozen=True)
class DigestCost:
    """Bytes a shared copy holds: the digest and its tree; a substitutable view's pools."""

    digest: int
    pools: int


def digest_cost(digest: Digest) -> DigestCost:
    """The estimated bytes of a decoded ``digest`` with its tree and pools; cheap next to
    building them (a pass over its labels and paths at C speed)."""
    arrays = [digest.sizes, digest.path_offsets, digest.label_index]
    if digest.loc_keys is not None:
        arrays.append(digest.loc_keys[0])
    if digest.loc_offsets is not None:
        arrays.append(digest.loc_offsets)
    decoded = (len(digest.data) + sum(a.itemsize * len(a) for a in arrays)
               + sum(map(sys.getsizeof, digest.labels)) + 8 * len(digest.labels))
    paths = np.frombuffer(digest.paths_blob, dtype=np.uint8)
    wide = bool(len(paths)) and int(paths.max()) >= 0x80
    nodes = len(digest) + digest.n_dirs
    tree = (ENTRY_BYTES * len(digest) + DIR_BYTES * digest.n_dirs
            + (4 if wide else 1) * len(paths) + (WIDE_NODE_BYTES * nodes if wide else 0))
    return DigestCost(digest=COPY_BYTES + decoded + tree,
                      pools=POOL_ITEM_BYTES * len(digest))


@dataclasses.dataclass(frozen=True)
class MemoryLimits:
    """Bytes that the shared copies of one uid's registrations, and of all users', may
    take (``quiver mountd --memory-per-user`` and ``--memory-total``)."""

    per_uid: int
    total: int


def default_total() -> int:
    """The default total: a quarter of physical memory (training jobs need the rest)."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // TOTAL_SHARE_DEFAULT


@dataclasses.dataclass(frozen=True)
class Held:
    """One registration as the budget sees it: who holds which copy, and its cost."""

    uid: int
    identity: str
    substitutable: bool
    cost: DigestCost

    @classmethod
    def of(cls, reg: Registration, cost: DigestCost) -> Held:
        return cls(reg.uid, reg.identity, reg.view == "substitutable", cost)


def charged(held: Iterable[Held], uid: int | None = None) -> int:
    """Bytes charged for ``held`` (those of ``uid`` only, if given): each copy once."""
    parts: dict[tuple[str, str], int] = {}
    for h in held:
        if uid is None or h.uid == uid:
            parts[(h.identity, "digest")] = h.cost.digest
            if h.substitutable:
                parts[(h.identity, "pools")] = h.cost.pools
    return sum(parts.values())


class MemoryBudget:
    """Refuses, before anything is built, what would take a uid or everyone past a limit."""

    def __init__(self, limits: MemoryLimits) -> None:
        self.limits = limits

    def check(self, held: list[Held], new: Held) -> None:
        """Refuse ``new`` (QuietError, exit PERMISSION) if adding it to ``held`` would take
        its uid (unless root) or the total past its limit."""
        if new.uid != 0:
            before, after = charged(held, new.uid), charged([*held, new], new.uid)
            if after > self.limits.per_uid:
                raise QuietError(
                    f"uid {new.uid}'s registrations would take {human(after)} of mountd's "
                    f"memory, over the {human(self.limits.per_uid)} each user may use "
                    f"({human(before)} in use, this digest {human(after - before)}): "
                    "'quiver umount' a dataset first, or ask root to raise "
                    "--memory-per-user", ExitCode.PERMISSION)
        before, after = charged(held), charged([*held, new])
        self._check_total(before, after - before, "this digest")

    def check_decode(self, held: list[Held], peak: int) -> None:
        """Refuse to decode a digest whose decoding may need more than the total leaves
        (decodes run one at a time; what they allocate is freed or charged after)."""
        self._check_total(charged(held), peak, "decoding this digest")

    def _check_total(self, before: int, adding: int, what: str) -> None:
        if before + adding > self.limits.total:
            raise QuietError(
                f"all users' registrations would take {human(before + adding)} of mountd's "
                f"memory, over its {human(self.limits.total)} limit ({human(before)} in "
                f"use, {what} {human(adding)}): 'quiver umount' a dataset first, or ask "
                "root to raise --memory-total", ExitCode.PERMISSION)

    def status(self, held: list[Held], uid: int) -> dict[str, int | None]:
        """The limits and the bytes in use, for ``uid`` and in total (for 'quiver status')."""
        return {"uid": uid, "uid_in_use": charged(held, uid),
                "per_uid_limit": None if uid == 0 else self.limits.per_uid,
                "in_use": charged(held), "total_limit": self.limits.total}

"""``quiver digest diff``: what changed between two digests, by path and by content."""
from __future__ import annotations

import dataclasses

from quiverfs.digest import Digest


@dataclasses.dataclass
class DigestDiff:
    """Paths only in A, only in B, or in both with other content; and shared content."""

    only_a: list[str]
    only_b: list[str]
    changed: list[str]
    shared_content: int  # distinct hashes present in both (what a cache would share)

    @property
    def identical(self) -> bool:
        return not (self.only_a or self.only_b or self.changed)


def diff_digests(a: Digest, b: Digest) -> DigestDiff:
    paths_a = {a.path(i): a.hash(i) for i in range(len(a))}
    paths_b = {b.path(i): b.hash(i) for i in range(len(b))}
    hashes_a = set(paths_a.values())
    return DigestDiff(
        only_a=sorted(paths_a.keys() - paths_b.keys()),
        only_b=sorted(paths_b.keys() - paths_a.keys()),
        changed=sorted(p for p in paths_a.keys() & paths_b.keys() if paths_a[p] != paths_b[p]),
        shared_content=len(hashes_a & set(paths_b.values())),
    )

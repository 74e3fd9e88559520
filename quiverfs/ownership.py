"""Which node owns a content hash: rendezvous (highest-random-weight) hashing.

Every node that knows the same live members computes the same owner, and when a
member joins or leaves only the keys it gains or loses move.
"""
from __future__ import annotations

import hashlib


def owner(digest: bytes, nodes: list[str]) -> str:
    """The live node with the highest weight for ``digest``."""
    if not nodes:
        raise ValueError("no live nodes")
    return max(nodes, key=lambda node: hashlib.blake2b(
        digest, key=node.encode()[:64], digest_size=8).digest())


def shares(digests: list[bytes], nodes: list[str]) -> dict[str, int]:
    """How many of ``digests`` each node owns."""
    counts = dict.fromkeys(nodes, 0)
    for d in digests:
        counts[owner(d, nodes)] += 1
    return counts

"""One copy of each registered digest and what is derived from it, however many
registrations use it.

A decoded digest, its tree and its view pools never change once built, so every
registration of one identity (by any user, under any name, in either view) uses the
same objects. They are held by the mounted datasets that use them and found here
through weak references: a copy goes when the last dataset holding it does, without
a count that an error path could leave wrong.
"""
from __future__ import annotations

import weakref

from mountd.datasets.pools import ViewPools
from mountd.datasets.tree import DatasetTree
from quiverfs.digest import Digest


class SharedDigests:
    """Trees (each holding its digest) and view pools in use, by digest identity."""

    def __init__(self) -> None:
        self._trees: weakref.WeakValueDictionary[str, DatasetTree] = (
            weakref.WeakValueDictionary())
        self._pools: weakref.WeakValueDictionary[str, ViewPools] = (
            weakref.WeakValueDictionary())

    def digest(self, identity: str) -> Digest | None:
        """The copy in use of the digest with ``identity``, or None."""
        tree = self._trees.get(identity)
        return None if tree is None else tree.digest

    def find(self, data: bytes) -> Digest | None:
        """The copy in use of the digest file ``data``, or None: found without decoding
        (files of one length differ within their first 46 bytes, at their checksums)."""
        return next((t.digest for t in self._trees.values() if t.digest.data == data), None)

    def tree(self, digest: Digest) -> DatasetTree:
        """The tree of ``digest``: the copy in use, or a new one."""
        tree = self._trees.get(digest.identity)
        if tree is None:
            tree = self._trees[digest.identity] = DatasetTree(digest)
        return tree

    def pools(self, digest: Digest) -> ViewPools:
        """The view pools of ``digest``: the copy in use, or new ones."""
        pools = self._pools.get(digest.identity)
        if pools is None:
            pools = self._pools[digest.identity] = ViewPools.of(digest)
        return pools

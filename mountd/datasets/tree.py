"""A dataset's directory tree, derived from its digest (no backend calls).

Nodes are numbered locally: 0 is the dataset's root directory, directories follow,
then one node per digest entry (file node ``n_dirs + i`` is entry ``i``).
"""
from __future__ import annotations

from quiverfs.digest import Digest


class DatasetTree:
    """Directories and files of one digest, with children sorted by name."""

    def __init__(self, digest: Digest) -> None:
        self.digest = digest
        # Only the directories of files are looked up by path: a key per ancestor
        # would be quadratic in a path's depth.
        dir_of: dict[str, int] = {"": 0}
        parents: list[int] = [0]
        children: list[dict[str, int]] = [{}]
        file_parent: list[int] = []
        file_names: list[str] = []
        for i in range(len(digest)):
            path = digest.path(i)
            dirname, _, name = path.rpartition("/")
            parent = dir_of.get(dirname)
            if parent is None:
                parent = dir_of[dirname] = self._make_dirs(dirname, parents, children)
            file_parent.append(parent)
            file_names.append(name)
        self.n_dirs = len(parents)
        for i, (parent, name) in enumerate(zip(file_parent, file_names)):
            children[parent][name] = self.n_dirs + i
        self.parents = parents
        self.file_parent = file_parent
        self.children = children
        self.sorted_children = [sorted(c.items()) for c in children]

    @staticmethod
    def _make_dirs(dirname: str, parents: list[int], children: list[dict[str, int]]) -> int:
        """The node of ``dirname``, made with its missing ancestors (while directories
        are made, ``children`` holds only directories)."""
        parent = 0
        for part in dirname.split("/"):
            node = children[parent].get(part)
            if node is None:
                node = len(parents)
                parents.append(parent)
                children.append({})
                children[parent][part] = node
            parent = node
        return parent

    @property
    def n_nodes(self) -> int:
        return self.n_dirs + len(self.digest)

    def is_dir(self, node: int) -> bool:
        return node < self.n_dirs

    def entry_index(self, node: int) -> int:
        """The digest entry of a file node."""
        return node - self.n_dirs

    def parent(self, node: int) -> int:
        return self.parents[node] if node < self.n_dirs else self.file_parent[node - self.n_dirs]

    def lookup(self, node: int, name: str) -> int | None:
        return self.children[node].get(name)

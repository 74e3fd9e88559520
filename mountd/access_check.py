"""May a given user read a local file? Checked the way the kernel checks mode bits.

mountd runs as root, so a ``file://`` registration is checked against the
registering user's uid and groups before mountd reads anything on its behalf.
(POSIX ACLs are not consulted: a file readable only through an ACL is refused.)
"""
from __future__ import annotations

import functools
import os
import stat


def _allowed(st: os.stat_result, uid: int, gids: frozenset[int], want: int) -> bool:
    """``want`` is a mask of 4 (read), 2 (write), 1 (execute) checked against st_mode."""
    if uid == 0:
        return True
    if st.st_uid == uid:
        bits = (st.st_mode >> 6) & 7
    elif st.st_gid in gids:
        bits = (st.st_mode >> 3) & 7
    else:
        bits = st.st_mode & 7
    return bits & want == want


class AccessChecker:
    """Answers "can uid/gids read this path?", caching directory verdicts."""

    def __init__(self, uid: int, gids: frozenset[int]) -> None:
        self.uid = uid
        self.gids = gids
        self._dir_ok = functools.lru_cache(maxsize=65536)(self._searchable_uncached)

    def _searchable_uncached(self, directory: str) -> bool:
        if directory == "/":
            return True
        try:
            st = os.stat(directory)
        except OSError:
            return False
        return (stat.S_ISDIR(st.st_mode) and _allowed(st, self.uid, self.gids, 1)
                and self._dir_ok(os.path.dirname(directory)))

    def can_read(self, path: str) -> bool:
        """True if the directories on the path (as written and resolved) are searchable and
        the file itself is readable."""
        if self.uid == 0:
            return True
        real = os.path.realpath(path)
        try:
            st = os.stat(real)
        except OSError:
            return False
        return (_allowed(st, self.uid, self.gids, 4)
                and self._dir_ok(os.path.dirname(os.path.abspath(path)))
                and self._dir_ok(os.path.dirname(real)))


def peer_groups(pid: int, gid: int) -> frozenset[int]:
    """The supplementary groups of a connected process (from /proc), plus its gid."""
    groups = {gid}
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Groups:"):
                    groups.update(int(g) for g in line.split()[1:])
    except OSError:
        pass
    return frozenset(groups)

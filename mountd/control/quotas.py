"""What one uid (other than root) may register: a number of datasets, bytes of digests
kept on root's disk, and nothing more once its datasets have failed too many hash
checks. Memory is bounded apart (mountd.datasets.memory_budget)."""
from __future__ import annotations

from mountd.datasets.registry import Registration
from mountd.fetch.integrity_budget import IntegrityBudget
from quiverfs.errors import ExitCode, QuietError
from quiverfs.fs_identity import UserIdentity

MAX_DATASETS_PER_USER = 64
MAX_DIGEST_BYTES_PER_USER = 2 << 30


def check_quota(user: UserIdentity, mine: list[Registration], integrity: IntegrityBudget,
                digest_bytes: int) -> None:
    """A uid's registrations are bounded in number, in digest bytes on root's disk,
    and by how many hash checks its datasets have failed."""
    if user.uid == 0:
        return
    if len(mine) >= MAX_DATASETS_PER_USER:
        raise QuietError(f"uid {user.uid} has {len(mine)} datasets mounted, the most "
                         "allowed: 'quiver umount' one first", ExitCode.PERMISSION)
    used = sum(reg.digest_bytes for reg in mine)
    if used + digest_bytes > MAX_DIGEST_BYTES_PER_USER:
        raise QuietError(f"uid {user.uid}'s digests would take {used + digest_bytes} "
                         f"bytes, over the {MAX_DIGEST_BYTES_PER_USER}-byte limit: "
                         "'quiver umount' a dataset first", ExitCode.PERMISSION)
    failures = integrity.failures[user.uid]
    if integrity.spent(user.uid):
        raise QuietError(f"uid {user.uid}'s datasets have failed {failures} hash checks "
                         "since mountd started: recreate their digests ('quiver digest "
                         "create'); new registrations are refused until mountd restarts",
                         ExitCode.PERMISSION)

"""What one uid (other than root) may register: a number of datasets, bytes of digests
kept on root's disk, and nothing more once its datasets have failed too many hash
checks. Memory is bounded apart (mountd.datasets.memory_budget)."""
from __future__ import annotations

import dataclasses

from mountd.datasets.registry import Registration
from mountd.fetch.integrity_budget import IntegrityBudget
from quiverfs.errors import ExitCode, QuietError
from quiverfs.fs_identity import UserIdentity

MAX_DATASETS_PER_USER = 64
MAX_DIGEST_BYTES_PER_USER = 2 << 30


@dataclasses.dataclass(frozen=True)
class Quota:
    """A uid's bounds: ``datasets`` registered, and ``digest_bytes`` of digest files
    (``quiver mountd --digest-bytes-per-user``)."""

    datasets: int = MAX_DATASETS_PER_USER
    digest_bytes: int = MAX_DIGEST_BYTES_PER_USER

    def check_count(self, user: UserIdentity, mine: list[Registration],
                    integrity: IntegrityBudget) -> None:
        """Before a registration of ``user``, who holds ``mine``, is decoded: one more
        dataset, and no more after too many failed hash checks (QuietError)."""
        if user.uid == 0:
            return
        if len(mine) >= self.datasets:
            raise QuietError(f"uid {user.uid} has {len(mine)} datasets mounted, the most "
                             "allowed: 'quiver umount' one first", ExitCode.PERMISSION)
        if integrity.spent(user.uid):
            raise QuietError(f"uid {user.uid}'s datasets have failed "
                             f"{integrity.failures[user.uid]} hash checks since mountd "
                             "started: recreate their digests ('quiver digest create'); new "
                             "registrations are refused until mountd restarts",
                             ExitCode.PERMISSION)

    def check_digest_bytes(self, user: UserIdentity, mine: list[Registration],
                           identity: str, digest_bytes: int) -> None:
        """A digest of ``digest_bytes`` with ``identity`` fits ``user``'s bytes of
        digests: each identity counted once, as the state directory keeps it once."""
        if user.uid == 0:
            return
        kept = {reg.identity: reg.digest_bytes for reg in mine}
        used = sum(kept.values())
        if identity not in kept and used + digest_bytes > self.digest_bytes:
            raise QuietError(f"uid {user.uid}'s digests would take {used + digest_bytes} "
                             f"bytes, over the {self.digest_bytes}-byte limit: "
                             "'quiver umount' a dataset first", ExitCode.PERMISSION)

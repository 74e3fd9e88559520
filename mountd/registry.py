"""Registered datasets and their persistence in the state directory.

State layout::

    STATE/registrations.json        one record per dataset (no secrets)
    STATE/digests/IDENTITY.qd       the digest files, by identity
    STATE/credentials/NAME.json     a registration's GCS credentials (mode 0600)
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import time

from quiverfs import digest as digest_format
from quiverfs.backends import Backend, StorageOptions, open_backend
from quiverfs.errors import ExitCode, QuietError

log = logging.getLogger(__name__)

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


@dataclasses.dataclass
class Registration:
    """A dataset mounted at ROOT/NAME for one user."""

    name: str
    identity: str
    uid: int
    gid: int
    registered_at: float
    emulator_host: str | None = None
    anonymous: bool = False
    has_credentials: bool = False

    def record(self) -> dict:
        return dataclasses.asdict(self)


def check_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise QuietError(f"invalid dataset name {name!r}: use letters, digits, '.', '_', '+' "
                         "or '-' (at most 128, not starting with a dot)", ExitCode.USAGE)
    return name


class Registry:
    """Loads and saves registrations; owns the digests and credentials on disk."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        for sub in ("digests", "credentials"):
            os.makedirs(os.path.join(state_dir, sub), mode=0o700, exist_ok=True)
        os.chmod(state_dir, 0o700)

    @property
    def _records_path(self) -> str:
        return os.path.join(self.state_dir, "registrations.json")

    def digest_path(self, identity: str) -> str:
        return os.path.join(self.state_dir, "digests", f"{identity}.qd")

    def _cred_path(self, name: str) -> str:
        return os.path.join(self.state_dir, "credentials", f"{name}.json")

    def load_records(self) -> list[Registration]:
        try:
            with open(self._records_path, encoding="utf-8") as f:
                records = json.load(f)
        except FileNotFoundError:
            return []
        except ValueError:
            log.error("%s is corrupted; starting with no datasets", self._records_path)
            return []
        return [Registration(**r) for r in records]

    def save_records(self, regs: list[Registration]) -> None:
        data = json.dumps([r.record() for r in regs], indent=1).encode()
        digest_format.write_atomic(self._records_path, data)
        os.chmod(self._records_path, 0o600)

    def store_digest(self, data: bytes) -> digest_format.Digest:
        """Check a digest's bytes and keep a copy by identity."""
        digest = digest_format.decode(data, where="registered digest")
        path = self.digest_path(digest.identity)
        if not os.path.exists(path):
            digest_format.write_atomic(path, data)
        return digest

    def load_digest(self, identity: str) -> digest_format.Digest:
        return digest_format.load(self.digest_path(identity))

    def store_credentials(self, name: str, info: dict | None) -> None:
        path = self._cred_path(name)
        if info is None:
            if os.path.exists(path):
                os.unlink(path)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f)

    def storage_options(self, reg: Registration) -> StorageOptions:
        info = None
        if reg.has_credentials:
            with open(self._cred_path(reg.name), encoding="utf-8") as f:
                info = json.load(f)
        return StorageOptions(credentials_info=info, emulator_host=reg.emulator_host,
                              anonymous=reg.anonymous)

    def open_backend(self, reg: Registration, digest: digest_format.Digest) -> Backend:
        return open_backend(digest.source, self.storage_options(reg))

    def forget(self, reg: Registration, still_used: set[str]) -> None:
        """Remove a registration's credentials, and its digest if nobody else uses it."""
        self.store_credentials(reg.name, None)
        if reg.identity not in still_used:
            try:
                os.unlink(self.digest_path(reg.identity))
            except FileNotFoundError:
                pass


def new_registration(name: str, identity: str, uid: int, gid: int,
                     options: StorageOptions) -> Registration:
    return Registration(name=check_name(name), identity=identity, uid=uid, gid=gid,
                        registered_at=time.time(), emulator_host=options.emulator_host,
                        anonymous=options.anonymous,
                        has_credentials=options.credentials_info is not None)

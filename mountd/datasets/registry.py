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
import tempfile
import time

from quiverfs import digest as digest_format
from quiverfs.backends import StorageOptions
from quiverfs.backends.base import FETCH_DEADLINE
from quiverfs.dataset_name import check_name
from quiverfs.errors import ExitCode, QuietError
from quiverfs.fs_identity import UserIdentity

log = logging.getLogger(__name__)


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
    groups: list[int] = dataclasses.field(default_factory=list)  # the uid's, at registration
    digest_bytes: int = 0  # size of the digest file, counted against the uid's quota
    view: str = "exact"  # or "substitutable" (mountd.view.view_jobs)

    def record(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def user(self) -> UserIdentity:
        """The identity this registration's local files are opened with."""
        return UserIdentity(self.uid, self.gid, tuple(self.groups))


class Registry:
    """Loads and saves registrations; owns the digests and credentials on disk."""

    def __init__(self, state_dir: str, fetch_deadline: float = FETCH_DEADLINE) -> None:
        self.state_dir = state_dir
        self.fetch_deadline = fetch_deadline  # the node's bound on a bucket read
        # The registrations on disk, as last loaded or saved: what they name stays.
        self._saved: list[Registration] = []
        subdirs = [os.path.join(state_dir, sub) for sub in ("digests", "credentials")]
        try:
            for sub in subdirs:
                os.makedirs(sub, mode=0o700, exist_ok=True)
            os.chmod(state_dir, 0o700)
            # A registration must be saved before it is shown: a state directory that
            # takes no files fails the start, not every 'quiver mount' after it.
            for directory in (state_dir, *subdirs):
                _check_writable(directory)
        except OSError as exc:
            raise QuietError(f"cannot write state directory {exc.filename or state_dir}: "
                             f"{exc.strerror or exc}: make it writable or pick another "
                             "--cache-dir", ExitCode.PERMISSION) from None

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
        except OSError as exc:  # a directory in its place, a disk error
            raise QuietError(f"cannot read {self._records_path}: {exc.strerror or exc}",
                             ExitCode.PERMISSION) from None
        except ValueError:
            log.error("%s is corrupted; starting with no datasets", self._records_path)
            return []
        regs = []
        for record in records if isinstance(records, list) else []:
            try:
                regs.append(Registration(**record))
            except TypeError:
                log.error("%s: dropping a malformed record", self._records_path)
        self._saved = regs
        return regs

    def save_records(self, regs: list[Registration]) -> None:
        data = json.dumps([r.record() for r in regs], indent=1).encode()
        digest_format.write_atomic(self._records_path, data)
        os.chmod(self._records_path, 0o600)
        self._saved = list(regs)

    def keep(self, reg: Registration, data: bytes, credentials: dict | None) -> None:
        """Keep an accepted registration's digest (by identity) and credentials; on a
        failure nothing of it is left behind."""
        path = self.digest_path(reg.identity)
        created = not os.path.exists(path)
        try:
            if created:
                digest_format.write_atomic(path, data)
            self.store_credentials(reg.name, credentials)
        except OSError as exc:
            if created:
                _unlink_quietly(path)
            self._drop_credentials(reg.name)
            raise QuietError(f"mountd cannot save the registration of {reg.name}: "
                             f"{exc.strerror or exc}", ExitCode.DAEMON) from None

    def load_digest(self, identity: str) -> digest_format.Digest:
        return digest_format.load(self.digest_path(identity))

    def store_credentials(self, name: str, info: dict | None) -> None:
        path = self._cred_path(name)
        if info is None:
            _unlink_quietly(path)
            return
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(info, f)

    def storage_options(self, reg: Registration) -> StorageOptions:
        """How a saved registration reaches its bucket, with its saved credentials;
        QuietError if they cannot be read back."""
        info = None
        if reg.has_credentials:
            path = self._cred_path(reg.name)
            try:
                with open(path, encoding="utf-8") as f:
                    info = json.load(f)
            except OSError as exc:
                raise QuietError(f"cannot read its credentials {path}: "
                                 f"{exc.strerror or exc}", ExitCode.PERMISSION) from None
            except ValueError:
                raise QuietError(f"its credentials {path} are not JSON",
                                 ExitCode.PERMISSION) from None
            if not isinstance(info, dict):
                raise QuietError(f"its credentials {path} are not a JSON object",
                                 ExitCode.PERMISSION)
        return StorageOptions(credentials_info=info, emulator_host=reg.emulator_host,
                              anonymous=reg.anonymous, read_as=reg.user)

    def forget(self, reg: Registration, still_used: set[str]) -> None:
        """Remove a registration's credentials, and its digest if no dataset in
        ``still_used`` uses it; never what a saved registration names (a save that
        failed left the registrations on disk as they were)."""
        self._drop_credentials(reg.name)
        if reg.identity not in still_used | {r.identity for r in self._saved}:
            _unlink_quietly(self.digest_path(reg.identity))

    def _drop_credentials(self, name: str) -> None:
        if not any(r.name == name and r.has_credentials for r in self._saved):
            self.store_credentials(name, None)


def _check_writable(directory: str) -> None:
    """Create and remove a file in ``directory``; OSError naming it if it takes none."""
    try:
        fd, path = tempfile.mkstemp(prefix=".write-check-", dir=directory)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, directory) from None
    os.close(fd)
    os.unlink(path)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def new_registration(name: str, identity: str, user: UserIdentity, options: StorageOptions,
                     digest_bytes: int, view: str = "exact") -> Registration:
    return Registration(name=check_name(name), identity=identity, uid=user.uid, gid=user.gid,
                        registered_at=time.time(), emulator_host=options.emulator_host,
                        anonymous=options.anonymous,
                        has_credentials=options.credentials_info is not None,
                        groups=sorted(user.groups), digest_bytes=digest_bytes, view=view)

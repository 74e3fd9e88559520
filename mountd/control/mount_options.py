"""What a mount request asks for, checked before mountd acts on any of it: the name,
the digest's bytes, the view, and how to reach the bucket (credentials, endpoint)."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from mountd.control.server import Peer
from quiverfs.backends import StorageOptions
from quiverfs.dataset_name import check_name
from quiverfs.digest import Digest
from quiverfs.errors import ExitCode, QuietError
from quiverfs.gcs_endpoint import check_allowed, check_endpoint, check_token_uri
from quiverfs.job_protocol import VIEWS


@dataclasses.dataclass(frozen=True)
class MountRequest:
    """A mount request whose fields have the types and values mountd accepts."""

    name: str
    data: bytes  # the digest file
    view: str
    prefetch: bool
    options: StorageOptions


def mount_request(peer: Peer, req: dict[str, Any], endpoints: Sequence[str]) -> MountRequest:
    """``req`` checked; QuietError if a field is malformed, or if ``peer`` (not root)
    names a GCS endpoint that is not in ``endpoints`` (root's allow-list) or brings a
    key whose token endpoint is not Google's."""
    name = check_name(req["name"])
    data = req["digest"]
    if not isinstance(data, bytes):
        raise QuietError("the digest must be sent as bytes", ExitCode.USAGE)
    credentials = req.get("credentials")
    emulator_host = req.get("emulator_host")
    if not (credentials is None or isinstance(credentials, dict)) or not (
            emulator_host is None or isinstance(emulator_host, str)):
        raise QuietError("credentials must be a map and emulator_host a string",
                         ExitCode.USAGE)
    view = req.get("view", "exact")
    if view not in VIEWS:
        raise QuietError(f"unknown view {view!r}: use one of {', '.join(VIEWS)}",
                         ExitCode.USAGE)
    if emulator_host is not None:
        emulator_host = check_endpoint(emulator_host, "STORAGE_EMULATOR_HOST")
        check_allowed(emulator_host, peer.uid, endpoints)
    if credentials is not None:
        check_token_uri(credentials, peer.uid)
    options = StorageOptions(credentials_info=credentials, emulator_host=emulator_host,
                             anonymous=bool(req.get("anonymous", False)), read_as=peer.user)
    return MountRequest(name, data, view, bool(req.get("prefetch")), options)


def check_gcs_credentials(digest: Digest, options: StorageOptions, uid: int) -> None:
    """A user's gs:// registration must bring its own access: mountd's credentials
    (root's, or the VM's service account) are never lent to another user."""
    if (digest.source.startswith("gs://") and uid != 0
            and options.credentials_info is None and not options.anonymous
            and not options.emulator_host):
        raise QuietError(f"{digest.source}: pass --credentials FILE (a service-account "
                         "key you may use) or --anonymous for a public bucket; mountd "
                         "does not lend its own credentials", ExitCode.PERMISSION)


def try_credentials(info: dict) -> None:
    """Exchange a service-account key for a token once (blocking: a worker thread's
    work), so that a key its token endpoint refuses is refused at 'quiver mount'."""
    from quiverfs.backends.gcs import check_service_account  # the GCS client is slow to import

    check_service_account(info)

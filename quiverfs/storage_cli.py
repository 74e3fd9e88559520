"""Command-line options that say how to reach a storage backend, shared by every
command that reads a dataset's source (``quiver digest create|verify``, ``quiver mount``)."""
from __future__ import annotations

import argparse
import json
import os

from quiverfs.backends import StorageOptions
from quiverfs.errors import ExitCode, QuietError
from quiverfs.gcs_endpoint import check_endpoint


def add_storage_options(p: argparse.ArgumentParser) -> None:
    """Options saying how to reach a gs:// source."""
    p.add_argument("--credentials", metavar="FILE",
                   help="service-account JSON for gs:// (default: application default "
                   "credentials)")
    p.add_argument("--anonymous", action="store_true",
                   help="read gs:// without credentials (public buckets, emulators)")


def storage_options(args: argparse.Namespace) -> StorageOptions:
    """StorageOptions from the command line and STORAGE_EMULATOR_HOST."""
    info = None
    if getattr(args, "credentials", None):
        info = _service_account_info(args.credentials)
    endpoint = os.environ.get("STORAGE_EMULATOR_HOST") or None
    if endpoint is not None:
        endpoint = check_endpoint(endpoint, "$STORAGE_EMULATOR_HOST")
    return StorageOptions(credentials_info=info, emulator_host=endpoint,
                          anonymous=bool(getattr(args, "anonymous", False)))


def _service_account_info(path: str) -> dict:
    """A service-account key file's contents, refused now if google-auth cannot use it
    (else the mistake would surface later, inside mountd, at the first read)."""
    from google.auth.exceptions import GoogleAuthError
    from google.oauth2 import service_account

    try:
        with open(path, encoding="utf-8") as f:
            info = json.load(f)
    except OSError as exc:
        raise QuietError(f"cannot read credentials {path}: {exc.strerror}",
                         ExitCode.PERMISSION) from None
    except ValueError:
        raise QuietError(f"credentials {path} are not JSON: give a service-account key file",
                         ExitCode.PERMISSION) from None
    if not isinstance(info, dict):
        raise QuietError(f"credentials {path} are not a JSON object: give a service-account "
                         "key file", ExitCode.PERMISSION)
    try:
        service_account.Credentials.from_service_account_info(info)
    except (ValueError, GoogleAuthError) as exc:
        reason = " ".join(str(exc).split()).rstrip(".")  # one line, whatever google-auth says
        raise QuietError(f"credentials {path} are not a usable service-account key "
                         f"({reason}): give a key file from 'gcloud iam service-accounts keys "
                         "create'", ExitCode.PERMISSION) from None
    return info

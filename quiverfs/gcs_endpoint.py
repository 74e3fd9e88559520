"""Which GCS endpoint a dataset's bucket is read through, and which ones a user may name.

An endpoint is an origin: ``http[s]://HOST[:PORT]``, nothing after it. mountd sends the
requests of a registration to its endpoint as root, so an endpoint with a path, a
query, a fragment or user-info would let a user choose what root asks of any server it
can reach; those are refused for everyone. Root's own requests may name any endpoint;
another user's only Google's (``DEFAULT_ENDPOINT``) or one that root listed with
mountd's ``--gcs-endpoint URL[,URL...]`` (``gcs-endpoint = [...]`` in the config file).
For the same reason another user's service-account key must send its token requests
to Google's token endpoint.
"""
from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Sequence
from typing import ClassVar

from quiverfs.errors import ExitCode, QuietError

DEFAULT_ENDPOINT = "https://storage.googleapis.com"
# Where Google's service-account keys send their token requests ('token_uri'): the
# only places mountd posts a user's key to for users other than root.
GOOGLE_TOKEN_URIS = ("https://oauth2.googleapis.com/token",
                     "https://accounts.google.com/o/oauth2/token")
GOOGLE_UNIVERSE = "googleapis.com"
_PRINTABLE = re.compile(r"[!-~]+")  # ASCII without spaces or control characters


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` is not an endpoint (``http[s]://HOST[:PORT]``), or None."""
    # urlsplit drops tabs and newlines without a word: they are refused before it
    if not _PRINTABLE.fullmatch(url):
        return "it holds spaces, control or non-ASCII characters"
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return str(exc)
    if parts.scheme.lower() not in ("http", "https"):
        return "its scheme is not http or https"
    if "@" in parts.netloc:
        return "it has user-info (USER:PASSWORD@)"
    if not parts.hostname:
        return "it names no host"
    if parts.path not in ("", "/"):
        return f"it has a path ({parts.path})"
    if parts.query or "?" in url:
        return "it has a query (?...)"
    if parts.fragment or "#" in url:
        return "it has a fragment (#...)"
    if port == 0:
        return "its port is 0"
    return None


def check_endpoint(url: str, where: str) -> str:
    """``url`` as the origin it names, lower-cased (``http://127.0.0.1:9023``); a
    QuietError (USAGE) naming ``where`` it came from if it is not an endpoint."""
    why = endpoint_problem(url)
    if why is not None:
        raise QuietError(f"{where} {url!r} is not a GCS endpoint: {why}: give "
                         "http://HOST:PORT or https://HOST[:PORT], nothing after the port",
                         ExitCode.USAGE)
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    host = f"[{host}]" if ":" in host else host  # an IPv6 address
    port = f":{parts.port}" if parts.port is not None else ""
    return f"{parts.scheme.lower()}://{host}{port}"


def check_allowed(endpoint: str, uid: int, allowed: Sequence[str]) -> None:
    """Refuse (PERMISSION) a non-root ``uid`` an endpoint root has not listed in
    ``allowed`` (checked endpoints); Google's own is always allowed."""
    if uid == 0 or endpoint == DEFAULT_ENDPOINT or endpoint in allowed:
        return
    listed = ", ".join(allowed) if allowed else "none"
    raise QuietError(f"GCS endpoint {endpoint} is not one mountd lets users name (listed: "
                     f"{listed}): ask root to add it to gcs-endpoint in mountd's config file "
                     "(or its --gcs-endpoint), or unset STORAGE_EMULATOR_HOST",
                     ExitCode.PERMISSION)


def check_token_uri(info: dict, uid: int) -> None:
    """Refuse (PERMISSION) a non-root ``uid`` a service-account key whose token endpoint
    is not Google's (mountd would post to it as root), or whose universe is not
    Google's public one (google-auth then signs its own tokens, and mountd could not try
    the key before registering it)."""
    if uid == 0:
        return
    token_uri = info.get("token_uri")
    if token_uri not in GOOGLE_TOKEN_URIS:
        raise QuietError(f"the service-account key's token_uri {token_uri!r} is not "
                         f"Google's ({GOOGLE_TOKEN_URIS[0]}): for users other than root, "
                         "mountd exchanges keys only there; give a key file from 'gcloud "
                         "iam service-accounts keys create'", ExitCode.PERMISSION)
    universe = info.get("universe_domain", GOOGLE_UNIVERSE)
    if universe != GOOGLE_UNIVERSE:
        raise QuietError(f"the service-account key's universe_domain {universe!r} is not "
                         f"{GOOGLE_UNIVERSE!r}: for users other than root, mountd takes keys "
                         "of Google's public cloud only", ExitCode.PERMISSION)


@dataclasses.dataclass(frozen=True)
class GcsEndpoints:
    """``--gcs-endpoint``: endpoints, comma-separated on the command line, a string or
    an array of strings in the config file."""

    option: str
    toml_types: ClassVar[tuple[type, ...]] = (str, list)

    def __call__(self, value: str | list) -> tuple[str, ...]:
        urls = value.split(",") if isinstance(value, str) else value
        out = []
        for url in urls:
            if not isinstance(url, str):
                raise QuietError(f"{self.option} must list strings, not {url!r}",
                                 ExitCode.USAGE)
            out.append(check_endpoint(url.strip(), self.option))
        return tuple(dict.fromkeys(out))

"""A service-account key made in the test, and an OAuth token endpoint on loopback that
answers its JWT-bearer grants as Google's does (tests/test_private_bucket.py)."""
from __future__ import annotations

import base64
import contextlib
import dataclasses
import http.server
import json
import threading
import urllib.parse
from collections.abc import Iterator

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa

JWT_BEARER = "urn:ietf:params:oauth:grant-type:jwt-bearer"


@dataclasses.dataclass
class ServiceAccountKey:
    """An RSA key pair and the key file ('gcloud iam service-accounts keys create')."""

    email: str
    key: rsa.RSAPrivateKey

    def info(self, token_uri: str) -> dict:
        pem = self.key.private_bytes(serialization.Encoding.PEM,
                                     serialization.PrivateFormat.PKCS8,
                                     serialization.NoEncryption()).decode()
        return {"type": "service_account", "project_id": "quiver-test",
                "private_key_id": f"id-{self.email.split('@')[0]}", "private_key": pem,
                "client_email": self.email, "client_id": "1", "token_uri": token_uri}


def new_key(email: str) -> ServiceAccountKey:
    return ServiceAccountKey(email, rsa.generate_private_key(public_exponent=65537,
                                                             key_size=2048))


@dataclasses.dataclass(frozen=True)
class Grant:
    """One token request: its grant type, and the JWT's issuer if its RS256 signature
    verifies with that issuer's key (None if it does not)."""

    grant_type: str
    issuer: str | None


class TokenEndpoint:
    """Answers grants signed by ``keys`` with ``token`` (changeable), except those of
    ``refused`` issuers, which get 400 invalid_grant; records every grant."""

    def __init__(self, keys: list[ServiceAccountKey], refused: set[str] | None = None) -> None:
        self.public = {k.email: k.key.public_key() for k in keys}
        self.refused = refused or set()
        self.token = "token-1"
        self.grants: list[Grant] = []
        self._lock = threading.Lock()
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                form = urllib.parse.parse_qs(body.decode())
                grant = Grant(form.get("grant_type", [""])[0],
                              endpoint.verified_issuer(form.get("assertion", [""])[0]))
                with endpoint._lock:
                    endpoint.grants.append(grant)
                    token = endpoint.token
                if grant.issuer is None or grant.issuer in endpoint.refused:
                    self.answer(400, {"error": "invalid_grant",
                                      "error_description": "Invalid JWT Signature."})
                else:
                    self.answer(200, {"access_token": token, "expires_in": 3600,
                                      "token_type": "Bearer"})

            def answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/token"

    def verified_issuer(self, assertion: str) -> str | None:
        """The JWT's ``iss`` if its signature verifies with that issuer's key."""
        try:
            header, claims, signature = assertion.split(".")
            iss = json.loads(_unb64(claims))["iss"]
            self.public[iss].verify(_unb64(signature), f"{header}.{claims}".encode(),
                                    padding.PKCS1v15(), hashes.SHA256())
        except (ValueError, KeyError, InvalidSignature):
            return None
        return iss

    def recorded(self) -> list[Grant]:
        with self._lock:
            return list(self.grants)


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


@contextlib.contextmanager
def token_endpoint(keys: list[ServiceAccountKey], refused: set[str] | None = None
                   ) -> Iterator[TokenEndpoint]:
    endpoint = TokenEndpoint(keys, refused)
    thread = threading.Thread(target=endpoint.server.serve_forever, daemon=True)
    thread.start()
    try:
        yield endpoint
    finally:
        endpoint.server.shutdown()
        endpoint.server.server_close()
        thread.join()

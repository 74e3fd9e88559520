"""A throwaway CA, and the certificates it signs for an etcd on 127.0.0.1 and for one
client, as PEM files (the ``cryptography`` package, which google-auth already needs)."""
from __future__ import annotations

import datetime
import ipaddress
import os

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from quiverfs.bench.etcd_process import EtcdTls


def make_tls(directory: str) -> EtcdTls:
    """A CA, etcd's certificate for 127.0.0.1 and a client's, written in ``directory``."""
    os.makedirs(directory, exist_ok=True)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = _name("quiver test CA")
    ca = (_builder(ca_name, ca_name, ca_key)
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .add_extension(x509.KeyUsage(
              digital_signature=True, key_cert_sign=True, crl_sign=True,
              content_commitment=False, key_encipherment=False, data_encipherment=False,
              key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))
    paths = {"ca": _write(directory, "ca.pem", ca.public_bytes(serialization.Encoding.PEM))}
    # etcd's JSON gateway reaches etcd's gRPC with etcd's own certificate: a client's too
    for who, usage, extra in (
            ("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
             x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])),
            ("client", [ExtendedKeyUsageOID.CLIENT_AUTH], None)):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (_builder(_name(f"quiver test {who}"), ca_name, key)
                   .add_extension(x509.BasicConstraints(ca=False, path_length=None),
                                  critical=True)
                   .add_extension(x509.ExtendedKeyUsage(usage), critical=False))
        if extra is not None:
            builder = builder.add_extension(extra, critical=False)
        cert = builder.sign(ca_key, hashes.SHA256())
        paths[f"{who}_cert"] = _write(directory, f"{who}.pem",
                                      cert.public_bytes(serialization.Encoding.PEM))
        paths[f"{who}_key"] = _write(directory, f"{who}-key.pem", key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption()))
    return EtcdTls(**paths)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _builder(subject: x509.Name, issuer: x509.Name,
             key: ec.EllipticCurvePrivateKey) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1)))


def _write(directory: str, name: str, data: bytes) -> str:
    path = os.path.join(directory, name)
    with open(path, "wb") as f:
        f.write(data)
    return path

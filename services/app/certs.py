"""``megha certs``: a CA and one certificate per process and user of a federation.

    <out>/ca.crt, ca.key                  the CA (kept: run again to add identities)
    <out>/gm/gm-1.crt, .key               each GM, LM, the worker hosts of each LM, ...
    <out>/worker/lm-1.crt, .key           the worker hosts of lm-1 share one identity
    <out>/user/alice.crt, .key            each user of ``authz.users`` and ``--user``
    <out>/admin/operator.crt, .key        the CLI's default identity (may do everything)
    <out>/client/shared.crt, .key         names no one: users with a token show it

Each certificate names its identity as a URI, ``spiffe://megha/<role>/<name>``, which
servers read (``services.common.authz``), and the federation's hosts (plus localhost and
127.0.0.1) as DNS/IP names, so any process may serve. Point ``tls.dir`` at ``<out>``
and ``tls.ca`` at ``<out>/ca.crt``.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
from collections.abc import Iterable
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from services.common.authz import SPIFFE_PREFIX, token_hash
from services.common.config import FederationConfig


def identities(config: FederationConfig, users: Iterable[str] = ()) -> list[str]:
    """Every ``role/name`` a federation's processes and users need."""
    out = [f"gm/{g.id}" for g in config.gms]
    out += [f"lm/{m.id}" for m in config.lms]
    out += [f"worker/{m.id}" for m in config.lms]
    out += ["predictor/predictor", "autoscaler/autoscaler", "console/console"]
    out += ["admin/operator", "client/shared"]
    named = [*(config.authz.users if config.authz else {}), *users]
    out += [f"user/{name}" for name in dict.fromkeys(named)]
    return out


def _hosts(config: FederationConfig) -> list[x509.GeneralName]:
    names: list[x509.GeneralName] = []
    seen: set[str] = set()
    endpoints = [*config.gms, *config.lms, *([config.predictor] if config.predictor else [])]
    for host in ["localhost", "127.0.0.1", *(e.host for e in endpoints)]:
        if host in seen:
            continue
        seen.add(host)
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return names


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    data = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _ca(out: Path, days: int) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    """The CA under ``out``: the one there, or a new one."""
    cert_path, key_path = out / "ca.crt", out / "ca.key"
    if cert_path.exists() and key_path.exists():
        key = serialization.load_pem_private_key(key_path.read_bytes(), None)
        assert isinstance(key, ec.EllipticCurvePrivateKey), f"{key_path}: not an EC key"
        return key, x509.load_pem_x509_certificate(cert_path.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("megha CA"))
        .issuer_name(_name("megha CA"))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(key, hashes.SHA256())
    )
    _write_key(key_path, key)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def issue(
    out: Path, config: FederationConfig, users: Iterable[str] = (), days: int = 365
) -> list[Path]:
    """Write the CA (unless there) and a certificate and key for every identity; the
    certificates written."""
    out.mkdir(parents=True, exist_ok=True)
    ca_key, ca = _ca(out, days)
    hosts = _hosts(config)
    now = datetime.datetime.now(datetime.UTC)
    written = []
    for identity in identities(config, users):
        key = ec.generate_private_key(ec.SECP256R1())
        sans = [x509.UniformResourceIdentifier(SPIFFE_PREFIX + identity), *hosts]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(identity))
            .issuer_name(ca.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        base = out / identity
        base.parent.mkdir(parents=True, exist_ok=True)
        _write_key(Path(f"{base}.key"), key)
        Path(f"{base}.crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        written.append(Path(f"{base}.crt"))
    return written


def new_token() -> tuple[str, str]:
    """A fresh bearer token and the SHA-256 the federation file keeps of it."""
    token = secrets.token_urlsafe(32)
    return token, token_hash(token)

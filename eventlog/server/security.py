"""The embedded log's security material: a CA, a server certificate, one user per role.

``turnstream up|nats --log.secure`` keep it in ``<data_dir>/nats-auth`` (``--log.auth-dir``)::

    ca.pem, ca-key.pem                 a self-signed CA; clients trust ca.pem (--log.tls-ca)
    server-cert.pem, server-key.pem    the server's certificate: localhost, 127.0.0.1, ::1,
                                       this machine's name and any host asked for
    admin.toml, gateway.toml,          each role's user, password and CA, as a ``--config``
    worker.toml, trainer.toml          file: ``turnstream worker --config worker.toml ...``

Keys and role files are 0600, the directory 0700. What exists is reused, so passwords survive
restarts on one data dir and services configured with them keep connecting; the server
certificate is issued again only when it nears its end or misses a host. The nats-server is
given bcrypt hashes of the passwords, never the passwords (its config file is not private).
What each role may do is ``eventlog.server.permissions``.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import ipaddress
import json
import os
import secrets
import socket
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import bcrypt
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pydantic import SecretStr

from eventlog.config import LogSettings, StreamNames
from eventlog.server.errors import LogSecurityError
from eventlog.server.permissions import ROLES, Role, authorization_block

__all__ = ["LogSecurity", "RoleCredentials", "ensure_log_security"]

_CA_YEARS = 10
_SERVER_DAYS = 825
_RENEW_BEFORE = datetime.timedelta(days=30)
_BCRYPT_ROUNDS = 10  # nats-server checks the hash on every connect: keep reconnect storms cheap
_DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")

_Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class RoleCredentials:
    role: Role
    user: str
    password: SecretStr
    config_file: Path  # the role's ``--config`` TOML: user, password, tls_ca


@dataclass(frozen=True)
class LogSecurity:
    """Paths of the CA and server certificate, and each role's credentials."""

    directory: Path
    ca_file: Path
    cert_file: Path
    key_file: Path
    roles: Mapping[Role, RoleCredentials]

    def server_config(self, names: StreamNames) -> str:
        """nats-server config: a user per role with its permissions, and TLS required."""
        hashes_ = {
            role: bcrypt.hashpw(
                c.password.get_secret_value().encode(), bcrypt.gensalt(_BCRYPT_ROUNDS)
            ).decode()
            for role, c in self.roles.items()
        }
        tls = (
            "tls {\n"
            f"  cert_file: {json.dumps(str(self.cert_file))}\n"
            f"  key_file: {json.dumps(str(self.key_file))}\n"
            f"  ca_file: {json.dumps(str(self.ca_file))}\n"
            "  timeout: 2\n"
            "}"
        )
        return authorization_block(hashes_, names) + "\n" + tls

    def client_settings(self, log: LogSettings, role: Role) -> LogSettings:
        """``log`` connecting as ``role``, trusting this CA."""
        c = self.roles[role]
        return log.model_copy(
            update={"user": c.user, "password": c.password, "tls_ca": self.ca_file}
        )


def ensure_log_security(directory: Path, *, hosts: Sequence[str] = ()) -> LogSecurity:
    """Make (or reuse) the CA, the server certificate for ``hosts`` and the role users."""
    directory = directory.resolve()
    wanted = list(dict.fromkeys([*_DEFAULT_HOSTS, socket.gethostname(), *hosts]))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)
        with _locked(directory / ".lock"):
            ca_key, ca_cert = _ensure_ca(directory)
            _ensure_server_cert(directory, ca_key, ca_cert, wanted)
            roles = {role: _ensure_role(directory, role) for role in ROLES}
    except OSError as exc:
        raise LogSecurityError(
            f"cannot make the log's certificates and credentials in {directory}: {exc}"
        ) from exc
    return LogSecurity(
        directory,
        directory / "ca.pem",
        directory / "server-cert.pem",
        directory / "server-key.pem",
        roles,
    )


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """Two processes starting on one data dir must not make two sets of passwords."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _write(path: Path, data: bytes, mode: int) -> None:
    """Replace ``path`` atomically: a crash leaves the old file or the new one, never half."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # O_CREAT's mode is only used for a new file and is cut by the umask
    os.replace(tmp, path)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: _Key) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def _load_key(path: Path) -> _Key:
    key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise LogSecurityError(f"{path} is not an EC private key; delete it to make a new one")
    return key


def _ensure_ca(directory: Path) -> tuple[_Key, x509.Certificate]:
    key_path, cert_path = directory / "ca-key.pem", directory / "ca.pem"
    if key_path.exists() and cert_path.exists():
        try:
            return _load_key(key_path), x509.load_pem_x509_certificate(cert_path.read_bytes())
        except ValueError as exc:
            raise LogSecurityError(
                f"the CA in {directory} does not load ({exc}); delete ca.pem and ca-key.pem to "
                f"make a new one (clients then need the new ca.pem)"
            ) from exc
    if key_path.exists() or cert_path.exists():
        missing = cert_path if key_path.exists() else key_path
        raise LogSecurityError(
            f"{missing} is missing but its pair is there; restore it, or delete ca.pem and "
            f"ca-key.pem to make a new CA (clients then need the new ca.pem)"
        )
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "turnstream"),
            x509.NameAttribute(NameOID.COMMON_NAME, f"turnstream log CA ({socket.gethostname()})"),
        ]
    )
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # clocks a little behind
        .not_valid_after(now + datetime.timedelta(days=365 * _CA_YEARS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), 0o600)  # the key first: a CA cert without it is a dead end
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)
    return key, cert


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _server_cert_fits(path: Path, ca: x509.Certificate, hosts: Sequence[str]) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(path.read_bytes())
        cert.verify_directly_issued_by(ca)
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, TypeError, InvalidSignature, x509.ExtensionNotFound):
        return False
    return cert.not_valid_after_utc - _RENEW_BEFORE > _now() and all(
        _san(h) in names for h in hosts
    )


def _ensure_server_cert(
    directory: Path, ca_key: _Key, ca: x509.Certificate, hosts: Sequence[str]
) -> None:
    cert_path, key_path = directory / "server-cert.pem", directory / "server-key.pem"
    if key_path.exists() and _server_cert_fits(cert_path, ca, hosts):
        return
    key = ec.generate_private_key(ec.SECP256R1())
    now = _now()
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "turnstream"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "turnstream log"),
                ]
            )
        )
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=_SERVER_DAYS))
        .add_extension(x509.SubjectAlternativeName([_san(h) for h in hosts]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=False,
                crl_sign=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            # Python 3.13's default TLS context (VERIFY_X509_STRICT) refuses a leaf without it.
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    _write(key_path, _key_pem(key), 0o600)
    _write(cert_path, cert.public_bytes(serialization.Encoding.PEM), 0o644)


def _role_file(directory: Path, role: Role, password: str) -> str:
    return (
        f'# turnstream log credentials of the "{role}" role (written by --log.secure; keep '
        f"private).\n"
        f"# turnstream COMMAND --log.url tls://HOST:PORT --config {directory / f'{role}.toml'}\n"
        "[log]\n"
        f"user = {json.dumps(role)}\n"
        f"password = {json.dumps(password)}\n"
        f"tls_ca = {json.dumps(str(directory / 'ca.pem'))}\n"
    )


def _new_password() -> str:
    """256 random bits a command line takes as a value: ``token_urlsafe``'s alphabet holds
    "-", and a password starting with it (1 in 64) is read by argparse as an option, not as
    ``--log.password``'s value (a flaky e2e test found it)."""
    while (password := secrets.token_urlsafe(32)).startswith("-"):
        pass
    return password


def _ensure_role(directory: Path, role: Role) -> RoleCredentials:
    path = directory / f"{role}.toml"
    if path.exists():
        try:
            stored = tomllib.loads(path.read_text())["log"]
            password = stored["password"]
            if stored.get("user") != role or not isinstance(password, str) or not password:
                raise ValueError(f'expected user "{role}" and a password')
        except (tomllib.TOMLDecodeError, KeyError, TypeError, ValueError) as exc:
            raise LogSecurityError(
                f"{path} does not hold the {role} role's credentials ({exc}); delete it to make "
                f"a new password (services using the old one must get the new file)"
            ) from exc
    else:
        password = _new_password()
    content = _role_file(directory, role, password)
    if not path.exists() or path.read_text() != content:  # e.g. the data dir moved: new CA path
        _write(path, content.encode(), 0o600)
    return RoleCredentials(role, role, SecretStr(password), path)

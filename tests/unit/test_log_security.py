"""The log's credential settings, each role's permissions, and the security material on disk.

No server here: ``tests/integration/test_log_security.py`` holds the same roles against a real
nats-server with TLS.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pydantic
import pytest
from cryptography import x509
from pydantic_settings import CliApp

from eventlog.config import LogSettings, StreamNames
from eventlog.server import ROLES, LogSecurityError, Role, ensure_log_security, role_permissions
from turnstream.stack.settings import ServiceSettings, with_toml

# -- settings ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "refusal"),
    [
        pytest.param({"user": "worker"}, "--log.user and --log.password go together", id="no-pw"),
        pytest.param({"password": "pw"}, "--log.user and --log.password go together", id="no-user"),
        pytest.param(
            {"user": "w", "password": "pw", "token": "t"},
            "--log.user and --log.token are different ways to log in",
            id="user-and-token",
        ),
        pytest.param(
            {"nkey_seed": "u.nk", "creds": "u.creds"},
            "--log.nkey-seed and --log.creds are different ways",
            id="nkey-and-creds",
        ),
        pytest.param(
            {"tls_cert": "c.pem"}, "--log.tls-cert and --log.tls-key go together", id="cert-only"
        ),
        pytest.param(
            {"tls_key": "k.pem"}, "--log.tls-cert and --log.tls-key go together", id="key-only"
        ),
        pytest.param(
            {"secure": True, "url": "nats://h:4222"},
            "--log.secure sets up the embedded server",
            id="secure-with-url",
        ),
        pytest.param(
            {"secure": True, "token": "t"}, "leave --log.token unset", id="secure-with-token"
        ),
    ],
)
def test_credential_settings_that_cannot_work_are_refused_saying_why(
    fields: dict[str, Any], refusal: str
) -> None:
    with pytest.raises(pydantic.ValidationError, match=refusal):
        LogSettings(**fields)


@pytest.mark.parametrize(
    "fields",
    [
        pytest.param({}, id="none"),
        pytest.param({"user": "gateway", "password": "pw"}, id="user"),
        pytest.param({"token": "t"}, id="token"),
        pytest.param({"nkey_seed": "u.nk"}, id="nkey"),
        pytest.param({"creds": "u.creds"}, id="creds"),
        pytest.param({"tls_ca": "ca.pem", "tls_server_name": "log.internal"}, id="ca"),
        pytest.param({"token": "t", "tls_cert": "c.pem", "tls_key": "k.pem"}, id="mtls"),
        pytest.param({"secure": True}, id="secure"),
    ],
)
def test_each_way_to_log_in_is_accepted(fields: dict[str, Any]) -> None:
    LogSettings(**fields)


def test_secrets_come_from_the_environment_and_never_show(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TURNSTREAM_LOG__USER", "worker")
    monkeypatch.setenv("TURNSTREAM_LOG__PASSWORD", "hunter2")
    settings = ServiceSettings()
    assert settings.log.user == "worker"
    assert settings.log.password is not None
    assert settings.log.password.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(settings) and "hunter2" not in str(settings)


def test_a_role_file_is_a_config_file_and_flags_add_the_url(tmp_path: Path) -> None:
    security = ensure_log_security(tmp_path / "auth")
    worker = security.roles["worker"]
    settings = CliApp.run(
        with_toml(ServiceSettings, worker.config_file),
        cli_args=["--log.url", "tls://127.0.0.1:4222"],
    )
    assert settings.log.url == "tls://127.0.0.1:4222"
    assert settings.log.user == "worker" and settings.log.password == worker.password
    assert settings.log.tls_ca == security.ca_file


# -- permissions ------------------------------------------------------------------------------


def _matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: ``*`` is one token, ``>`` one or more at the end."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def may_publish(role: Role, subject: str, names: StreamNames | None = None) -> bool:
    allowed = role_permissions(role, names or StreamNames()).publish
    return any(_matches(p, subject) for p in allowed)


@pytest.mark.parametrize(
    ("role", "subject", "allowed"),
    [
        ("gateway", "ts.ev.r.s.turn", True),
        ("gateway", "ts.ev.r.s.open", True),
        ("gateway", "$JS.API.DIRECT.GET.EVENTS", True),
        ("gateway", "$JS.API.CONSUMER.CREATE.KV_ts_policy.w.$KV.ts_policy.r", True),
        ("gateway", "ts.traj.r", False),
        ("gateway", "$KV.ts_policy.r", False),
        ("gateway", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.fold", False),
        ("worker", "ts.ev.r.s.close", True),
        ("worker", "ts.ev.r.s.turn", False),
        ("worker", "ts.ev.r.s.open", False),
        ("worker", "ts.ev.r.s.reward", False),
        ("worker", "ts.traj.r", True),
        ("worker", "ts.dlq.fold.undecodable", True),
        ("worker", "$JS.API.CONSUMER.CREATE.EVENTS.fold.ts.ev.*.*.close", True),
        ("worker", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.fold", True),
        ("worker", "$JS.ACK.EVENTS.fold.1.2.3.4.5.6.7", True),
        ("worker", "$JS.API.STREAM.MSG.GET.EVENTS", True),
        ("worker", "$KV.ts_folded.r.s", True),
        ("worker", "$KV.ts_sessions.r.s", True),
        ("worker", "$KV.ts_policy.r", False),
        ("trainer", "$JS.API.CONSUMER.MSG.NEXT.TRAJ.trainer", True),
        ("trainer", "$JS.ACK.TRAJ.trainer.1.2.3.4.5.6.7", True),
        ("trainer", "$KV.ts_policy.r", True),
        ("trainer", "ts.dlq.sink.undecodable", True),
        ("trainer", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.fold", False),
        ("trainer", "$JS.API.DIRECT.GET.EVENTS", False),
        ("trainer", "ts.ev.r.s.turn", False),
        ("trainer", "ts.traj.r", False),
        # images: the gateway stores a turn's images, every role reads them (issue 39)
        ("gateway", "$O.ts_images.C.nuid", True),
        ("gateway", "$O.ts_images.M.bmFtZQ==", True),
        ("gateway", "$JS.API.STREAM.PURGE.OBJ_ts_images", True),  # the chunks a refresh replaces
        ("gateway", "$JS.API.STREAM.MSG.GET.OBJ_ts_images", True),
        ("worker", "$JS.API.STREAM.MSG.GET.OBJ_ts_images", True),
        ("worker", "$JS.API.CONSUMER.CREATE.OBJ_ts_images", True),  # get's ordered consumer
        ("worker", "$JS.FC.OBJ_ts_images.x.1", True),
        ("worker", "$O.ts_images.C.nuid", False),
        ("worker", "$O.ts_images.M.bmFtZQ==", False),
        ("trainer", "$JS.API.STREAM.MSG.GET.OBJ_ts_images", True),
        ("trainer", "$O.ts_images.C.nuid", False),
        ("admin", "$JS.API.STREAM.CREATE.EVENTS", True),
        ("admin", "ts.ev.r.s.turn", True),
    ],
)
def test_each_role_may_publish_what_its_service_needs_and_no_more(
    role: Role, subject: str, allowed: bool
) -> None:
    assert may_publish(role, subject) is allowed


@pytest.mark.parametrize("role", [r for r in ROLES if r != "admin"])
@pytest.mark.parametrize("verb", ["CREATE", "UPDATE", "DELETE", "PURGE", "MSG.DELETE"])
def test_only_admin_may_change_or_delete_a_stream(role: Role, verb: str) -> None:
    for stream in ("EVENTS", "TRAJ", "DLQ", "KV_ts_policy", "KV_ts_folded", "OBJ_ts_images"):
        if (role, verb, stream) == ("gateway", "PURGE", "OBJ_ts_images"):
            continue  # a put purges the chunks it replaces
        assert not may_publish(role, f"$JS.API.STREAM.{verb}.{stream}")
    assert role_permissions(role, StreamNames()).subscribe == ("_INBOX.>",)


def test_permissions_follow_renamed_streams_and_buckets() -> None:
    names = StreamNames(events="EV2", trajectories="TR2", policy_bucket="pol2")
    assert may_publish("worker", "$JS.API.CONSUMER.MSG.NEXT.EV2.fold", names)
    assert not may_publish("worker", "$JS.API.CONSUMER.MSG.NEXT.EVENTS.fold", names)
    assert may_publish("trainer", "$KV.pol2.r", names)
    assert may_publish("gateway", "$JS.API.STREAM.INFO.KV_pol2", names)


# -- the material on disk ---------------------------------------------------------------------


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_and_passwords_are_private_and_the_server_gets_only_hashes(tmp_path: Path) -> None:
    security = ensure_log_security(tmp_path / "auth")
    assert _mode(security.directory) == 0o700
    for private in ("ca-key.pem", "server-key.pem", *(f"{r}.toml" for r in ROLES)):
        assert _mode(security.directory / private) == 0o600, private
    config = security.server_config(StreamNames())
    for credentials in security.roles.values():
        assert credentials.password.get_secret_value() not in config
        assert f'user: "{credentials.role}", password: "$2b$' in config
    assert f'ca_file: "{security.ca_file}"' in config


def test_a_second_start_reuses_the_ca_and_the_passwords(tmp_path: Path) -> None:
    first = ensure_log_security(tmp_path / "auth")
    ca = first.ca_file.read_bytes()
    server_cert = first.cert_file.read_bytes()
    second = ensure_log_security(tmp_path / "auth")
    assert second.ca_file.read_bytes() == ca
    assert second.cert_file.read_bytes() == server_cert
    assert {r: c.password for r, c in second.roles.items()} == {
        r: c.password for r, c in first.roles.items()
    }


def test_a_new_host_gets_a_new_server_certificate_from_the_same_ca(tmp_path: Path) -> None:
    first = ensure_log_security(tmp_path / "auth")
    ca = first.ca_file.read_bytes()
    before = first.cert_file.read_bytes()
    second = ensure_log_security(tmp_path / "auth", hosts=["log.internal", "10.1.2.3"])
    assert second.ca_file.read_bytes() == ca and second.cert_file.read_bytes() != before
    cert = x509.load_pem_x509_certificate(second.cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "log.internal" in names.get_values_for_type(x509.DNSName)
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert {str(ip) for ip in names.get_values_for_type(x509.IPAddress)} >= {
        "127.0.0.1",
        "10.1.2.3",
    }
    cert.verify_directly_issued_by(x509.load_pem_x509_certificate(ca))


def test_a_half_missing_ca_is_an_error_naming_the_file(tmp_path: Path) -> None:
    security = ensure_log_security(tmp_path / "auth")
    os.remove(security.directory / "ca-key.pem")
    with pytest.raises(LogSecurityError, match=r"ca-key\.pem is missing"):
        ensure_log_security(tmp_path / "auth")


def test_a_role_file_edited_out_of_shape_is_an_error_naming_it(tmp_path: Path) -> None:
    security = ensure_log_security(tmp_path / "auth")
    security.roles["worker"].config_file.write_text('[log]\nuser = "gateway"\npassword = "x"\n')
    with pytest.raises(LogSecurityError, match=r"worker\.toml does not hold the worker role"):
        ensure_log_security(tmp_path / "auth")


def test_a_new_password_never_starts_with_a_dash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A role's password is passed as ``--log.password VALUE`` on command lines: one starting
    with "-" would be read as an option (token_urlsafe draws one in 64)."""
    drawn = iter(["-leading-dash", "no-leading-dash"] * len(ROLES))
    monkeypatch.setattr("eventlog.server.security.secrets.token_urlsafe", lambda n: next(drawn))
    security = ensure_log_security(tmp_path)
    for role in ROLES:
        assert security.roles[role].password.get_secret_value() == "no-leading-dash"

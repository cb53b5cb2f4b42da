"""An authenticated, encrypted log: a real nats-server with the generated users and TLS.

The CA, the server certificate and the role passwords are made by ``eventlog.server.security`` in
the test's temp dir; each role works through the real services (publisher, fold worker, reaper,
shard writer, live sink, policy bucket, image store) and is refused what it may not do. The
server's own log is the witness that a role's normal work needs nothing it is denied.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import os
import socket
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import nkeys
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from nats.aio.client import Client as NATS
from pydantic import SecretStr

from consumers import FoldWorker, FoldWorkerSettings, Reaper, ReaperSettings, fold
from consumers.config import ShardWriterSettings
from consumers.shard_writer import ShardWriter
from eventlog import (
    ImageRetention,
    JetStreamImageStore,
    JetStreamPublisher,
    LogSettings,
    PublisherSettings,
    connect,
)
from eventlog import provision as provision_log
from eventlog.connection import close_connection
from eventlog.errors import PublishForbidden
from eventlog.reader import read_range, read_session, read_session_messages, stored_msg_ids
from eventlog.server import LogSecurity, NatsServer, Role, ensure_log_security
from schemas import Codec, EventLogUnavailable, route
from shardstore import FileShardStore
from tests.helpers.services import shard_table_rows
from tests.helpers.sessions import RUN, append_only, session_events
from tests.helpers.streams import message_count, trajectories
from tests.helpers.waiting import eventually
from trainer_sink.sources import LiveSource, LiveSourceSettings

pytestmark = pytest.mark.integration

CODEC = Codec()  # events hold numpy arrays: compared by their encoding

FAST = LogSettings(ping_interval_s=0.5, connect_timeout_s=1.0, connect_wait_s=1.0)
# A refused publish gets no ack: the publisher waits this long once before it looks why.
FAST_PUBLISH = PublisherSettings(ack_timeout_s=0.5, max_attempts=2, backoff_initial_s=0.01)


@dataclass
class SecureLog:
    server: NatsServer
    security: LogSecurity
    log_start: int = 0  # where this test's part of the server's log begins

    def settings(self, role: Role) -> LogSettings:
        return self.security.client_settings(FAST, role)

    async def connect(self, role: Role) -> NATS:
        return await connect(self.server.url, self.settings(role), name=role)

    def server_log(self) -> str:
        """What the server logged since this test began."""
        with (self.server.store_dir / "nats-server.log").open("rb") as f:
            f.seek(self.log_start)
            return f.read().decode(errors="replace")

    def violations(self, user: str) -> list[str]:
        """What the server refused to ``user`` (it logs every permissions violation)."""
        lines = self.server_log().splitlines()
        return [line for line in lines if "Violation" in line and f'/user:{user}"' in line]


@pytest.fixture(scope="module")
def secure_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureLog]:
    root = tmp_path_factory.mktemp("secure-log")
    security = ensure_log_security(root / "nats-auth")
    server = NatsServer(root / "nats", extra_config=security.server_config(FAST.names))
    server.start()
    yield SecureLog(server, security)
    server.stop()


@pytest.fixture
async def secure(secure_server: SecureLog) -> AsyncIterator[SecureLog]:
    """The module's secure server with fresh streams, made by the admin user."""
    admin = await secure_server.connect("admin")
    js = admin.jetstream()
    for info in await js.streams_info():
        await js.delete_stream(info.config.name or "")
    await provision_log(js, FAST)
    await close_connection(admin)
    secure_server.log_start = (secure_server.server.store_dir / "nats-server.log").stat().st_size
    yield secure_server


@contextlib.asynccontextmanager
async def role(log: SecureLog, name: Role) -> AsyncIterator[tuple[NATS, JetStreamPublisher]]:
    nc = await log.connect(name)
    publisher = await JetStreamPublisher(nc, FAST_PUBLISH).start()
    try:
        yield nc, publisher
    finally:
        await publisher.close()
        await close_connection(nc)


# -- who may connect ------------------------------------------------------------------------


async def test_a_client_without_credentials_is_refused_and_told_what_to_pass(
    secure: SecureLog,
) -> None:
    anonymous = FAST.model_copy(update={"tls_ca": secure.security.ca_file})
    with pytest.raises(EventLogUnavailable, match="requires credentials and none were given"):
        await connect(secure.server.url, anonymous, name="anonymous")


async def test_a_wrong_password_is_refused_naming_the_user_and_the_settings(
    secure: SecureLog,
) -> None:
    guessed = secure.settings("worker").model_copy(update={"password": SecretStr("guess")})
    with pytest.raises(EventLogUnavailable) as refused:
        await connect(secure.server.url, guessed, name="guesser")
    assert "refused the credentials of user 'worker'" in str(refused.value)
    assert "--log.user and --log.password" in str(refused.value)


async def test_a_client_that_does_not_trust_the_ca_is_refused_before_sending_its_password(
    secure: SecureLog,
) -> None:
    untrusting = secure.settings("worker").model_copy(update={"tls_ca": None})
    with pytest.raises(EventLogUnavailable) as refused:
        await connect(secure.server.url, untrusting, name="untrusting")
    assert "TLS certificate" in str(refused.value) and "--log.tls-ca" in str(refused.value)
    assert "authentication error" not in secure.server_log()  # no password was sent


def test_a_plaintext_client_is_dropped_without_an_answer(secure_server: SecureLog) -> None:
    password = secure_server.security.roles["admin"].password.get_secret_value()
    address = (secure_server.server.host, secure_server.server.port)
    with socket.create_connection(address, timeout=5) as sock:
        reader = sock.makefile("rb")
        info = msgspec.json.decode(reader.readline().removeprefix(b"INFO "))
        assert info["tls_required"] is True and info["auth_required"] is True
        sock.sendall(b'CONNECT {"user":"admin","pass":"%s"}\r\nPING\r\n' % password.encode())
        assert reader.readline() == b""  # closed: no PONG, nothing served in clear


async def test_each_role_connects_and_checks_the_provisioned_streams(secure: SecureLog) -> None:
    for name in ("gateway", "worker", "trainer"):
        nc = await secure.connect(name)  # type: ignore[arg-type]
        try:
            actions = await provision_log(nc.jetstream(), FAST)
        finally:
            await close_connection(nc)
        assert {a.action for a in actions} == {"unchanged"}
        assert not secure.violations(name)


# -- what each role may do ------------------------------------------------------------------


async def test_the_worker_cannot_publish_turns_and_the_refusal_is_reported(
    secure: SecureLog,
) -> None:
    opened, turn, *_ = session_events(append_only(1), session="forged")
    async with role(secure, "worker") as (_, publisher):
        for event in (opened, turn):
            with pytest.raises(PublishForbidden, match=r"ts\.ev\.run-1\.forged\.(open|turn)"):
                await publisher.publish(event)
        assert publisher.stats.failed == 2 and publisher.stats.spooled == 0
    async with role(secure, "admin") as (admin, _):
        assert await message_count(admin.jetstream(), "EVENTS") == 0
    assert secure.violations("worker")  # the server refused it, not the client


async def test_the_gateway_writes_and_reads_turns_but_cannot_write_trajectories(
    secure: SecureLog,
) -> None:
    events = session_events(append_only(2), session="served")
    [trajectory] = fold(events).trajectories
    async with role(secure, "gateway") as (gateway, publisher):
        receipts = await publisher.publish_many(events)
        assert [r.seq for r in receipts] == list(range(1, len(events) + 1))
        # A session evicted from memory is read back from EVENTS (batched direct get).
        read_back = await read_session(gateway.jetstream(), RUN, "served")
        assert [CODEC.encode(e) for e in read_back] == [CODEC.encode(e) for e in events]
        assert not secure.violations("gateway")
        with pytest.raises(PublishForbidden, match=r"ts\.traj\.run-1"):
            await publisher.publish(trajectory)


async def test_the_gateway_follows_the_policy_the_trainer_writes(secure: SecureLog) -> None:
    update = msgspec.json.encode({"version": 3, "checkpoint": "/checkpoints/v3"})
    async with role(secure, "trainer") as (trainer, _), role(secure, "gateway") as (gateway, _):
        policy = await trainer.jetstream().key_value("ts_policy")
        await policy.put(RUN, update)
        watcher = await (await gateway.jetstream().key_value("ts_policy")).watch(RUN)
        try:
            entry = await watcher.updates(timeout=5.0)  # type: ignore[no-untyped-call]
        finally:
            await watcher.stop()  # type: ignore[no-untyped-call]
        assert entry is not None and entry.value == update
        assert not secure.violations("gateway") and not secure.violations("trainer")
        # The gateway only reads the policy: a put of its own is refused and never lands.
        read_only = await gateway.jetstream().key_value("ts_policy")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(read_only.put(RUN, b"{}"), 1.0)
        assert (await policy.get(RUN)).value == update
    assert any("$KV.ts_policy.run-1" in line for line in secure.violations("gateway"))


async def test_the_worker_role_runs_the_fold_the_reaper_and_the_shard_writer(
    secure: SecureLog, tmp_path: Path
) -> None:
    closed = session_events(append_only(3), session="finished")
    abandoned = session_events(append_only(2), session="abandoned", close=False)
    async with role(secure, "gateway") as (_, gateway):
        await gateway.publish_many(closed + abandoned)

    stop = asyncio.Event()
    async with role(secure, "worker") as (worker, publisher):
        js = worker.jetstream()
        fold_worker = FoldWorker(
            js, publisher, FoldWorkerSettings(ack_wait_s=5.0, fetch_timeout_s=0.2)
        )
        # The reaper closes the abandoned session: the one event a worker may write.
        reaper = Reaper(js, publisher, ReaperSettings(idle_timeout_s=1.0, scan_interval_s=0.2))
        writer = ShardWriter(
            js,
            publisher,
            FileShardStore(str(tmp_path)),
            ShardWriterSettings(max_age_s=0.3, fetch_timeout_s=0.2, ack_wait_s=5.0),
        )
        tasks = [asyncio.create_task(c.run(stop)) for c in (fold_worker, reaper, writer)]
        try:
            await eventually(lambda: len(shard_table_rows(tmp_path)) == 2, 30, "2 rows in shards")
        finally:
            stop.set()
            await asyncio.gather(*tasks)
        # What a redelivered fold asks before it republishes: an ephemeral scan of TRAJ.
        [want] = fold(closed).trajectories
        msg_id = route(want).msg_id
        since = datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=5)
        assert await stored_msg_ids(js, "TRAJ", f"ts.traj.{RUN}", {msg_id}, since=since) == {msg_id}

    status = {row["session"]: row["status"] for row in shard_table_rows(tmp_path)}
    assert status == {"finished": "completed", "abandoned": "timeout"}
    assert not secure.violations("worker")
    async with role(secure, "admin") as (admin, _):
        found = await trajectories(admin.jetstream())
        assert sorted(t.session for t in found) == ["abandoned", "finished"]
        marker = await (await admin.jetstream().key_value("ts_folded")).get(f"{RUN}.finished")
        assert marker.value


async def test_the_trainer_reads_trajectories_and_nothing_else(secure: SecureLog) -> None:
    events = session_events(append_only(2), session="learned")
    [trajectory] = fold(events).trajectories
    async with role(secure, "gateway") as (_, gateway):
        await gateway.publish_many(events)
    async with role(secure, "worker") as (_, worker):
        await worker.publish(trajectory)

    source = await LiveSource.connect(
        secure.server.url,
        LiveSourceSettings(durable="trainer-secure", ack_wait_s=5.0),
        log_settings=secure.settings("trainer"),
        run=RUN,
    )
    try:
        received = []
        for _ in range(20):
            received += await source.receive(10, 0.5) or []
            if received:
                break
        assert [CODEC.encode(r.trajectory) for r in received] == [CODEC.encode(trajectory)]
        await source.ack(received)
    finally:
        await source.close()

    async with role(secure, "trainer") as (trainer, publisher):
        # A replay of TRAJ by sequence (an ordered consumer) is the trainer's too.
        [replayed] = [m async for m in read_range(trainer.jetstream(), "TRAJ", "ts.traj.>", 1, 1)]
        assert replayed.msg_id == route(trajectory).msg_id
        assert not secure.violations("trainer")
        with pytest.raises(PublishForbidden, match=r"ts\.ev\.run-1\.learned"):
            await publisher.publish(events[1])
        with pytest.raises(EventLogUnavailable):  # EVENTS are not the trainer's to read
            await read_session_messages(trainer.jetstream(), RUN, "learned", timeout_s=0.5)
    assert any("DIRECT.GET.EVENTS" in line for line in secure.violations("trainer"))


async def test_the_gateway_stores_images_and_every_role_reads_them(secure: SecureLog) -> None:
    screenshot = os.urandom(200 * 1024)  # two chunks: a read follows them with a consumer
    async with role(secure, "gateway") as (gateway, _):
        images = await JetStreamImageStore.open(gateway, secure.settings("gateway"))
        digest = await images.put(screenshot)
        assert await images.put(screenshot) == digest  # looked up, not uploaded again
        assert await images.get(digest) == screenshot
        # A refresh re-uploads and purges the chunks it replaces: the gateway's too.
        old = ImageRetention(ttl_s=60.0, refresh_after_s=0.0)
        raw = await gateway.jetstream().object_store(images.bucket)
        await JetStreamImageStore(gateway, raw, images.bucket, old).put(screenshot)
        assert await images.digests() == [digest]
    readers: tuple[Role, ...] = ("worker", "trainer")
    for name in readers:
        async with role(secure, name) as (reader, _):
            images = await JetStreamImageStore.open(reader, secure.settings(name))
            assert await images.get(digest) == screenshot
            assert await images.has(digest) and await images.digests() == [digest]
    for name in ("gateway", "worker", "trainer"):
        assert not secure.violations(name)

    async with role(secure, "worker") as (worker, _):
        # A refused publish gets no answer: each waits out its timeout (nats-py's put purges
        # its chunks after the refusal, refused too).
        images = await JetStreamImageStore.open(worker, secure.settings("worker"), 30.0, 1.0)
        with pytest.raises(PublishForbidden, match="ts_images"):
            await images.put(b"a forged screenshot")  # only gateways store images
    assert any("$O.ts_images" in line for line in secure.violations("worker"))


# -- other ways to log in ---------------------------------------------------------------------


@contextlib.contextmanager
def _server(root: Path, config: str) -> Iterator[NatsServer]:
    server = NatsServer(root, extra_config=config).start()
    try:
        yield server
    finally:
        server.stop()


async def test_a_token_and_an_nkey_log_in_and_a_wrong_one_is_refused(tmp_path: Path) -> None:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    public = nkeys.from_seed(bytearray(seed)).public_key.decode()
    (tmp_path / "user.nk").write_bytes(seed)
    other = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    (tmp_path / "other.nk").write_bytes(other)

    config = f'authorization {{ users: [ {{ nkey: "{public}" }} ] }}'
    with _server(tmp_path / "nkey", config) as server:
        nc = await connect(server.url, FAST.model_copy(update={"nkey_seed": tmp_path / "user.nk"}))
        await close_connection(nc)
        wrong = FAST.model_copy(update={"nkey_seed": tmp_path / "other.nk"})
        with pytest.raises(EventLogUnavailable, match=r"refused the credentials in .*other\.nk"):
            await connect(server.url, wrong)

    with _server(tmp_path / "token", 'authorization { token: "s3cret" }') as server:
        nc = await connect(server.url, FAST.model_copy(update={"token": SecretStr("s3cret")}))
        await close_connection(nc)
        wrong = FAST.model_copy(update={"token": SecretStr("guess")})
        with pytest.raises(EventLogUnavailable, match=r"credentials of the token.*--log\.token"):
            await connect(server.url, wrong)


def _client_certificate(security: LogSecurity, directory: Path) -> tuple[Path, Path]:
    """A client certificate signed by the test's CA (mutual TLS)."""
    ca_key = serialization.load_pem_private_key(
        (security.directory / "ca-key.pem").read_bytes(), password=None
    )
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    ca = x509.load_pem_x509_certificate(security.ca_file.read_bytes())
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "worker-1")]))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_path, key_path = directory / "client-cert.pem", directory / "client-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


async def test_a_server_that_verifies_clients_takes_the_client_certificate(
    tmp_path: Path,
) -> None:
    security = ensure_log_security(tmp_path / "auth")
    cert, key = _client_certificate(security, tmp_path)
    config = (
        f'tls {{ cert_file: "{security.cert_file}", key_file: "{security.key_file}", '
        f'ca_file: "{security.ca_file}", verify: true }}'
    )
    trusting = FAST.model_copy(update={"tls_ca": security.ca_file})
    with _server(tmp_path / "mtls", config) as server:
        with_cert = trusting.model_copy(update={"tls_cert": cert, "tls_key": key})
        nc = await connect(server.url, with_cert, name="with-cert")
        assert nc.is_connected
        await close_connection(nc)
        with pytest.raises(EventLogUnavailable, match=r"--log\.tls-cert"):
            await connect(server.url, trusting, name="without-cert")

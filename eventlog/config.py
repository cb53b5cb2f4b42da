"""Settings of the event log: connection, streams, buckets, publisher (plain pydantic models).

The composition root (``turnstream.stack.settings``) nests these in each service's settings, so they
are filled from CLI flags, ``TURNSTREAM_*`` env vars or a TOML file; nothing here reads the
environment.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

__all__ = [
    "ConsumerSettings",
    "LogSettings",
    "PublisherSettings",
    "StreamNames",
    "check_retry_horizon",
]

MiB = 1024 * 1024
DAY = 86_400.0


class StreamNames(BaseModel):
    """Names of the streams and KV buckets turnstream provisions."""

    model_config = ConfigDict(frozen=True)

    events: str = "EVENTS"
    trajectories: str = "TRAJ"
    dead_letters: str = "DLQ"
    policy_bucket: str = "ts_policy"  # PolicyUpdated: weight_version per run
    sessions_bucket: str = "ts_sessions"  # reaper: last activity per open session
    folded_bucket: str = "ts_folded"  # fold worker: markers of sessions already folded
    commits_bucket: str = "ts_commits"  # live sinks: TRAJ sequences each durable committed
    images_bucket: str = "ts_images"  # object store: images of turns by SHA-256 (OBJ_ts_images)


class LogSettings(BaseModel):
    """Where the log is and how its streams are configured."""

    model_config = ConfigDict(frozen=True)

    url: str | None = Field(
        None, description="NATS URL(s), comma separated; unset: start an embedded nats-server"
    )
    store_dir: Path | None = Field(
        None, description="embedded server JetStream store; unset: <data_dir>/nats"
    )
    port: int = Field(0, ge=0, le=65535, description="embedded server port; 0 picks a free one")
    max_payload: int = Field(8 * MiB, gt=0, description="largest event in bytes (server and codec)")
    sync_always: bool = Field(
        False, description="embedded server fsyncs every write (survives power loss, slower)"
    )
    replicas: int = Field(1, ge=1, le=5, description="stream replicas (3 on a cluster)")
    duplicate_window_s: float = Field(
        120.0, gt=0, description="JetStream dedup window; must exceed the publisher retry horizon"
    )
    events_max_age_s: float = Field(30 * DAY, ge=0, description="EVENTS retention; 0 = forever")
    events_max_bytes: int = Field(-1, description="EVENTS size cap in bytes; -1 = unlimited")
    trajectories_max_age_s: float = Field(30 * DAY, ge=0, description="TRAJ retention; 0 = forever")
    trajectories_max_bytes: int = Field(-1, description="TRAJ size cap in bytes; -1 = unlimited")
    images_max_bytes: int = Field(
        -1,
        description="image bucket size cap in bytes; -1 = unlimited (kept 2x events_max_age_s "
        "after upload); a cap is reserved on the server's store up front",
    )
    dead_letters_max_age_s: float = Field(90 * DAY, ge=0, description="DLQ retention")
    session_idle_ttl_s: float = Field(7 * DAY, ge=0, description="TTL of reaper session entries")
    folded_marker_ttl_s: float = Field(30 * DAY, ge=0, description="TTL of fold markers")
    commit_record_ttl_s: float = Field(
        DAY,
        gt=0,
        description="TTL of a live sink's commit records (needed only until the "
        "consumer's own ack state is on disk, milliseconds later)",
    )
    ping_interval_s: float = Field(2.0, gt=0, description="client ping; a hung server is noticed")
    max_outstanding_pings: int = Field(2, ge=1, description="unanswered pings before reconnect")
    connect_timeout_s: float = Field(2.0, gt=0, description="per connection attempt")
    connect_wait_s: float = Field(
        5.0, gt=0, description="how long the first connect keeps trying before it fails"
    )
    # -- who this client is and how it checks the server (eventlog.server.security makes both) --
    user: str | None = Field(None, description="NATS user name (with --log.password)")
    password: SecretStr | None = Field(None, description="password of --log.user")
    token: SecretStr | None = Field(None, description="NATS authorization token (no user)")
    nkey_seed: Path | None = Field(
        None, description="file holding an NKey user seed (SU...), for nkey users"
    )
    creds: Path | None = Field(
        None, description=".creds file (user JWT + NKey seed, from nsc) for operator-mode NATS"
    )
    tls_ca: Path | None = Field(
        None,
        description="CA certificate(s), PEM, the server's certificate must chain to "
        "(unset: the system's CAs); TLS itself is the server's to require, as --log.secure's does",
    )
    tls_cert: Path | None = Field(
        None, description="client certificate, PEM, for servers that verify clients (mutual TLS)"
    )
    tls_key: Path | None = Field(None, description="private key of --log.tls-cert, PEM")
    tls_server_name: str | None = Field(
        None, description="name the server's certificate must carry; unset: the URL's host"
    )
    secure: bool = Field(
        False,
        description="embedded server only: require TLS and a user per role (admin, gateway, "
        "worker, trainer), made under --log.auth-dir on first use and reused after",
    )
    auth_dir: Path | None = Field(
        None,
        description="--log.secure's CA, certificates and role credentials; "
        "unset: <data_dir>/nats-auth",
    )

    names: StreamNames = StreamNames()

    @model_validator(mode="after")
    def _credentials_make_sense(self) -> LogSettings:
        given = [
            flag
            for flag, value in (
                ("--log.user", self.user),
                ("--log.token", self.token),
                ("--log.nkey-seed", self.nkey_seed),
                ("--log.creds", self.creds),
            )
            if value is not None
        ]
        if len(given) > 1:
            raise ValueError(
                f"{' and '.join(given)} are different ways to log in to NATS: give one"
            )
        if (self.user is None) != (self.password is None):
            raise ValueError("--log.user and --log.password go together: give both or neither")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "--log.tls-cert and --log.tls-key go together: a client certificate is "
                "useless without its key"
            )
        if self.secure and self.url is not None:
            raise ValueError(
                "--log.secure sets up the embedded server; to join a server at --log.url, "
                "give its credentials (--log.user/--log.password, --log.tls-ca) instead"
            )
        if self.secure and given:
            raise ValueError(
                f"--log.secure makes the embedded stack connect as its generated admin user; "
                f"leave {', '.join(given)} unset"
            )
        return self


class PublisherSettings(BaseModel):
    """How events are published: ack timeout, retries, pipelining, the on-disk outbox."""

    model_config = ConfigDict(frozen=True)

    ack_timeout_s: float = Field(2.0, gt=0, description="wait for one JetStream ack")
    max_attempts: int = Field(4, ge=1, description="tries with the same Msg-Id before spooling")
    backoff_initial_s: float = Field(0.05, ge=0, description="first retry delay, doubled each try")
    backoff_max_s: float = Field(1.0, ge=0, description="cap on one retry delay")
    max_inflight_bytes: int = Field(32 * MiB, gt=0, description="pipelined publishes in flight")
    outbox_path: Path | None = Field(
        None, description="append-only outbox file for events the log could not take; unset: off"
    )
    outbox_max_bytes: int = Field(256 * MiB, gt=0, description="outbox size; full -> 503")
    outbox_drain_interval_s: float = Field(1.0, gt=0, description="outbox drain retry period")

    @property
    def retry_horizon_s(self) -> float:
        """Longest time between the first and the last try of one event."""
        delays = sum(
            min(self.backoff_initial_s * 2**i, self.backoff_max_s)
            for i in range(self.max_attempts - 1)
        )
        return float(self.max_attempts * self.ack_timeout_s + delays)

    @model_validator(mode="after")
    def _backoff_order(self) -> PublisherSettings:
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        return self


def check_retry_horizon(log: LogSettings, publisher: PublisherSettings) -> None:
    """Retries reuse the Msg-Id; they are only deduplicated inside the stream's window."""
    if log.duplicate_window_s <= publisher.retry_horizon_s:
        raise ValueError(
            f"log.duplicate_window_s={log.duplicate_window_s}s must exceed the publisher's retry "
            f"horizon of {publisher.retry_horizon_s:g}s (max_attempts x ack_timeout_s + "
            f"backoff), or a retried event could be stored twice"
        )


class ConsumerSettings(BaseModel):
    """A durable pull consumer's flags: how much is in flight, how long before a redelivery.

    ``eventlog.pull.ConsumerSpec.of`` makes the consumer these describe (stream and filter are
    the service's to say)."""

    model_config = ConfigDict(frozen=True)

    durable: str = Field(description="durable consumer name, shared by every process of the kind")
    batch: int = Field(32, ge=1, description="messages per fetch (never above max_ack_pending)")
    max_ack_pending: int = Field(256, ge=1, description="delivered, not yet acked, per consumer")
    ack_wait_s: float = Field(30.0, gt=0, description="redelivery after this without ack/progress")
    max_deliver: int = Field(
        10, ge=-1, description="deliveries before a message is dead-lettered; -1: never give up"
    )
    backoff_s: tuple[float, ...] = Field(
        (1.0, 5.0, 30.0, 60.0), description="nak delays for retries, one per delivery, last repeats"
    )
    fetch_timeout_s: float = Field(1.0, gt=0, description="longest wait of one fetch")

    @model_validator(mode="after")
    def _max_deliver_valid(self) -> ConsumerSettings:
        if self.max_deliver in (0, 1):
            raise ValueError("max_deliver must be -1 (never give up) or at least 2")
        return self

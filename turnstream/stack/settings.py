"""Settings of every turnstream command: CLI flags > ``TURNSTREAM_*`` env > TOML file > defaults.

One pydantic-settings model per service, built at the entry point and passed down; nothing
below the entry point reads the environment. Nested fields use ``__`` in env vars and ``.`` in
flags: ``TURNSTREAM_LOG__URL`` is ``--log.url``. A TOML file (``--config PATH`` or
``TURNSTREAM_CONFIG``) has the same shape::

    data_dir = "data"
    [log]
    url = "nats://localhost:4222"
    [publisher]
    ack_timeout_s = 2.0
"""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

from pydantic import Field, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from eventlog import LogSettings, PublisherSettings, check_retry_horizon
from schemas.ids import ID_PATTERN

__all__ = ["PublishingSettings", "ServiceSettings", "with_toml"]

S = TypeVar("S", bound="ServiceSettings")


class ServiceSettings(BaseSettings):
    """What every command shares: where data lives, which run, the log."""

    model_config = SettingsConfigDict(
        env_prefix="TURNSTREAM_",
        env_nested_delimiter="__",
        frozen=True,
        extra="ignore",
        cli_kebab_case=True,
        cli_implicit_flags=True,
        cli_avoid_json=True,
    )

    data_dir: Path = Field(Path("data"), description="root of everything turnstream writes")
    run: str = Field("default", pattern=f"^{ID_PATTERN}$", description="run id for new sessions")
    log: LogSettings = LogSettings()

    @property
    def nats_store_dir(self) -> Path:
        """The embedded server's JetStream store: ``log.store_dir``, else ``<data_dir>/nats``."""
        return self.log.store_dir or self.data_dir / "nats"

    @property
    def nats_auth_dir(self) -> Path:
        """``--log.secure``'s CA, certificates, role credentials: ``log.auth_dir``, else
        ``<data_dir>/nats-auth``."""
        return self.log.auth_dir or self.data_dir / "nats-auth"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The CLI source, when parsing a command line, is put ahead of these by CliApp.
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))


class PublishingSettings(ServiceSettings):
    """A command that publishes to the log: the publisher's retries and outbox too."""

    publisher: PublisherSettings = PublisherSettings()

    @model_validator(mode="after")
    def _retry_horizon_inside_dedup_window(self) -> PublishingSettings:
        check_retry_horizon(self.log, self.publisher)
        return self


def with_toml(settings_cls: type[S], path: Path | None) -> type[S]:
    """``settings_cls`` reading ``path`` as its TOML layer (or unchanged when None)."""
    if path is None:
        return settings_cls
    if not path.is_file():
        raise FileNotFoundError(
            f"config file {path} does not exist (from --config or TURNSTREAM_CONFIG)"
        )
    config = SettingsConfigDict(**{**settings_cls.model_config, "toml_file": path})
    return type(settings_cls.__name__, (settings_cls,), {"model_config": config})

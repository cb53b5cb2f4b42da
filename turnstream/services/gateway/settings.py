"""``turnstream gateway``'s settings: where it listens, the backend, the limits, its workers.

``GatewaySettings`` is also what ``up`` extends and what ``replay --regenerate`` builds a
gateway's backend from. Two of its answers do I/O: ``served`` asks a remote backend for its
model's name and context length when they are not given, and ``model_dir`` makes the built-in
tiny model on first use.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Annotated, Literal

import httpx
from pydantic import Field, field_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from gateway.backends.transport import Target
from gateway.images import (
    DEFAULT_FETCH_TIMEOUT_S,
    DEFAULT_MAX_IMAGE_BYTES,
    DEFAULT_MAX_IMAGE_PIXELS,
    DEFAULT_MAX_IMAGES,
    ImageLimits,
    parse_host_rule,
)
from gateway.serving.model_names import parse_model_aliases
from schemas.errors import TurnstreamError
from turnstream.stack.settings import PublishingSettings

__all__ = ["GatewaySettings"]

log = logging.getLogger(__name__)
TINY_VL = "tiny-vl"  # --model's name for the built-in tiny vision-language model


def _listed(specs: object) -> object:
    """A list setting read from a flag, env var or TOML entry, each of which may hold several
    items, comma separated (the CLI joins a repeated flag that way); a JSON list is taken too.
    Checked here, so a bad item stops the gateway before anything starts."""
    if isinstance(specs, str):
        text = specs.strip()
        specs = json.loads(text) if text.startswith("[") else [specs]
    if not isinstance(specs, list):
        return specs  # pydantic names the type it wanted
    return [part.strip() for spec in specs for part in str(spec).split(",") if part.strip()]


class GatewaySettings(PublishingSettings):
    """Run the OpenAI-compatible gateway; every turn is published to the log before it answers."""

    model_config = SettingsConfigDict(cli_prog_name="turnstream gateway")

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="port to listen on")
    backend: Literal["local", "vllm", "sglang"] = Field("local", description="inference backend")
    backend_urls: list[str] = Field(
        default_factory=list, description="vllm/sglang replica URLs (sticky, least-loaded)"
    )
    model: Path | None = Field(
        None,
        description="local HF model dir (tokenizer + chat template; weights for local); "
        "unset: the built-in tiny model, created on first use; 'tiny-vl': the built-in tiny "
        "vision-language model (Qwen2-VL), created on first use",
    )
    model_name: str | None = Field(
        None,
        description="model name reported to clients (and sent to vllm/sglang); unset: the one "
        "the backend's /v1/models lists, else the model dir's name",
    )
    # NoDecode: the env var is read as the flag is, PATTERN=NAME,PATTERN=NAME (JSON too).
    model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="requested model names answered by the served model: PATTERN=NAME, comma "
        "separated or the flag repeated, PATTERN a glob (e.g. 'claude-*=Qwen3-8B,gpt-*=Qwen3-8B' "
        "for Claude Code's and Codex's default names), NAME the served model's; the first "
        "matching pattern wins, the served name always matches",
    )
    tool_parser: str = Field("hermes", description="tool-call format the model writes")
    api_keys: list[str] = Field(
        default_factory=list,
        description="bearer keys: KEY (every run) or KEY=RUN1,RUN2 (only those runs); "
        "empty: no auth",
    )
    metrics_auth: bool = Field(False, description="/metrics needs a key too (with --api-keys)")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024, description="request body limit")
    body_timeout_s: float = Field(30.0, gt=0, description="deadline to receive a request body")
    max_json_depth: int = Field(64, ge=4, le=512, description="deepest JSON nesting accepted")
    max_image_bytes: int = Field(
        DEFAULT_MAX_IMAGE_BYTES,
        ge=1,
        description="largest image accepted, in bytes (an inline one also counts, as base64, "
        "against --max-body-bytes)",
    )
    max_image_pixels: int = Field(
        DEFAULT_MAX_IMAGE_PIXELS,
        ge=1,
        le=89_478_485,  # Pillow's own decompression-bomb threshold, which stays as it is
        description="largest image accepted, in pixels (width x height), checked before it is "
        "decoded; default: 8K UHD",
    )
    max_images: int = Field(DEFAULT_MAX_IMAGES, ge=1, description="images in one request")
    # NoDecode: the env var is read as the flag is, HOST,HOST:PORT,*.DOMAIN (JSON too).
    image_url_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="hosts whose http(s) image URLs the gateway fetches: HOST, HOST:PORT, "
        "*.DOMAIN or *.DOMAIN:PORT (no port: the scheme's default), comma separated or the flag "
        "repeated; empty: remote image URLs are refused (a server fetching a client's URL is a "
        "request forgery risk), images are sent inline",
    )
    image_fetch_timeout_s: float = Field(
        DEFAULT_FETCH_TIMEOUT_S, gt=0, description="deadline of one image URL's whole fetch"
    )
    kept_body_bytes: int = Field(
        256 * 1024 * 1024,
        ge=0,
        description="bytes of request bodies kept, each client session's last of 64 KiB or more, "
        "so that its next request decodes only what it adds to the conversation; 0: off",
    )
    max_open_sessions: int = Field(
        10_000,
        ge=1,
        description="sessions held in memory; the least recently used beyond it are evicted "
        "(and recovered from the log on their next request)",
    )
    session_turns_kept: int = Field(
        64,
        ge=1,
        description="turns of a session kept continuable token for token (its conversations' "
        "tips and their history); the least recently used beyond it are forgotten",
    )
    session_tokens_kept: int = Field(
        1 << 20,
        ge=1,
        description="tokens a session's kept turns may hold together (a chain of turns holds "
        "one array: its tip's); the least recently used turns beyond it are forgotten",
    )
    closed_session_grace_s: float = Field(
        60.0, ge=0, description="how long a closed session stays in memory"
    )
    allow_raw_logprobs: bool = Field(
        False,
        description="serve a sampling other than temperature 1 / top_p 1 on a vLLM replica in its "
        "default (raw) --logprobs-mode, recording its turns as logprobs_kind 'raw' (the trainer "
        "refuses them for importance ratios); off: such a turn is a 400 naming "
        "--logprobs-mode processed_logprobs",
    )
    max_concurrency: int = Field(4, ge=1, description="local backend: concurrent generations")
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="local backend: torch intra-op threads; unset: 1 for models "
        "under 100M parameters (thread hand-offs cost more than they save), else torch's default",
    )
    max_inflight_per_replica: int = Field(32, ge=1, description="remote: requests per replica")
    max_context: int | None = Field(
        None, description="remote: context length of the model; unset: its max_model_len"
    )
    backend_wait_s: float = Field(
        120.0, ge=0, description="remote: how long to wait for the backend's /v1/models at start"
    )
    session_idle_sync_s: float = Field(
        1.0,
        ge=0,
        description="a session this gateway has not heard of from the log for this long is "
        "caught up on the log before its next turn (turns or a close another gateway or the "
        "reaper stored); 0: before every turn",
    )
    continue_wait_s: float = Field(
        120.0,
        ge=0,
        le=3600,
        description="a generation the backend aborts mid-turn (a trainer pausing it for a weight "
        "update) is continued with its tokens so far once the backend takes work again; the turn "
        "waits this long for that in all, then answers 503 with Retry-After and records nothing; "
        "0: never continue",
    )
    max_versions_per_turn: int = Field(
        4,
        ge=1,
        le=1000,
        description="policy versions one turn's tokens may span (continued across weight "
        'updates); a turn that would span more ends there, with finish_reason "version_limit" '
        'recorded ("length" to the client)',
    )
    instance_id: str | None = Field(
        None,
        description="this gateway's name among a fleet's on one log, mixed into the seeds it "
        "derives so that two gateways never derive one; unset: <hostname>:<port> "
        "(--workers: /<worker> appended)",
    )
    workers: int = Field(
        1,
        ge=1,
        le=256,
        description="gateway processes on the one port (--worker-routing says which serves a "
        "request); --max-open-sessions is their total",
    )
    worker_routing: Literal["owner", "any"] = Field(
        "owner",
        description="--workers N > 1: owner: each session's requests are served by the worker "
        "that holds it (the connection moves to it, no proxy hop); any: each worker accepts "
        "on its own SO_REUSEPORT socket and serves every session, catching up from the log "
        "when its copy is behind",
    )

    @property
    def reuses_port(self) -> bool:
        """Whether the port is bound with SO_REUSEPORT: ``--worker-routing any``'s workers each
        listen on a socket of their own there, and the kernel spreads connections over them."""
        return self.workers > 1 and self.worker_routing == "any"

    @field_validator("model_aliases", mode="before")
    @classmethod
    def _alias_specs(cls, specs: object) -> object:
        specs = _listed(specs)
        if isinstance(specs, list):
            parse_model_aliases(specs)  # a ValueError names a bad one
        return specs

    @field_validator("image_url_hosts", mode="before")
    @classmethod
    def _image_hosts(cls, specs: object) -> object:
        specs = _listed(specs)
        if isinstance(specs, list):
            for host in specs:
                parse_host_rule(host)  # a ValueError names a bad one
        return specs

    @property
    def image_limits(self) -> ImageLimits:
        """What the API adapters accept of a request's images (``gateway.images``)."""
        return ImageLimits(
            max_bytes=self.max_image_bytes,
            max_pixels=self.max_image_pixels,
            max_images=self.max_images,
            url_hosts=tuple(self.image_url_hosts),
            fetch_timeout_s=self.image_fetch_timeout_s,
        )

    @field_validator("backend_urls")
    @classmethod
    def _http_urls(cls, urls: list[str]) -> list[str]:
        for url in urls:
            try:
                Target(url)  # what the backends parse it with
            except (httpx.InvalidURL, httpx.UnsupportedProtocol) as exc:
                raise ValueError(
                    f"{url!r} is not an http:// or https:// URL of a vLLM or SGLang server "
                    f"(e.g. http://127.0.0.1:8001): {exc}"
                ) from None
        return urls

    async def served(self) -> GatewaySettings:
        """These settings with ``model_name`` and ``max_context`` asked of a remote backend
        when unset (``gateway.backends.served_model``)."""
        if self.backend == "local" or (self.model_name and self.max_context):
            return self
        if not self.backend_urls:
            raise TurnstreamError(f"--backend {self.backend} needs --backend-urls URL [URL ...]")
        from gateway.backends.served_model import served_model

        model = await served_model(self.backend_urls, wait_s=self.backend_wait_s)
        max_context = self.max_context or model.max_context
        if max_context is None:
            raise TurnstreamError(
                f"the backend at {self.backend_urls[0]} does not say its context length "
                f"(max_model_len): pass --max-context"
            )
        log.info("backend serves %r, context %d tokens", model.name, max_context)
        return self.model_copy(
            update={"model_name": self.model_name or model.name, "max_context": max_context}
        )

    @property
    def model_dir(self) -> Path:
        if self.model is not None and self.model == Path(TINY_VL) and not self.model.exists():
            from gateway.model import ensure_tiny_vl_model

            return ensure_tiny_vl_model(self.data_dir / "models")
        if self.model is not None:
            return self.model
        try:
            from gateway.model import ensure_tiny_model
        except ImportError as exc:
            raise TurnstreamError(
                f"no --model given, and the built-in tiny model needs torch to be made ({exc}): "
                f"pass --model DIR (the served model's tokenizer and chat template), or pip "
                f"install 'turnstream[local]'"
            ) from exc
        return ensure_tiny_model(self.data_dir / "models")

"""The events of the log (DESIGN §3) as typed msgspec structs.

Token ids and logprobs are numpy arrays (int32 / float32); the codec carries them as raw
little-endian bytes, so no per-token Python object is ever made. Constructing an event accepts
any array-like and converts it once; decoding checks every array's dtype and length.

Why msgspec and not pydantic here: these structs are decoded on the hot path (every turn the
gateway publishes, every event a fold worker rehydrates). msgspec decodes msgpack straight into
typed structs with path-naming errors, ignores unknown fields, and is several times faster than
validating dicts; pydantic stays the tool for settings and HTTP bodies.
"""

from __future__ import annotations

from typing import Any, Literal, TypeGuard

import msgspec
import numpy as np
import numpy.typing as npt

from schemas.ids import validate_id
from schemas.images import ImageRef
from schemas.spans import generated_runs, token_arrays

SCHEMA_VERSION = 1
# The per-token ``versions`` of a generated token whose policy version the gateway could not
# know (``TurnCompleted.version_spans``: null); -1 marks tokens that were not generated.
UNKNOWN_VERSION = -2

Int32Array = npt.NDArray[np.int32]
Float32Array = npt.NDArray[np.float32]
Int8Array = npt.NDArray[np.int8]

SessionStatus = Literal["completed", "aborted", "truncated", "timeout"]
TrajectoryStatus = Literal["completed", "aborted", "truncated", "timeout", "open"]
JSON = dict[str, Any]


def as_array(value: object, dtype: str, field: str) -> np.ndarray:
    """Return ``value`` as a contiguous 1-D little-endian array of ``dtype``.

    Arrays already of that dtype pass through without a copy (the decode path). Lists and
    arrays of a compatible kind are converted once; anything else is a ValueError naming
    the field.
    """
    want = np.dtype(dtype)
    if isinstance(value, np.ndarray) and value.dtype == want and value.ndim == 1:
        return value if value.flags.c_contiguous else np.ascontiguousarray(value)
    try:
        arr = np.asarray(value)
        if arr.ndim != 1 and arr.size == 0:
            arr = arr.reshape(0)
        if arr.ndim != 1:
            raise ValueError(f"{field} must be 1-D, got shape {arr.shape}")
        if arr.size == 0:
            return np.empty(0, dtype=want)
        return np.ascontiguousarray(arr.astype(want, casting="same_kind"))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{field} must be a 1-D array of {want.name}: {exc}") from exc


class _Event(msgspec.Struct, kw_only=True, tag_field="type"):
    """Common envelope: schema version, run, session and the time the event was made."""

    v: int = SCHEMA_VERSION
    run: str
    session: str
    created_at: float = 0.0

    def __post_init__(self) -> None:
        validate_id(self.run, "run")
        validate_id(self.session, "session")


class SessionOpened(_Event, tag="SessionOpened", kw_only=True):
    group: str | None = None  # GRPO prompt id: samples of one group are compared
    metadata: JSON = msgspec.field(default_factory=dict)  # task, env, anything the agent sets
    model: str = ""


class TurnCompleted(_Event, tag="TurnCompleted", kw_only=True):
    """One completion turn, with its prompt delta-encoded against its parent turn.

    A session is a tree (DESIGN §5): turn t's parent p (``parent``) is the turn it continues, or
    shares the longest prefix with, as the gateway chose it. Full prompt of turn t =
    full_context(p)[:prefix_len] + prompt_ids, where full_context(p) = full prompt of turn p +
    its completion_ids; a turn with no parent (p = -1) has prefix_len 0. Messages follow the same
    rule: the conversation of turn t is messages(p) + [assistant reply of p] truncated to
    message_prefix_len, + new_messages; ``tools`` None means "as turn p's".
    """

    turn: int
    # The turn this one's delta is taken against (and continues when its prompt starts with that
    # turn's whole context). None in events older than the field: the previous turn. -1: none.
    parent_turn: int | None = None
    prefix_len: int = 0
    prompt_ids: np.ndarray  # int32: the prompt tokens after the shared prefix
    completion_ids: np.ndarray  # int32: exactly the tokens the model sampled
    logprobs: np.ndarray  # float32, one per completion token
    message_prefix_len: int = 0
    new_messages: list[JSON] = msgspec.field(default_factory=list)
    tools: list[JSON] | None = None  # only when changed: None = as the previous turn, [] = none
    sampling: JSON = msgspec.field(default_factory=dict)
    finish_reason: str = "stop"
    text: str = ""
    tool_calls: list[JSON] = msgspec.field(default_factory=list)
    weight_version: int = 0
    template_hash: str = ""
    backend: str = ""
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    usage: dict[str, int] = msgspec.field(default_factory=dict)
    # How the turn was asked for: the API that carried it ("chat.completions", "messages",
    # "responses", "completions") and its parameters as the client set them (see
    # gateway.core.conversation.TurnRequest.record); {} in events older than the field.
    request: JSON = msgspec.field(default_factory=dict)
    # Whose distribution ``logprobs`` are: "sampled", the one each token was drawn from (after
    # temperature and top-p); "raw", not that one: the model's untempered distribution (a vLLM
    # server in its default --logprobs-mode) or a tempered but untruncated one (SGLang under
    # top_p < 1). Recorded only under the gateway's --allow-raw-logprobs.
    logprobs_kind: str = "sampled"
    # The per-request id every id the client saw derives from (response, message and completion
    # ids: ``chatcmpl-<session>-<reply_id>``), made before the turn index is known (turns of one
    # session run concurrently; the index is assigned at append). "" in events older than the
    # field: their ids used the turn index, which stands in for it (``TurnCompleted.reply``).
    reply_id: str = ""
    # Who asked for the turn, as its client said and as the gateway resolved it against the
    # tokens (gateway.core.agents.AgentIdentity.record, plus the resolution): {} when the client
    # sent no agent identity.
    agent: JSON = msgspec.field(default_factory=dict)
    # The client went away before the reply was whole (a closed stream, Codex `exec` exiting
    # mid-sub-agent): the backend finished the turn and it is recorded, but the client never saw
    # it, so no later turn continues it.
    client_gone: bool = False
    # Each completion token's policy version, run-length: [version, count] pairs in order, the
    # counts summing to the completion's length; version null where it cannot be known (a
    # generation frozen across a weight swap by a backend that does not say which tokens came
    # after it). None (events older than the field, and every turn sampled by one version):
    # every token at ``weight_version``. A turn the backend aborted and the gateway continued
    # (DESIGN §4) has one pair per version; ``weight_version`` is then the oldest known one.
    version_spans: list[tuple[int | None, int]] | None = None
    # The images whose placeholder tokens lie in ``prompt_ids`` (the part after the shared
    # prefix), in order, offsets counted in the full prompt (schemas.images): the full prompt's
    # images are the parent's inside the prefix + these (``schemas.images.prompt_images``).
    # Their bytes are in the log's object store under their digest. [] in text-only turns.
    images: list[ImageRef] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.prompt_ids = as_array(self.prompt_ids, "<i4", "prompt_ids")
        self.completion_ids = as_array(self.completion_ids, "<i4", "completion_ids")
        self.logprobs = as_array(self.logprobs, "<f4", "logprobs")
        if self.turn < 0 or self.prefix_len < 0 or self.message_prefix_len < 0:
            raise ValueError("turn, prefix_len and message_prefix_len must be >= 0")
        if self.parent_turn is not None and not -1 <= self.parent_turn < self.turn:
            raise ValueError(
                f"parent_turn={self.parent_turn} of turn {self.turn}: a turn's parent is an "
                "earlier turn of its session, or -1 for none"
            )
        if len(self.logprobs) != len(self.completion_ids):
            raise ValueError(
                f"logprobs has {len(self.logprobs)} entries for "
                f"{len(self.completion_ids)} completion_ids: they must be equal"
            )
        if self.version_spans is not None:
            _check_version_spans(self.version_spans, len(self.completion_ids))
        if self.images:
            _check_images(self.images, self.prefix_len, self.prefix_len + len(self.prompt_ids))

    def token_versions(self) -> Int32Array:
        """Each completion token's policy version (``UNKNOWN_VERSION`` where unknown)."""
        n = len(self.completion_ids)
        if self.version_spans is None:
            return np.full(n, self.weight_version, dtype=np.int32)
        versions = [UNKNOWN_VERSION if v is None else v for v, _ in self.version_spans]
        counts = [count for _, count in self.version_spans]
        return np.repeat(np.asarray(versions, dtype=np.int32), counts)

    def continuations(self) -> list[tuple[int, int | None]]:
        """Where the gateway continued this turn after its backend aborted it (DESIGN §4):
        ``(tokens before, seed of the continuation)`` per ``sampling["continued"]`` entry, in
        order; [] for a turn generated in one go. ``sampling`` is free JSON, so an entry that is
        not one (no integer ``at`` within the completion, a seed that is no integer) is left out.

        >>> TurnCompleted(run="r", session="s", turn=0, prompt_ids=[1], completion_ids=[2, 3],
        ...               logprobs=[-1.0, -1.0],
        ...               sampling={"continued": [{"at": 1, "seed": 9}, {"at": 7}]}).continuations()
        [(1, 9)]
        """
        entries = self.sampling.get("continued")
        found: list[tuple[int, int | None]] = []
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, dict):
                continue
            at, seed = entry.get("at"), entry.get("seed")
            if not _integer(at) or not 0 <= at <= len(self.completion_ids):
                continue
            if seed is None or _integer(seed):
                found.append((at, seed))
        return found

    @property
    def parent(self) -> int:
        """The parent turn's index; -1 for none (turn 0, or a turn that shares nothing)."""
        return self.turn - 1 if self.parent_turn is None else self.parent_turn

    @property
    def reply(self) -> str:
        """The id the client's ids derive from: ``reply_id``, else (older events) the turn index."""
        return self.reply_id or str(self.turn)

    @property
    def assistant_message(self) -> JSON:
        """The reply as an OpenAI chat message, as the client received it."""
        message: JSON = {"role": "assistant", "content": self.text or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


class RewardAssigned(_Event, tag="RewardAssigned", kw_only=True):
    value: float
    turn: int | None = None  # None: a reward for the whole episode
    key: str = "default"  # several named components are summed
    source: str = ""
    info: JSON = msgspec.field(default_factory=dict)

    def __post_init__(self) -> None:
        super().__post_init__()
        validate_id(self.key, "key")


class SessionClosed(_Event, tag="SessionClosed", kw_only=True):
    status: SessionStatus = "completed"
    reward: float | None = None
    num_turns: int | None = None  # turns the gateway had served at close; later ones are late


class TrajectoryReady(_Event, tag="TrajectoryReady", kw_only=True):
    """One folded training sample (DESIGN §6). Arrays all have len(input_ids) entries.

    This is the sample as consumers use it, per token; on the wire (TRAJ) it travels as its
    ``compact()`` form, a ``CompactTrajectory``, which the codec expands back on decode. The
    fold makes the compact form directly (no per-token arrays to scan back into spans).
    """

    trajectory_id: str
    group: str
    segment: int
    status: TrajectoryStatus
    input_ids: np.ndarray  # int32
    loss_mask: np.ndarray  # int8: 1 where the policy generated the token
    logprobs: np.ndarray  # float32: sampling logprob of generated tokens, 0 elsewhere
    # int32: weight_version of generated tokens (UNKNOWN_VERSION -2: not known), -1 elsewhere
    versions: np.ndarray
    prompt_len: int
    turn_ends: np.ndarray  # int32: end (exclusive) of each turn's completion in input_ids
    turn_rewards: list[float | None]  # one per turn of this sample
    reward: float | None
    num_turns: int
    finish_reason: str
    messages: list[JSON]
    metadata: JSON
    fold_version: int
    tools: list[JSON] = msgspec.field(default_factory=list)  # the tool schemas the model was given
    # The images whose placeholder tokens lie in ``input_ids`` (offsets into them), in order:
    # the sample's last turn's full prompt images (fold v8). Their bytes are in the log's object
    # store under their digest. [] in text-only samples and in those folded before v8.
    images: list[ImageRef] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        self.input_ids = as_array(self.input_ids, "<i4", "input_ids")
        self.loss_mask = as_array(self.loss_mask, "i1", "loss_mask")
        self.logprobs = as_array(self.logprobs, "<f4", "logprobs")
        self.versions = as_array(self.versions, "<i4", "versions")
        self.turn_ends = as_array(self.turn_ends, "<i4", "turn_ends")
        n = len(self.input_ids)
        for name in ("loss_mask", "logprobs", "versions"):
            if len(getattr(self, name)) != n:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries, input_ids {n}")
        _check_samples(n, self.prompt_len, self.turn_ends, self.turn_rewards)
        if self.images:
            _check_images(self.images, 0, n)

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def min_weight_version(self) -> int:
        generated = self.versions[self.loss_mask == 1]
        return int(generated.min()) if len(generated) else -1

    @property
    def max_weight_version(self) -> int:
        return int(self.versions.max()) if len(self.versions) else -1

    @property
    def expected_segments(self) -> int:
        """How many trajectories the fold cut this sample's session into, as far as its
        metadata says: ``segments``, else ``forks + 1`` (a lower bound for per-turn folds)."""
        segments = self.metadata.get("segments")
        if isinstance(segments, int) and not isinstance(segments, bool):
            return max(segments, 1)
        forks = self.metadata.get("forks")
        if isinstance(forks, int) and not isinstance(forks, bool):
            return forks + 1
        return 1

    def compact(self) -> CompactTrajectory:
        """This sample in its wire form: generated spans instead of per-token mask, versions
        and zero logprobs. A sample the spans cannot say exactly (a mask value other than 0/1,
        a logprob other than +0.0 or a version other than -1 on a token not generated) keeps
        its per-token arrays instead, so the round trip is exact either way."""
        mask, versions, logprobs = self.loss_mask, self.versions, self.logprobs
        generated = mask == 1
        plain = ~generated
        fields = {name: getattr(self, name) for name in _COMMON_FIELDS}
        if (
            np.any(mask[plain] != 0)
            or np.any(versions[plain] != -1)
            or np.any(logprobs.view(np.int32)[plain] != 0)
        ):
            return CompactTrajectory(**fields, loss_mask=mask, logprobs=logprobs, versions=versions)
        spans, span_versions = generated_runs(generated, versions)
        return CompactTrajectory(
            **fields, spans=spans, span_versions=span_versions, gen_logprobs=logprobs[generated]
        )


def _integer(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON true is no number


def _check_images(images: list[ImageRef], start: int, end: int) -> None:
    """Images lie in their ids ``start..end`` (a turn's: its prompt's new ids; a sample's: all
    of its ids), in order, apart."""
    at = start
    for ref in images:
        if ref.offset < at or ref.end > end:
            raise ValueError(
                f"image {ref.sha256[:12]} at tokens {ref.offset}..{ref.end} is outside the "
                f"ids {start}..{end} it may lie in or overlaps the image before it"
            )
        at = ref.end


def _check_version_spans(spans: list[tuple[int | None, int]], n: int) -> None:
    total = 0
    for version, count in spans:
        if count < 1 or (version is not None and not 0 <= version < 2**31):
            raise ValueError(
                f"version_spans pair [{version}, {count}]: a count is at least 1, a version a "
                "non-negative int32 or null (unknown)"
            )
        total += count
    if total != n:
        raise ValueError(f"version_spans cover {total} tokens, the completion has {n}")


def _check_samples(
    n: int, prompt_len: int, turn_ends: Int32Array, turn_rewards: list[float | None]
) -> None:
    """What a consumer indexes with: a sample breaking these is refused where it is decoded
    (and dead-lettered there), not deep inside a trainer's batch or a shard writer."""
    if not 0 <= prompt_len <= n:
        raise ValueError(f"prompt_len {prompt_len} is outside its {n} tokens")
    if len(turn_rewards) != len(turn_ends):
        raise ValueError(f"{len(turn_rewards)} turn_rewards for {len(turn_ends)} turn_ends")
    if len(turn_ends) and not (turn_ends.min() >= 0 and turn_ends.max() <= n):
        raise ValueError(f"turn_ends {turn_ends.tolist()} outside its {n} tokens")


_COMMON_FIELDS = (
    "v",
    "run",
    "session",
    "created_at",
    "trajectory_id",
    "group",
    "segment",
    "status",
    "input_ids",
    "prompt_len",
    "turn_ends",
    "turn_rewards",
    "reward",
    "num_turns",
    "finish_reason",
    "messages",
    "metadata",
    "fold_version",
    "tools",
    "images",
)


class CompactTrajectory(_Event, tag="TrajectoryReady", kw_only=True):
    """A TrajectoryReady as TRAJ carries it (DESIGN §6): token ids once, the generated tokens
    as spans.

    ``spans`` holds (start, end) int32 pairs, sorted and disjoint: the runs of generated tokens
    (loss mask 1), one weight version each (``span_versions``); ``gen_logprobs`` has one
    logprob per generated token, in order. Every other token has mask 0, logprob 0 and
    version -1. About 4 bytes per token plus 4 per generated token, against 13 per token.

    Messages written before this form (and samples the spans cannot say exactly) carry the
    per-token ``loss_mask``, ``logprobs`` and ``versions`` instead; ``spans`` is then None.
    Exactly one of the two forms is present. ``expand()`` gives the TrajectoryReady;
    ``token_arrays()`` the per-token arrays alone.
    """

    trajectory_id: str
    group: str
    segment: int
    status: TrajectoryStatus
    input_ids: np.ndarray  # int32
    spans: np.ndarray | None = None  # int32: start, end of each generated run
    span_versions: np.ndarray | None = None  # int32: the weight_version of each span
    gen_logprobs: np.ndarray | None = None  # float32: one per generated token
    loss_mask: np.ndarray | None = None  # the per-token form (older messages)
    logprobs: np.ndarray | None = None
    versions: np.ndarray | None = None
    prompt_len: int
    turn_ends: np.ndarray  # int32
    turn_rewards: list[float | None]
    reward: float | None
    num_turns: int
    finish_reason: str
    messages: list[JSON]
    metadata: JSON
    fold_version: int
    tools: list[JSON] = msgspec.field(default_factory=list)
    images: list[ImageRef] = msgspec.field(default_factory=list)  # as TrajectoryReady's

    def __post_init__(self) -> None:
        super().__post_init__()
        self.input_ids = as_array(self.input_ids, "<i4", "input_ids")
        self.turn_ends = as_array(self.turn_ends, "<i4", "turn_ends")
        n = len(self.input_ids)
        per_token = (self.loss_mask, self.logprobs, self.versions)
        compact = (self.spans, self.span_versions, self.gen_logprobs)
        if all(a is None for a in per_token) and all(a is not None for a in compact):
            self._check_spans(n)
        elif all(a is not None for a in per_token) and all(a is None for a in compact):
            self.loss_mask = as_array(self.loss_mask, "i1", "loss_mask")
            self.logprobs = as_array(self.logprobs, "<f4", "logprobs")
            self.versions = as_array(self.versions, "<i4", "versions")
            for name in ("loss_mask", "logprobs", "versions"):
                if len(getattr(self, name)) != n:
                    raise ValueError(
                        f"{name} has {len(getattr(self, name))} entries, input_ids {n}"
                    )
        else:
            raise ValueError(
                "a trajectory carries either spans, span_versions and gen_logprobs, or "
                "loss_mask, logprobs and versions"
            )
        _check_samples(n, self.prompt_len, self.turn_ends, self.turn_rewards)
        if self.images:
            _check_images(self.images, 0, n)

    def _check_spans(self, n: int) -> None:
        spans = self.spans = as_array(self.spans, "<i4", "spans")
        self.span_versions = as_array(self.span_versions, "<i4", "span_versions")
        self.gen_logprobs = as_array(self.gen_logprobs, "<f4", "gen_logprobs")
        if len(spans) % 2:
            raise ValueError(f"spans has {len(spans)} entries: (start, end) pairs")
        starts, ends = spans[0::2], spans[1::2]
        if len(starts) and not (
            starts[0] >= 0
            and ends[-1] <= n
            and np.all(ends > starts)
            and np.all(starts[1:] >= ends[:-1])
        ):
            raise ValueError(f"spans must be sorted, disjoint, non-empty and inside the {n} tokens")
        if len(self.span_versions) != len(starts):
            raise ValueError(f"{len(self.span_versions)} span_versions for {len(starts)} spans")
        generated = int((ends.astype(np.int64) - starts).sum())
        if len(self.gen_logprobs) != generated:
            raise ValueError(
                f"gen_logprobs has {len(self.gen_logprobs)} entries for {generated} generated "
                "tokens"
            )

    @property
    def n_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def n_generated(self) -> int:
        if self.spans is None:
            assert self.loss_mask is not None
            return int(np.count_nonzero(self.loss_mask == 1))
        return int((self.spans[1::2].astype(np.int64) - self.spans[0::2]).sum())

    @property
    def response_len(self) -> int:
        return len(self.input_ids) - self.prompt_len

    @property
    def min_weight_version(self) -> int:
        if self.spans is None:
            assert self.loss_mask is not None and self.versions is not None
            generated = self.versions[self.loss_mask == 1]
            return int(generated.min()) if len(generated) else -1
        assert self.span_versions is not None
        return int(self.span_versions.min()) if len(self.span_versions) else -1

    @property
    def max_weight_version(self) -> int:
        if self.spans is None:
            assert self.versions is not None
            return int(self.versions.max()) if len(self.versions) else -1
        assert self.span_versions is not None
        found = [int(self.span_versions.max())] if len(self.span_versions) else []
        if self.n_generated < len(self.input_ids):
            found.append(-1)  # the tokens not generated
        return max(found, default=-1)

    def token_arrays(self) -> tuple[Int8Array, Float32Array, Int32Array]:
        """The per-token loss mask, logprobs and versions (int8, float32, int32)."""
        if self.spans is None:
            assert self.loss_mask is not None and self.logprobs is not None
            assert self.versions is not None
            return self.loss_mask, self.logprobs, self.versions
        assert self.span_versions is not None and self.gen_logprobs is not None
        return token_arrays(len(self.input_ids), self.spans, self.span_versions, self.gen_logprobs)

    def expand(self) -> TrajectoryReady:
        """The TrajectoryReady with its per-token arrays."""
        mask, logprobs, versions = self.token_arrays()
        fields = {name: getattr(self, name) for name in _COMMON_FIELDS}
        return TrajectoryReady(**fields, loss_mask=mask, logprobs=logprobs, versions=versions)


SessionEvent = SessionOpened | TurnCompleted | RewardAssigned | SessionClosed
Event = (
    SessionOpened
    | TurnCompleted
    | RewardAssigned
    | SessionClosed
    | TrajectoryReady
    | CompactTrajectory
)
"""What is published: a trajectory in either form (the fold makes the compact one)."""
EVENT_TYPES: tuple[type[_Event], ...] = (
    SessionOpened,
    TurnCompleted,
    RewardAssigned,
    SessionClosed,
    TrajectoryReady,
)

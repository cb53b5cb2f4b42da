"""The wire format: round trips, zero-copy arrays, and one typed error per kind of bad input."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import schemas.codec
from schemas.codec import Codec
from schemas.errors import (
    InvalidIdentifier,
    PayloadTooLarge,
    SchemaError,
    UndecodableEvent,
    UnsupportedSchemaVersion,
)
from schemas.events import (
    SCHEMA_VERSION,
    Event,
    RewardAssigned,
    SessionClosed,
    SessionOpened,
    TrajectoryReady,
    TurnCompleted,
)
from schemas.ids import ID_PATTERN

CODEC = Codec()
PROPERTY = settings(max_examples=100, deadline=None)
Raw = dict[str, Any]


def turn(**overrides: Any) -> TurnCompleted:
    fields: dict[str, Any] = {
        "run": "run-1",
        "session": "sess-1",
        "turn": 2,
        "prefix_len": 5,
        "prompt_ids": [1, 2, 3],
        "completion_ids": [4, 5],
        "logprobs": [-0.25, -1.5],
    }
    return TurnCompleted(**(fields | overrides))


def trajectory(**overrides: Any) -> TrajectoryReady:
    fields: dict[str, Any] = {
        "run": "run-1",
        "session": "sess-1",
        "trajectory_id": "sess-1.0",
        "group": "g-7",
        "segment": 0,
        "status": "completed",
        "input_ids": [10, 11, 12, 13],
        "loss_mask": [0, 0, 1, 1],
        "logprobs": [0.0, 0.0, -0.5, -0.125],
        "versions": [-1, -1, 3, 3],
        "prompt_len": 2,
        "turn_ends": [4],
        "turn_rewards": [None],
        "reward": 1.0,
        "num_turns": 1,
        "finish_reason": "stop",
        "messages": [{"role": "user", "content": "hi"}],
        "metadata": {"task": "t"},
        "fold_version": 1,
    }
    return TrajectoryReady(**(fields | overrides))


def raw_map(event: Event) -> Raw:
    """The encoded event as a plain msgpack map, arrays kept as their ext values."""
    raw: Raw = msgspec.msgpack.decode(
        CODEC.encode(event), ext_hook=lambda code, data: msgspec.msgpack.Ext(code, bytes(data))
    )
    return raw


def wire(raw: object) -> bytes:
    return msgspec.msgpack.encode(raw)


def assert_same_event(got: Event, want: Event) -> None:
    assert type(got) is type(want)
    got_fields, want_fields = msgspec.structs.asdict(got), msgspec.structs.asdict(want)
    assert got_fields.keys() == want_fields.keys()
    for name, value in want_fields.items():
        if isinstance(value, np.ndarray):
            assert got_fields[name].dtype == value.dtype, name
            assert got_fields[name].tobytes() == value.tobytes(), name
        else:
            assert got_fields[name] == value, name


# --- round trips ----------------------------------------------------------------------------


def test_a_100k_token_turn_round_trips_without_copying_its_arrays() -> None:
    rng = np.random.default_rng(0)
    event = turn(
        prompt_ids=rng.integers(0, 150_000, 100_000, dtype=np.int32),
        completion_ids=rng.integers(0, 150_000, 3_000, dtype=np.int32),
        logprobs=-rng.random(3_000, dtype=np.float32) * 10,
    )

    data = CODEC.encode(event)
    decoded = CODEC.decode(data)

    assert isinstance(decoded, TurnCompleted)
    assert_same_event(decoded, event)
    assert decoded.prompt_ids.dtype == np.int32 and len(decoded.prompt_ids) == 100_000
    assert decoded.completion_ids.dtype == np.int32
    assert decoded.logprobs.dtype == np.float32
    assert CODEC.encode(decoded) == data
    message = np.frombuffer(data, np.uint8)
    for array in (decoded.prompt_ids, decoded.completion_ids, decoded.logprobs):
        assert array.base is not None
        assert not array.flags.owndata
        assert np.shares_memory(array, message)


EVENTS = [
    pytest.param(SessionOpened(run="r", session="s"), id="opened-defaults"),
    pytest.param(
        SessionOpened(
            run="r",
            session="s",
            created_at=1_700_000_000.25,
            group="prompt-42",
            model="qwen",
            metadata={"task": "math", "nested": {"k": [1, 2.5, None, "ü"]}, "none": None},
        ),
        id="opened-metadata",
    ),
    pytest.param(turn(), id="turn-plain"),
    pytest.param(
        turn(
            prompt_ids=[],
            completion_ids=[],
            logprobs=[],
            tools=None,
            text="",
            finish_reason="length",
        ),
        id="turn-empty-arrays",
    ),
    pytest.param(
        turn(
            message_prefix_len=3,
            new_messages=[{"role": "tool", "tool_call_id": "c1", "content": "42"}],
            tools=[{"type": "function", "function": {"name": "calc", "parameters": {}}}],
            sampling={"temperature": 0.7, "top_p": None, "seed": 3},
            text="calling calc",
            tool_calls=[
                {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "{}"}}
            ],
            weight_version=9,
            template_hash="abc123",
            backend="vllm",
            timings={"ttft_s": 0.125, "total_s": 1.5},
            usage={"prompt_tokens": 3, "completion_tokens": 2},
        ),
        id="turn-tool-calls",
    ),
    pytest.param(RewardAssigned(run="r", session="s", value=0.5), id="reward-episode"),
    pytest.param(
        RewardAssigned(
            run="r", session="s", value=-1.0, turn=3, key="fmt", source="judge", info={"a": None}
        ),
        id="reward-turn",
    ),
    pytest.param(SessionClosed(run="r", session="s"), id="closed-defaults"),
    pytest.param(
        SessionClosed(run="r", session="s", status="timeout", reward=2.0, num_turns=4),
        id="closed-all",
    ),
    pytest.param(trajectory(), id="trajectory"),
    pytest.param(
        trajectory(turn_rewards=[0.5], reward=None, status="open", metadata={}),
        id="trajectory-none-reward",
    ),
]


@pytest.mark.parametrize("event", EVENTS)
def test_every_event_type_round_trips(event: Event) -> None:
    data = CODEC.encode(event)
    decoded = CODEC.decode(data)

    assert_same_event(decoded, event)
    assert CODEC.encode(decoded) == data
    assert raw_map(event)["type"] == type(event).__name__
    assert raw_map(event)["v"] == SCHEMA_VERSION


def test_unknown_fields_are_ignored() -> None:
    raw = raw_map(turn()) | {"added_in_v9": {"x": 1}, "z": [1, 2]}

    assert_same_event(CODEC.decode(wire(raw)), turn())


# --- construction ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prompt", "logprobs"),
    [
        pytest.param([1, 2], [-0.5, -0.25], id="lists"),
        pytest.param(np.array([1, 2], np.int64), np.array([-0.5, -0.25], np.float64), id="wide"),
        pytest.param((1, 2), (-0.5, -0.25), id="tuples"),
        pytest.param(np.array([1, 2], np.int16), np.array([-0.5, -0.25], np.float16), id="narrow"),
    ],
)
def test_construction_converts_array_likes_once(prompt: object, logprobs: object) -> None:
    event = turn(prompt_ids=prompt, completion_ids=prompt, logprobs=logprobs)

    assert event.prompt_ids.dtype == np.int32 and event.prompt_ids.tolist() == [1, 2]
    assert event.completion_ids.dtype == np.int32
    assert event.logprobs.dtype == np.float32 and event.logprobs.tolist() == [-0.5, -0.25]


def test_construction_keeps_an_int32_array_without_copying() -> None:
    ids = np.array([1, 2, 3], np.int32)

    assert turn(prompt_ids=ids).prompt_ids is ids


@pytest.mark.parametrize(
    ("build", "field"),
    [
        pytest.param(lambda: turn(prompt_ids=[1.5, 2.0]), "prompt_ids", id="prompt-list"),
        pytest.param(
            lambda: turn(completion_ids=np.array([1.0, 2.0]), logprobs=[0, 0]),
            "completion_ids",
            id="completion-array",
        ),
        pytest.param(lambda: trajectory(input_ids=[0.5] * 4), "input_ids", id="trajectory"),
        pytest.param(lambda: turn(prompt_ids=[[1, 2], [3, 4]]), "prompt_ids", id="2-d"),
        pytest.param(lambda: turn(logprobs=["a", "b"]), "logprobs", id="strings"),
    ],
)
def test_construction_rejects_a_wrong_array_naming_the_field(
    build: Callable[[], Event], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        build()


def test_logprobs_must_match_the_completion_naming_both_counts() -> None:
    with pytest.raises(ValueError, match=r"logprobs has 3 entries for 2 completion_ids"):
        turn(completion_ids=[1, 2], logprobs=[-0.1, -0.2, -0.3])


# --- bad input: one typed error each --------------------------------------------------------

VALID = CODEC.encode(turn())


def replaced(**fields: object) -> bytes:
    return wire(raw_map(turn()) | fields)


def without(field: str) -> bytes:
    raw = raw_map(turn())
    del raw[field]
    return wire(raw)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        pytest.param(b"", "truncated", id="empty"),
        pytest.param(b"\xc1\x00\xff\x13garbage", "malformed", id="garbage"),
        pytest.param(
            bytes(np.random.default_rng(7).integers(0, 256, 64, np.uint8)),
            "not a msgpack event",
            id="random-bytes",
        ),
        pytest.param(VALID[: len(VALID) - 3], "truncated", id="truncated"),
        pytest.param(VALID[:20], "truncated", id="truncated-in-header"),
        pytest.param(wire([1, "run", "session"]), "map, got list", id="list"),
        pytest.param(wire("TurnCompleted"), "map, got str", id="string"),
        pytest.param(replaced(type="TurnStarted"), "TurnStarted", id="unknown-type"),
        pytest.param(without("type"), "type", id="missing-type"),
        pytest.param(without("turn"), "`turn`", id="missing-turn"),
        pytest.param(without("completion_ids"), "`completion_ids`", id="missing-array"),
        pytest.param(replaced(turn="3"), r"\$\.turn", id="wrong-scalar-type"),
        pytest.param(replaced(prompt_ids=b"\x01\x00\x00\x00"), "prompt_ids", id="array-as-bytes"),
        pytest.param(
            replaced(prompt_ids=msgspec.msgpack.Ext(2, np.ones(2, "<f4").tobytes())),
            "prompt_ids",
            id="array-wrong-dtype",
        ),
        pytest.param(
            replaced(logprobs=msgspec.msgpack.Ext(2, b"\x00" * 4)),
            "logprobs has 1 entries for 2",
            id="array-wrong-length",
        ),
        pytest.param(
            replaced(prompt_ids=msgspec.msgpack.Ext(9, b"\x00" * 8)),
            "ext code 9",
            id="unknown-ext-code",
        ),
        pytest.param(
            replaced(prompt_ids=msgspec.msgpack.Ext(1, b"\x00" * 6)),
            "6 bytes",
            id="ext-not-multiple-of-4",
        ),
        pytest.param(
            replaced(sampling={"t": msgspec.msgpack.Ext(77, b"x")}),
            "ext code 77",
            id="unknown-ext-in-any-field",
        ),
        pytest.param(replaced(v=0), "`v`", id="v-0"),
        pytest.param(replaced(v=-1), "`v`", id="v-negative"),
        pytest.param(replaced(v="1"), "`v`", id="v-string"),
        pytest.param(replaced(v=True), "`v`", id="v-bool"),
        pytest.param(replaced(v=None), "`v`", id="v-none"),
        pytest.param(replaced(v=1.0), "`v`", id="v-float"),
    ],
)
def test_undecodable_input_raises_undecodable_event(data: bytes, message: str) -> None:
    with pytest.raises(UndecodableEvent, match=message):
        CODEC.decode(data)


BAD_TRAJECTORIES = [
    pytest.param({"prompt_len": 5}, "prompt_len 5 is outside its 4 tokens", id="prompt-too-long"),
    pytest.param({"prompt_len": -1}, "prompt_len -1", id="prompt-negative"),
    pytest.param({"turn_rewards": [None, 0.5]}, "2 turn_rewards for 1 turn_ends", id="rewards"),
    pytest.param({"turn_ends": [9]}, r"turn_ends \[9\] outside its 4 tokens", id="turn-end"),
]


@pytest.mark.parametrize(("fields", "message"), BAD_TRAJECTORIES)
def test_a_trajectory_a_consumer_cannot_index_is_refused(fields: Raw, message: str) -> None:
    """Built (a fold bug) or decoded (bad input): refused where it appears, naming what is
    wrong; a live sink dead-letters the message instead of failing a trainer's batch."""
    with pytest.raises(ValueError, match=message):
        trajectory(**fields)
    on_wire = {
        name: msgspec.msgpack.Ext(1, np.asarray(value, "<i4").tobytes())
        if name == "turn_ends"  # an int32 array travels as ext 1
        else value
        for name, value in fields.items()
    }
    with pytest.raises(UndecodableEvent, match=message):
        CODEC.decode(wire(raw_map(trajectory()) | on_wire))


@given(
    field=st.sampled_from(["prompt_ids", "completion_ids", "logprobs"]),
    code=st.integers(-128, 127),
    payload=st.binary(max_size=16),
)
@example(field="prompt_ids", code=9, payload=b"\x00" * 4)
@example(field="logprobs", code=1, payload=b"\x00" * 3)
@PROPERTY
def test_any_array_ext_either_decodes_or_raises_a_schema_error(
    field: str, code: int, payload: bytes
) -> None:
    try:
        event = CODEC.decode(replaced(**{field: msgspec.msgpack.Ext(code, payload)}))
    except SchemaError:
        return
    assert isinstance(event, TurnCompleted)


def test_a_newer_version_is_unsupported_naming_both_versions() -> None:
    newer = SCHEMA_VERSION + 1

    with pytest.raises(UnsupportedSchemaVersion) as caught:
        CODEC.decode(replaced(v=newer, field_of_the_future=[1]))

    assert caught.value.version == newer and caught.value.supported == SCHEMA_VERSION
    assert f"v={newer}" in str(caught.value) and f"v<={SCHEMA_VERSION}" in str(caught.value)


def test_a_newer_version_is_unsupported_even_if_it_no_longer_type_checks() -> None:
    raw = raw_map(turn()) | {"v": SCHEMA_VERSION + 1, "turn": "renamed-and-retyped"}

    with pytest.raises(UnsupportedSchemaVersion):
        CODEC.decode(wire(raw))


# --- older versions and upcasters -----------------------------------------------------------


@pytest.fixture
def schema_v3(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend this build writes v3, so that the real v1 maps are 'older' events."""
    monkeypatch.setattr(schemas.codec, "SCHEMA_VERSION", 3)


def v1_turn_map() -> Raw:
    """A v1 TurnCompleted in which ``prompt_ids`` was still called ``tokens``."""
    raw = raw_map(turn())
    raw["tokens"] = raw.pop("prompt_ids")
    return raw | {"v": 1}


@pytest.mark.usefixtures("schema_v3")
def test_an_older_version_without_an_upcaster_is_unsupported() -> None:
    with pytest.raises(UnsupportedSchemaVersion) as caught:
        Codec(upcasters={2: lambda raw: raw}).decode(wire(v1_turn_map()))

    assert (caught.value.version, caught.value.supported) == (1, 3)
    assert "v=1" in str(caught.value) and "3" in str(caught.value)


@pytest.mark.usefixtures("schema_v3")
def test_an_older_version_without_an_upcaster_is_not_called_newer() -> None:
    with pytest.raises(UnsupportedSchemaVersion) as caught:
        Codec().decode(wire(v1_turn_map()))

    # v1 is older than the v3 this build reads: "newer ... upgrade turnstream" sends the
    # operator the wrong way; the fix is a missing upcaster for v1, not a newer build.
    assert "newer" not in str(caught.value)


@pytest.mark.usefixtures("schema_v3")
@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(v1_turn_map(), id="renamed-field"),
        pytest.param(raw_map(turn()) | {"v": 1, "tokens": None}, id="already-type-checks"),
    ],
)
def test_older_versions_pass_through_every_upcaster_in_order(raw: Raw) -> None:
    seen: list[tuple[int, int]] = []

    def v1_to_v2(old: Raw) -> Raw:
        seen.append((1, old["v"]))
        new = dict(old)
        if "tokens" in new:
            tokens = new.pop("tokens")
            if tokens is not None:
                new["prompt_ids"] = tokens
        return new

    def v2_to_v3(old: Raw) -> Raw:
        seen.append((2, old["v"]))
        return old | {"backend": "upcast-from-v2"}

    event = Codec(upcasters={1: v1_to_v2, 2: v2_to_v3}).decode(wire(raw))

    assert seen == [(1, 1), (2, 2)]
    assert isinstance(event, TurnCompleted)
    assert event.v == 3
    assert event.backend == "upcast-from-v2"
    assert event.prompt_ids.dtype == np.int32 and event.prompt_ids.tolist() == [1, 2, 3]
    assert event.logprobs.dtype == np.float32 and event.logprobs.tolist() == [-0.25, -1.5]


@pytest.mark.usefixtures("schema_v3")
def test_an_upcast_that_yields_an_invalid_event_is_undecodable() -> None:
    codec = Codec(upcasters={1: lambda raw: raw, 2: lambda raw: raw})

    with pytest.raises(UndecodableEvent, match=r"after upcast.*prompt_ids"):
        codec.decode(wire(v1_turn_map()))


# --- identifiers ----------------------------------------------------------------------------

BAD_IDS = [
    pytest.param("a.b", id="dot"),
    pytest.param("a*", id="star"),
    pytest.param("a>", id="gt"),
    pytest.param("a b", id="space"),
    pytest.param("", id="empty"),
    pytest.param("x" * 65, id="65-chars"),
]
ID_FIELDS: list[Any] = [
    pytest.param("run", lambda bad: SessionClosed(run=bad, session="s"), id="run"),
    pytest.param("session", lambda bad: turn(session=bad), id="session"),
    pytest.param(
        "key", lambda bad: RewardAssigned(run="r", session="s", value=1, key=bad), id="key"
    ),
]


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize(("field", "build"), ID_FIELDS)
def test_a_bad_identifier_is_rejected_at_construction(
    field: str, build: Callable[[str], Event], bad: str
) -> None:
    with pytest.raises(InvalidIdentifier) as caught:
        build(bad)

    assert caught.value.field == field and caught.value.value == bad
    assert f"{field}={bad!r}" in str(caught.value) and ID_PATTERN in str(caught.value)


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize(
    ("field", "event"),
    [
        pytest.param("run", SessionClosed(run="r", session="s"), id="run"),
        pytest.param("session", turn(), id="session"),
        pytest.param("key", RewardAssigned(run="r", session="s", value=1), id="key"),
    ],
)
def test_a_bad_identifier_is_rejected_when_decoding(field: str, event: Event, bad: str) -> None:
    data = wire(raw_map(event) | {field: bad})

    with pytest.raises(InvalidIdentifier) as caught:
        CODEC.decode(data)

    assert caught.value.field == field
    assert f"{field}={bad!r}" in str(caught.value) and ID_PATTERN in str(caught.value)


# --- payload limit --------------------------------------------------------------------------


def test_an_event_over_the_limit_is_refused_on_encode() -> None:
    event = turn(prompt_ids=np.arange(1_000, dtype=np.int32))
    size = len(CODEC.encode(event))
    codec = Codec(max_payload=size - 1)

    with pytest.raises(PayloadTooLarge) as caught:
        codec.encode(event)

    assert (caught.value.size, caught.value.limit) == (size, size - 1)
    assert f"{size} bytes" in str(caught.value) and f"{size - 1}-byte limit" in str(caught.value)
    assert "run-1" in str(caught.value) and "sess-1" in str(caught.value)
    assert Codec(max_payload=size).encode(event) == CODEC.encode(event)


def test_a_payload_over_the_limit_is_refused_on_decode() -> None:
    data = CODEC.encode(turn(prompt_ids=np.arange(1_000, dtype=np.int32)))
    codec = Codec(max_payload=len(data) - 1)

    with pytest.raises(PayloadTooLarge) as caught:
        codec.decode(data)

    assert (caught.value.size, caught.value.limit) == (len(data), len(data) - 1)
    assert f"{len(data)} bytes" in str(caught.value)
    assert f"{len(data) - 1}-byte limit" in str(caught.value)
    assert isinstance(Codec(max_payload=len(data)).decode(data), TurnCompleted)


# --- property -------------------------------------------------------------------------------

IDS = st.from_regex(ID_PATTERN, fullmatch=True)
TEXT = st.text(max_size=40)
SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats() | TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)
JSON_MAPS = st.dictionaries(TEXT, JSON_VALUES, max_size=5)
INT32 = st.integers(-(2**31), 2**31 - 1)


@st.composite
def turns(draw: st.DrawFn) -> TurnCompleted:
    completion = draw(st.integers(0, 2_000))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    return TurnCompleted(
        run=draw(IDS),
        session=draw(IDS),
        created_at=draw(st.floats(allow_nan=False)),
        turn=draw(st.integers(0, 2**31)),
        prefix_len=draw(st.integers(0, 2**31)),
        prompt_ids=rng.integers(-(2**31), 2**31, draw(st.integers(0, 2_000)), dtype=np.int32),
        completion_ids=rng.integers(-(2**31), 2**31, completion, dtype=np.int32),
        logprobs=rng.standard_normal(completion, dtype=np.float32),
        message_prefix_len=draw(st.integers(0, 100)),
        new_messages=draw(st.lists(JSON_MAPS, max_size=3)),
        tools=draw(st.none() | st.lists(JSON_MAPS, max_size=2)),
        sampling=draw(JSON_MAPS),
        finish_reason=draw(TEXT),
        text=draw(st.text(max_size=200)),
        tool_calls=draw(st.lists(JSON_MAPS, max_size=2)),
        weight_version=draw(INT32),
        template_hash=draw(TEXT),
        backend=draw(TEXT),
        timings=draw(st.dictionaries(TEXT, st.floats(), max_size=3)),
        usage=draw(st.dictionaries(TEXT, INT32, max_size=3)),
    )


@given(turns())
@PROPERTY
def test_any_turn_round_trips_to_identical_bytes(event: TurnCompleted) -> None:
    data = CODEC.encode(event)
    decoded = CODEC.decode(data)

    assert isinstance(decoded, TurnCompleted)
    assert CODEC.encode(decoded) == data
    assert decoded.prompt_ids.tobytes() == event.prompt_ids.tobytes()
    assert decoded.completion_ids.tobytes() == event.completion_ids.tobytes()
    assert decoded.logprobs.tobytes() == event.logprobs.tobytes()
    assert (decoded.text, decoded.run, decoded.session) == (event.text, event.run, event.session)

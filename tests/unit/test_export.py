"""The pure part of ``turnstream export``: message shape, export tables, JSON Lines, and the
chat-template round trip checked with the gateway's own template (tiny model's tokenizer)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import datasets
import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.export import (
    JSON_TYPE,
    MESSAGE_TYPE,
    MESSAGES_SCHEMA,
    TOKENS_SCHEMA,
    Fidelity,
    convert_messages,
    first_difference,
    messages_table,
    tokens_table,
    without_side_calls,
)
from consumers.export_formats import dataset_card, jsonl_lines
from consumers.export_layout import part_file
from schemas.shards import trajectories_to_table
from tests.helpers.agent_sessions import claude_code_session
from tests.helpers.tiny_model import WEATHER_RESULT, WEATHER_TOOLS
from tests.helpers.trajectories import folded
from turnstream.data.export import TemplateRenderer, load_renderer

JSON = dict[str, Any]
NULLS = {"content": None, "tool_calls": None, "tool_call_id": None, "name": None}


def call(arguments: object, **extra: object) -> JSON:
    return {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": arguments},
        **extra,
    }


@pytest.mark.parametrize(
    ("message", "expected", "dropped"),
    [
        ({"role": "user", "content": "hi"}, {**NULLS, "role": "user", "content": "hi"}, {}),
        (  # content parts: their text joined, a part without text counted
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"},
                                         {"type": "text", "text": "b"}]},
            {**NULLS, "role": "user", "content": "ab"},
            {"content.image_url": 1},
        ),
        (  # arguments that are JSON: the very text, spacing included
            {"role": "assistant", "content": None, "tool_calls": [call('{"x": 1}')]},
            {**NULLS, "role": "assistant", "tool_calls": [call('{"x": 1}')]},
            {},
        ),
        (  # arguments sent as an object: JSON text of it
            {"role": "assistant", "tool_calls": [call({"b": [1, 2], "a": None})]},
            {**NULLS, "role": "assistant", "tool_calls": [call('{"b":[1,2],"a":null}')]},
            {},
        ),
        (  # arguments that are not JSON: the text as a JSON string (the template gets it as is)
            {"role": "assistant", "tool_calls": [call("not json {")]},
            {**NULLS, "role": "assistant", "tool_calls": [call('"not json {"')]},
            {},
        ),
        (  # no id or type, an extra key: type defaults to "function", the key is counted
            {"role": "assistant", "tool_calls": [{"function": {"name": "f"}, "index": 0}]},
            {**NULLS, "role": "assistant", "tool_calls": [
                {"id": None, "type": "function", "function": {"name": "f", "arguments": "null"}}
            ]},
            {"tool_calls.index": 1},
        ),
        (  # [] tool calls render as none, like null
            {"role": "assistant", "content": "ok", "tool_calls": []},
            {**NULLS, "role": "assistant", "content": "ok"},
            {},
        ),
        (
            {"role": "tool", "tool_call_id": "c1", "name": "f", "content": "18C"},
            {"role": "tool", "content": "18C", "tool_calls": None, "tool_call_id": "c1",
             "name": "f"},
            {},
        ),
        (  # fields the shape has no room for
            {"role": "assistant", "content": "x", "reasoning_content": "hm", "refusal": None},
            {**NULLS, "role": "assistant", "content": "x"},
            {"reasoning_content": 1, "refusal": 1},
        ),
    ],
)  # fmt: skip
def test_messages_take_the_fixed_openai_shape(
    message: JSON, expected: JSON, dropped: dict[str, int]
) -> None:
    out = convert_messages([message])
    assert out.messages == [expected]
    assert out.dropped == dropped
    pa.array(out.messages, _strip_json(MESSAGE_TYPE))  # fits the Arrow type


def _strip_json(type_: pa.DataType) -> pa.DataType:
    if type_ == JSON_TYPE:
        return pa.string()
    if pa.types.is_list(type_):
        return pa.list_(_strip_json(type_.value_type))
    if pa.types.is_struct(type_):
        return pa.struct([f.with_type(_strip_json(f.type)) for f in type_])
    return type_


_text = st.text(max_size=12)
_json_value = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=6,
)
_calls = st.lists(
    st.fixed_dictionaries(
        {"function": st.fixed_dictionaries(
            {"name": _text},
            optional={"arguments": _json_value | _json_value.map(json.dumps) | _text},
        )},
        optional={"id": _text, "type": st.just("function"), "index": st.integers(0, 3)},
    ),
    max_size=3,
)  # fmt: skip
_messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "developer", "user", "assistant", "tool"])},
        optional={
            "content": st.none()
            | _text
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": _text})),
            "tool_calls": st.none() | _calls,
            "tool_call_id": _text,
            "name": _text,
            "reasoning": _text,
        },
    ),
    max_size=5,
)


@settings(max_examples=200, deadline=None)
@given(_messages)
def test_the_shape_is_fixed_and_a_second_conversion_changes_nothing(messages: list[JSON]) -> None:
    out = convert_messages(messages)
    pa.array([out.messages], pa.list_(_strip_json(MESSAGE_TYPE)))
    again = convert_messages(out.messages)
    assert again.messages == out.messages and again.dropped == {}
    for message, original in zip(out.messages, messages, strict=True):
        for got, sent in zip(
            message["tool_calls"] or [], original.get("tool_calls") or [], strict=True
        ):
            arguments = sent["function"].get("arguments")
            decoded = json.loads(got["function"]["arguments"])
            # what the gateway's template saw: the JSON value, or the text that was not JSON
            # (compared as JSON text: Python's json reads "NaN" as a float nan, never == itself)
            if isinstance(arguments, str):
                try:
                    assert _same_json(decoded, json.loads(arguments))
                except ValueError:
                    assert decoded == arguments
            else:
                assert _same_json(decoded, arguments)


def _same_json(a: object, b: object) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


@pytest.mark.parametrize(
    ("input_ids", "rendered", "closing", "expected"),
    [
        ([1, 2, 3], [1, 2, 3, 9], [9], None),
        ([1, 2, 3], [1, 2, 3], [], None),
        ([1, 2, 3], [1, 5, 3, 9], [9], 1),
        ([1, 2, 3], [1, 2, 3], [9], 3),  # the template did not close the turn
        ([1, 2, 3], [1, 2, 3, 9, 9], [9], 4),  # it wrote more than the closing
        ([1, 2, 3], [1, 2], [9], 2),
    ],
)
def test_first_difference(
    input_ids: list[int], rendered: list[int], closing: list[int], expected: int | None
) -> None:
    assert first_difference(input_ids, rendered=rendered, closing=closing) == expected


def _shard_table() -> pa.Table:
    plain = folded("r1", "s1", turns=3, final_reward=0.5, turn_reward=0.25)
    tooled = msgspec.structs.replace(
        folded("r1", "s2", turns=1, final_reward=None),
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "weather?"}]},
            {"role": "assistant", "content": None, "thinking": "…",
             "tool_calls": [call('{"city":\n "Paris"}')]},
        ],
        tools=WEATHER_TOOLS,
    )  # fmt: skip
    return trajectories_to_table([(7, plain), (8, tooled)])


def test_tokens_rows_are_the_shard_columns_as_they_are() -> None:
    shard = _shard_table()
    table = tokens_table(shard)
    assert table.schema == TOKENS_SCHEMA
    for name in ("input_ids", "loss_mask", "logprobs", "versions", "turn_ends", "turn_rewards",
                 "reward", "trajectory_id", "group", "created_at"):  # fmt: skip
        assert table.column(name).equals(shard.column(name)), name
    assert table.column("metadata").type == JSON_TYPE
    assert [json.loads(m) for m in table.column("metadata").to_pylist()] == [
        json.loads(m) for m in shard.column("metadata").to_pylist()
    ]


def test_messages_rows_hold_conversations_tools_and_no_token_column() -> None:
    dropped: Counter[str] = Counter()
    table = messages_table(_shard_table(), dropped=dropped)
    assert table.schema == MESSAGES_SCHEMA
    assert "input_ids" not in table.column_names  # TRL would take the rows as tokenized
    rows = table.to_pylist()
    assert rows[0]["messages"][0] == {**NULLS, "role": "user", "content": "obs 0"}
    assert rows[1]["messages"][0]["content"] == "weather?"
    assert rows[1]["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city":\n "Paris"}'
    assert [json.loads(t) for t in rows[1]["tools"]] == WEATHER_TOOLS and rows[0]["tools"] == []
    assert [r["round_trips"] for r in rows] == [None, None]  # not checked: no renderer
    assert dropped == {"thinking": 1}


def test_side_calls_are_left_out_by_their_metadata_alone() -> None:
    agents = claude_code_session("r1", "cc", 1.0)  # main, fork, fresh, a compaction call
    nested = msgspec.structs.replace(
        folded("r1", "plain"), metadata={"task": {"side": True}, "side_note": '"side":true'}
    )
    untrue = msgspec.structs.replace(folded("r1", "other"), metadata={"side": "true"})
    shard = trajectories_to_table(list(enumerate([*agents, nested, untrue], start=1)))

    kept, left_out = without_side_calls(shard)
    plain, none = without_side_calls(_shard_table())

    assert left_out == 1
    assert kept.column("trajectory_id").to_pylist() == [
        "r1/cc/0", "r1/cc/1", "r1/cc/2", "r1/plain/0", "r1/other/0",
    ]  # fmt: skip
    assert kept.schema == shard.schema
    assert (none, plain.num_rows) == (0, 2)


def test_json_lines_write_json_columns_as_json_and_numbers_exactly() -> None:
    shard = _shard_table()
    logprobs = pa.array([[0.0, -0.1, float("nan")]], pa.list_(pa.float32()))
    tokens = tokens_table(shard)
    lines = jsonl_lines(tokens).decode().splitlines()
    assert len(lines) == 2
    rows = [json.loads(line) for line in lines]
    for row, original in zip(rows, tokens.to_pylist(), strict=True):
        assert row["input_ids"] == original["input_ids"]
        assert row["turn_rewards"] == original["turn_rewards"]  # null items stay null
        assert np.array_equal(np.float32(row["logprobs"]), np.float32(original["logprobs"]))
        assert row["metadata"] == json.loads(original["metadata"])  # an object, not text
        assert row["created_at"].endswith("Z")
    odd = tokens.slice(0, 1).set_column(
        tokens.schema.get_field_index("logprobs"), tokens.schema.field("logprobs"), logprobs
    )
    assert json.loads(jsonl_lines(odd))["logprobs"] == [0, -0.1, None]  # NaN is not JSON

    [_, tooled] = [json.loads(line) for line in jsonl_lines(messages_table(shard)).splitlines()]
    [call_out] = tooled["messages"][1]["tool_calls"]
    assert call_out["function"]["arguments"] == {"city": "Paris"}  # inline JSON, on one line
    assert tooled["tools"] == WEATHER_TOOLS


# -- the round trip, with the gateway's own template ----------------------------------------


@pytest.fixture(scope="module")
def renderer(tiny_model_dir: Path) -> TemplateRenderer:
    return load_renderer(tiny_model_dir)


def _sample(
    renderer: TemplateRenderer, *, model_call: str, answer: str, answer_ids_text: str, stop: bool
) -> tuple[list[JSON], np.ndarray]:
    """A two-turn tool session as the gateway records it: the messages and the tokens."""
    template = renderer.template
    [im_end] = template.encode("<|im_end|>")
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    prompt = template.prompt_ids(question, WEATHER_TOOLS)
    completion = [*template.encode(model_call), im_end]
    function = {"name": "get_weather", "arguments": '{"city":"Paris"}'}  # as the parser stores
    called = {"role": "assistant", "content": None,
              "tool_calls": [{"id": "c1", "type": "function", "function": function}]}  # fmt: skip
    result = {"role": "tool", "tool_call_id": "c1", "content": WEATHER_RESULT}
    suffix = template.continuation_ids([*question, called], completion, [result], WEATHER_TOOLS)
    assert suffix is not None
    second = [*prompt, *completion, *suffix]
    answered = [*template.encode(answer_ids_text), *([im_end] if stop else [])]
    messages = [*question, called, result, {"role": "assistant", "content": answer}]
    return messages, np.asarray([*second, *answered], dtype=np.int32)


CANONICAL_CALL = (
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
)


@pytest.mark.parametrize(
    ("model_call", "answer", "answer_ids_text", "stop", "round_trips"),
    [
        (CANONICAL_CALL, "It is sunny.", "It is sunny.", True, True),
        # cut off by max_tokens: the template closes the turn the model did not
        (CANONICAL_CALL, "It is", "It is", False, True),
        # a stop string: cut from the text, not from the tokens the model sampled
        (CANONICAL_CALL, "It is ", "It is sunny", True, False),
        # the model spaced its arguments differently from the template's rendering
        (CANONICAL_CALL.replace('{"city": "Paris"}', '{"city":"Paris"}'), "ok", "ok", True, False),
    ],
)
def test_a_sample_round_trips_when_its_rendered_messages_are_its_tokens(
    renderer: TemplateRenderer,
    model_call: str,
    answer: str,
    answer_ids_text: str,
    stop: bool,
    round_trips: bool,
) -> None:
    messages, input_ids = _sample(
        renderer, model_call=model_call, answer=answer, answer_ids_text=answer_ids_text, stop=stop
    )
    fidelity = Fidelity()
    row = ("r/s/0", convert_messages(messages).messages, WEATHER_TOOLS, input_ids, '{"forks": 0}')
    assert fidelity.check(renderer, row) is round_trips
    assert (fidelity.checked, fidelity.round_trips) == (1, int(round_trips))
    if not round_trips:
        [example] = fidelity.examples
        assert example["trajectory_id"] == "r/s/0" and "differs at token" in example["why"]
        assert fidelity.summary()["not_round_trips"] == 1


def test_closing_is_the_turn_end_text_less_what_the_model_sampled(
    renderer: TemplateRenderer,
) -> None:
    template = renderer.template
    [im_end] = template.encode("<|im_end|>")
    assert renderer.closing_ids(im_end) == template.encode("\n")
    assert renderer.closing_ids(ord("x")) == template.encode("<|im_end|>\n")
    assert renderer.closing_ids(None) == template.encode("<|im_end|>\n")


def test_a_conversation_the_template_cannot_render_does_not_round_trip(
    renderer: TemplateRenderer,
) -> None:
    fidelity = Fidelity()
    # the tool-calling template reads messages[0].role: an empty conversation fails to render
    row = ("r/s/1", [], WEATHER_TOOLS, np.asarray([1, 2], dtype=np.int32), '{"forks": 2}')
    assert fidelity.check(renderer, row) is False
    assert fidelity.forked_sessions == 1
    assert "cannot render" in fidelity.examples[0]["why"]


def test_messages_table_flags_each_row_checked(renderer: TemplateRenderer) -> None:
    messages, input_ids = _sample(
        renderer, model_call=CANONICAL_CALL, answer="It is sunny.",
        answer_ids_text="It is sunny.", stop=True,
    )  # fmt: skip
    good = msgspec.structs.replace(
        folded("r", "good"), messages=messages, tools=WEATHER_TOOLS, input_ids=input_ids,
        loss_mask=np.zeros(len(input_ids), np.int8), logprobs=np.zeros(len(input_ids), np.float32),
        versions=np.full(len(input_ids), -1, np.int32), prompt_len=1,
        turn_ends=np.asarray([len(input_ids)], np.int32), turn_rewards=[None], num_turns=1,
    )  # fmt: skip
    bad = msgspec.structs.replace(good, session="bad", trajectory_id="r/bad/0", tools=[])
    fidelity = Fidelity()
    table = messages_table(
        trajectories_to_table([(1, good), (2, bad)]), renderer=renderer, fidelity=fidelity
    )
    assert table.column("round_trips").to_pylist() == [True, False]
    assert fidelity.summary()["examples"][0]["trajectory_id"] == "r/bad/0"


@pytest.mark.parametrize("kind", ["tokens", "messages"])
def test_the_dataset_card_gives_datasets_the_exact_types(kind: str, tmp_path: Path) -> None:
    table = (tokens_table if kind == "tokens" else messages_table)(_shard_table())
    part = tmp_path / part_file(0, 1, "jsonl")
    part.parent.mkdir()
    part.write_bytes(jsonl_lines(table))
    manifest = {
        "run": "r1", "kind": kind, "format": "jsonl", "where": None, "rows": 2, "tokens": 9,
        "source": {"target": "shards", "shards": []}, "fidelity": None,
    }  # fmt: skip
    (tmp_path / "README.md").write_text(dataset_card(manifest, table.schema))
    loaded = datasets.load_dataset(str(tmp_path), split="train", cache_dir=str(tmp_path / "c"))
    assert loaded.features == datasets.Features.from_arrow_schema(table.schema)
    assert loaded[1]["trajectory_id"] == "r1/s2/0"
    if kind == "messages":
        assert loaded[1]["tools"] == WEATHER_TOOLS

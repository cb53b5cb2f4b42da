"""Decoding a body that resends the previous one (gateway.http.kept_bodies): the same value, or the
same error, as decoding it in full, whatever the client changes between two bodies."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.http.guard import decode_json
from gateway.http.kept_bodies import KeptBodies


def decode(body: bytes) -> Any:
    return decode_json(body, max_depth=8)


def outcome(decoder: Any, body: bytes) -> tuple[str, Any]:
    try:
        return "value", decoder(body)
    except InvalidRequest as exc:
        return "error", str(exc)


def body(value: Any, spaced: bool = True) -> bytes:
    separators = (", ", ": ") if spaced else (",", ":")
    return json.dumps(value, separators=separators, ensure_ascii=False).encode()


text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "tool"]), "content": text},
    optional={"meta": st.dictionaries(st.sampled_from("abc"), st.integers(-5, 5), max_size=2)},
)
# What a client does to its conversation between two requests.
edit = st.sampled_from(
    ["append", "append2", "same", "change-last", "truncate", "change-first", "model", "respace"]
)


@settings(max_examples=300, deadline=None)
@given(
    first=st.lists(message, min_size=1, max_size=5),
    edits=st.lists(st.tuples(edit, message), min_size=1, max_size=6),
    member=st.sampled_from(["messages", "input"]),
    shape=st.sampled_from(["model-first", "member-first", "both-sides"]),
)
def test_every_body_decodes_as_in_full(
    first: list[Any], edits: list[tuple[str, Any]], member: str, shape: str
) -> None:
    bodies = KeptBodies(1 << 20, min_bytes=0)
    items, model, spaced = list(first), "m", True
    for kind, new in edits:
        if kind == "append":
            items = [*items, new]
        elif kind == "append2":
            items = [*items, new, new]
        elif kind == "change-last":
            items = [*items[:-1], new]
        elif kind == "truncate":
            items = items[:-1] or [new]
        elif kind == "change-first":
            items = [new, *items[1:]]
        elif kind == "model":
            model += "x"
        elif kind == "respace":
            spaced = not spaced
        if shape == "model-first":
            value = {"model": model, member: items}
        elif shape == "member-first":
            value = {member: items, "n": 1}
        else:  # members before the items (kept decoded) and after them
            value = {"model": model, "tools": [{"name": "t", "p": {"a": [1]}}], member: items}
            value["stream"] = spaced
        raw = body(value, spaced)
        assert outcome(lambda b: bodies.decode("s", b, decode), raw) == outcome(decode, raw)


def test_a_continued_conversation_reuses_what_it_resends() -> None:
    bodies = KeptBodies(1 << 20, min_bytes=0)
    long = {"role": "user", "content": "a long task — with a dash\n" * 1000}
    first = bodies.decode("s", body({"messages": [long]}), decode)
    reply = {"role": "assistant", "content": "ok"}
    second = bodies.decode("s", body({"messages": [long, reply], "stream": False}), decode)
    assert second == {"messages": [long, reply], "stream": False}
    assert second["messages"][0] is first["messages"][0]
    # An agent that moves a marker on its last item: the items before it are still reused.
    marked = {**reply, "cache_control": {"type": "ephemeral"}}
    third = bodies.decode("s", body({"messages": [long, marked, reply]}), decode)
    assert third["messages"] == [long, marked, reply]
    assert third["messages"][0] is first["messages"][0]
    assert bodies.hits == 2
    # Another client session shares nothing.
    other = bodies.decode("t", body({"messages": [long, reply]}), decode)
    assert other["messages"][0] is not first["messages"][0] and bodies.hits == 2


def test_what_precedes_the_conversation_is_decoded_once() -> None:
    """An agent's tools and system prompt, before its conversation, are the same bytes on every
    turn: decoded once and shared, in the body's order, a later duplicate member winning."""
    bodies = KeptBodies(1 << 20, min_bytes=0)
    tools = [{"name": f"t{i}", "input_schema": {"type": "object"}} for i in range(3)]
    hi, ok = {"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}
    first = bodies.decode("s", body({"model": "m", "tools": tools, "messages": [hi]}), decode)
    raw = body({"model": "m", "tools": tools, "messages": [hi, ok]})[:-1] + b', "model": "n"}'
    second = bodies.decode("s", raw, decode)
    assert second == decode(raw) == {"model": "n", "tools": tools, "messages": [hi, ok]}
    assert list(second) == list(decode(raw))
    third = bodies.decode(
        "s", body({"model": "m", "tools": tools, "messages": [hi, ok, hi]}), decode
    )
    assert third == {"model": "m", "tools": tools, "messages": [hi, ok, hi]}
    assert third["tools"] is second["tools"] is first["tools"] and bodies.hits == 2
    # A member before the array and again after it: the next body's head is the first value.
    both = b'{"n": true, "messages": [' + body(hi) + b'], "n": 1}'
    assert bodies.decode("b", both, decode)["n"] == 1
    after = b'{"n": true, "messages": [' + body(hi) + b", " + body(ok) + b"]}"
    assert bodies.decode("b", after, decode)["n"] is True and bodies.hits == 3
    # A duplicate of the array's member before it: not kept as a head, decoded as in full.
    dup = b'{"messages": 1, "model": "m", "messages": [' + body(hi) + b"]}"
    bodies.decode("d", dup, decode)
    again = dup[:-2] + b", " + body(ok) + b"]}"
    assert bodies.decode("d", again, decode) == decode(again)


@pytest.mark.parametrize(
    ("rest", "error"),
    [
        (b', {"role": "user", "content": "\\ud800"}]}', "lone surrogates"),
        (b', {"role": "user", "n": 9223372036854775808}]}', r"\$\.messages\.2\.n is outside"),
        (
            b', {"a": ' + b'{"a": ' * 10 + b"1" + b"}" * 11 + b"]}",
            r"deeper than 8 levels at \$\.messages\.2",
        ),
        (b', {"role": "user"', "not valid JSON"),
        (b"}", "not valid JSON"),
        (b"]}" + b"x", "not valid JSON"),
    ],
    ids=["surrogate", "int64", "depth", "truncated", "unclosed-array", "trailing"],
)
def test_an_error_in_what_follows_is_reported_against_the_whole_body(
    rest: bytes, error: str
) -> None:
    """The error names the item by its place in the body sent (messages.2), not in the smaller
    document decoded on the reuse path."""
    bodies = KeptBodies(1 << 20, min_bytes=0)
    prefix = b'{"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}'
    bodies.decode("s", prefix + b"]}", decode)
    with pytest.raises(InvalidRequest, match=error):
        bodies.decode("s", prefix + rest, decode)


def test_a_body_of_many_small_objects_is_not_kept() -> None:
    """Its decoded objects would take many times its bytes (an empty dict: 2 bytes of JSON,
    64 in memory); a conversation holds about an object per 1,000 bytes."""
    bodies = KeptBodies(1 << 30)
    many = body({"messages": [{}] * 100_000})
    one = body({"messages": [{"role": "user", "content": [{}] * 100_000}]})  # the walk stops
    for _ in range(2):
        assert bodies.decode("s", many, decode) == {"messages": [{}] * 100_000}
        assert bodies.decode("t", one, decode)["messages"][0]["content"] == [{}] * 100_000
    assert bodies.hits == 0 and bodies.size_bytes == 0


def test_a_duplicate_member_decodes_as_in_full() -> None:
    """The last of two ``messages`` keys wins in a full decode; the reuse path must not put the
    kept items in front of it."""
    bodies = KeptBodies(1 << 20, min_bytes=0)
    kept = b'{"messages": [{"role": "user", "content": "x"}'
    bodies.decode("s", kept + b"]}", decode)
    raw = kept + b', {"role": "user", "content": "y"}], "messages": [{"role": "tool"}]}'
    assert bodies.decode("s", raw, decode) == {"messages": [{"role": "tool"}]}
    assert bodies.hits == 0


def test_the_budget_keeps_the_most_recent_bodies() -> None:
    one = body({"messages": [{"role": "user", "content": "x" * 100}]})
    measure = KeptBodies(1 << 20, min_bytes=0)
    measure.decode("a", one, decode)
    charge = measure.size_bytes  # the body and its decoded items
    assert charge > len(one) + 100
    bodies = KeptBodies(2 * charge + 1, min_bytes=0)
    for session in ("a", "b", "c"):
        bodies.decode(session, one, decode)
    bodies.decode("a", one, decode)  # evicted: decoded in full
    bodies.decode("c", one, decode)  # kept
    assert bodies.hits == 1 and bodies.size_bytes == 2 * charge
    small = KeptBodies(1 << 20)  # the default floor: small bodies pass through
    small.decode("s", one, decode)
    small.decode("s", one, decode)
    assert small.hits == 0


def test_sessions_sending_the_same_tools_share_one_decoded_copy() -> None:
    """One agent's sessions send the same tools (Claude Code's: ~190 KB decoded): decoded in
    full by each session's first body, they are one value, not one per session (issue 40);
    other tools, and small members, are each body's own."""
    bodies = KeptBodies(1 << 20, min_bytes=0)
    tools = [{"name": f"t{i}", "description": "d" * 400, "input_schema": {}} for i in range(12)]
    other = [{**tools[0], "name": "x"}, *tools[1:]]
    hi = {"role": "user", "content": "hi"}
    a, b, c = (
        bodies.decode(key, body({"model": "m", "tools": t, "messages": [hi]}), decode)
        for key, t in (("a", tools), ("b", tools), ("c", other))
    )
    assert a == decode(body({"model": "m", "tools": tools, "messages": [hi]}))
    assert a["tools"] is b["tools"] and c["tools"] == other and c["tools"] is not a["tools"]
    ok = {"role": "assistant", "content": "ok"}
    again = bodies.decode("b", body({"model": "m", "tools": tools, "messages": [hi, ok]}), decode)
    assert again["tools"] is a["tools"] and bodies.hits == 1
    small = [
        bodies.decode(k, body({"model": "m", "tools": [], "messages": [hi]}), decode) for k in "de"
    ]
    assert small[0]["tools"] is not small[1]["tools"]

"""Tool-call parsers: table-driven cases per format, the registry, and the streaming invariant
(content streamed from a prefix is never taken back once the whole completion is parsed)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.errors import InvalidRequest
from gateway.tools import (
    ContentStream,
    HermesParser,
    Llama3JsonParser,
    MistralParser,
    ParsedOutput,
    ParsedToolCall,
    ToolCallParser,
    get_parser,
    parser_names,
)


def call(name: str, **arguments: object) -> ParsedToolCall:
    return ParsedToolCall(name, json.dumps(arguments, ensure_ascii=False, separators=(",", ":")))


def calls_only(*calls: ParsedToolCall) -> ParsedOutput:
    return ParsedOutput(content=None, tool_calls=list(calls))


def content(text: str) -> ParsedOutput:
    return ParsedOutput(content=text, tool_calls=[])


def hermes_block(name: str, arguments: object) -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {json.dumps(arguments)}}}\n</tool_call>'


WEATHER = hermes_block("get_weather", {"city": "Paris", "unit": "c"})
TIME = hermes_block("get_time", {"tz": "CET"})

HERMES_CASES = [
    ("single", WEATHER, calls_only(call("get_weather", city="Paris", unit="c"))),
    (
        "parallel",
        f"{WEATHER}\n{TIME}",
        calls_only(call("get_weather", city="Paris", unit="c"), call("get_time", tz="CET")),
    ),
    (
        "content then call",
        f"Let me check.\n\n{TIME}",
        ParsedOutput("Let me check.", [call("get_time", tz="CET")]),
    ),
    (
        "whitespace before call is no content",
        f"\n  \n{TIME}",
        calls_only(call("get_time", tz="CET")),
    ),
    ("no call", "The answer is 4.\n", content("The answer is 4.\n")),
    ("empty", "", ParsedOutput(None, [])),
    ("only whitespace", " \n", ParsedOutput(None, [])),
    (
        "malformed JSON",
        '<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>',
        content('<tool_call>\n{"name": "f", "arguments": {"x": }\n</tool_call>'),
    ),
    (
        "truncated block",
        'Sure.\n<tool_call>\n{"name": "get_weather", "argum',
        content('Sure.\n<tool_call>\n{"name": "get_weather", "argum'),
    ),
    (
        "second block truncated",
        f"{WEATHER}\n<tool_call>\n{{",
        content(f"{WEATHER}\n<tool_call>\n{{"),
    ),
    (
        "unclosed block before a closed one",
        f"<tool_call>{{}}\n{TIME}",
        content(f"<tool_call>{{}}\n{TIME}"),
    ),
    (
        "unicode",
        "Voilà 🌍\n" + hermes_block("traduire", {"texte": "café ☕", "langue": "日本語"}),
        ParsedOutput("Voilà 🌍", [call("traduire", texte="café ☕", langue="日本語")]),
    ),
    (
        "arguments as a JSON string",
        '<tool_call>{"name": "f", "arguments": "{\\"x\\": [1, 2]}"}</tool_call>',
        calls_only(call("f", x=[1, 2])),
    ),
    ("no arguments", '<tool_call>{"name": "now"}</tool_call>', calls_only(call("now"))),
    (
        "arguments not an object",
        '<tool_call>{"name": "f", "arguments": [1]}</tool_call>',
        content('<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    ),
    (
        "no name",
        '<tool_call>{"arguments": {}}</tool_call>',
        content('<tool_call>{"arguments": {}}</tool_call>'),
    ),
    (
        "trailing text after the calls is dropped",
        f"{TIME}\nDone.",
        calls_only(call("get_time", tz="CET")),
    ),
]

LLAMA3_CASES = [
    (
        "single",
        '{"name": "get_weather", "parameters": {"city": "Paris"}}',
        calls_only(call("get_weather", city="Paris")),
    ),
    (
        "python tag",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        calls_only(call("get_weather", city="Paris")),
    ),
    (
        "parallel",
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}',
        calls_only(call("a", x=1), call("b")),
    ),
    ("arguments key", '{"name": "a", "arguments": {"x": 1}}', calls_only(call("a", x=1))),
    ("leading whitespace", '\n {"name": "a", "parameters": {}}\n', calls_only(call("a"))),
    ("trailing semicolon", '{"name": "a", "parameters": {}};', calls_only(call("a"))),
    ("no call", "It is sunny in Paris.", content("It is sunny in Paris.")),
    ("JSON inside prose is content", 'Call {"name": "a"}', content('Call {"name": "a"}')),
    ("a JSON answer is content", '{"answer": 42}', content('{"answer": 42}')),
    (
        "malformed JSON",
        '{"name": "a", "parameters": {x}}',
        content('{"name": "a", "parameters": {x}}'),
    ),
    (
        "truncated",
        '{"name": "a", "parameters": {"x": "lo',
        content('{"name": "a", "parameters": {"x": "lo'),
    ),
    (
        "garbage between calls",
        '{"name": "a", "parameters": {}} and {"name": "b"}',
        content('{"name": "a", "parameters": {}} and {"name": "b"}'),
    ),
    (
        "unicode",
        '{"name": "traduire", "parameters": {"texte": "café ☕ 日本語"}}',
        calls_only(call("traduire", texte="café ☕ 日本語")),
    ),
    (
        "parameters as a JSON string",
        '{"name": "a", "parameters": "{\\"x\\": 1}"}',
        calls_only(call("a", x=1)),
    ),
]

MISTRAL_CASES = [
    (
        "single",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        calls_only(call("get_weather", city="Paris")),
    ),
    (
        "parallel",
        '[TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]',
        calls_only(call("a", x=1), call("b")),
    ),
    (
        "content then call",
        'Checking.\n[TOOL_CALLS][{"name": "a", "arguments": {}}]',
        ParsedOutput("Checking.", [call("a")]),
    ),
    ("single object", '[TOOL_CALLS]{"name": "a", "arguments": {}}', calls_only(call("a"))),
    (
        "repeated marker",
        '[TOOL_CALLS][{"name": "a"}][TOOL_CALLS][{"name": "b"}]',
        calls_only(call("a"), call("b")),
    ),
    ("no call", "Bonjour.", content("Bonjour.")),
    ("empty list", "[TOOL_CALLS][]", content("[TOOL_CALLS][]")),
    ("malformed JSON", '[TOOL_CALLS][{"name": "a", }]', content('[TOOL_CALLS][{"name": "a", }]')),
    ("truncated", '[TOOL_CALLS][{"name": "a", "argu', content('[TOOL_CALLS][{"name": "a", "argu')),
    (
        "v11 format is content",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
        content('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'),
    ),
    (
        "unicode",
        '[TOOL_CALLS][{"name": "traduire", "arguments": {"texte": "日本語 ☕"}}]',
        calls_only(call("traduire", texte="日本語 ☕")),
    ),
    (
        "arguments as a JSON string",
        '[TOOL_CALLS][{"name": "a", "arguments": "{\\"x\\": true}"}]',
        calls_only(call("a", x=True)),
    ),
]

PARSERS: dict[str, ToolCallParser] = {
    "hermes": HermesParser(),
    "llama3_json": Llama3JsonParser(),
    "mistral": MistralParser(),
}
ALL_CASES = [
    pytest.param(parser, text, expected, id=f"{parser}:{case}")
    for parser, cases in [
        ("hermes", HERMES_CASES),
        ("llama3_json", LLAMA3_CASES),
        ("mistral", MISTRAL_CASES),
    ]
    for case, text, expected in cases
]


@pytest.mark.parametrize(("parser", "text", "expected"), ALL_CASES)
def test_parse(parser: str, text: str, expected: ParsedOutput) -> None:
    assert PARSERS[parser].parse(text) == expected


@pytest.mark.parametrize(("parser", "text", "expected"), ALL_CASES)
def test_arguments_are_compact_json_objects(parser: str, text: str, expected: ParsedOutput) -> None:
    for parsed in PARSERS[parser].parse(text).tool_calls:
        assert isinstance(json.loads(parsed.arguments), dict)
        assert ", " not in parsed.arguments and ": " not in parsed.arguments


def test_registry_builds_every_parser_by_name() -> None:
    assert parser_names() == ("hermes", "llama3_json", "mistral")
    for name in parser_names():
        parser = get_parser(name)
        assert parser.name == name
        assert isinstance(parser, ToolCallParser)


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(InvalidRequest, match=r"'qwen9'.*hermes, llama3_json, mistral"):
        get_parser("qwen9")


# ---- streaming --------------------------------------------------------------------------------

SAFE_PREFIX_CASES = [
    ("hermes", "Hello world", len("Hello world")),
    ("hermes", "Hello\n\n", len("Hello")),  # trailing whitespace may precede a call
    ("hermes", "Hello <", len("Hello")),
    ("hermes", "Hello <tool_ca", len("Hello")),
    ("hermes", "Hello <tool_call>\n{", len("Hello")),
    ("hermes", "a < b", len("a < b")),  # '<' then ' ' cannot become '<tool_call>'
    ("hermes", "<tool", 0),
    ("mistral", "Bonjour [TOOL_", len("Bonjour")),
    ("mistral", "[TOOL_CALLS][", 0),
    ("mistral", "x[1]", len("x[1]")),
    ("llama3_json", "", 0),
    ("llama3_json", "  ", 0),
    ("llama3_json", "{", 0),
    ("llama3_json", "<|py", 0),
    ("llama3_json", "<|python_tag|>{", 0),
    ("llama3_json", "<b>", 3),
    ("llama3_json", "The answer", len("The answer")),
]


@pytest.mark.parametrize(("parser", "text", "expected"), SAFE_PREFIX_CASES)
def test_content_safe_prefix_len(parser: str, text: str, expected: int) -> None:
    assert PARSERS[parser].content_safe_prefix_len(text) == expected


@pytest.mark.parametrize(("parser", "text", "expected"), ALL_CASES)
def test_streaming_every_prefix_reassembles_the_parsed_content(
    parser: str, text: str, expected: ParsedOutput
) -> None:
    """Character by character, as the slowest detokenizer would feed it."""
    stream = ContentStream(PARSERS[parser])
    streamed = "".join(stream.feed(text[: end + 1]) for end in range(len(text)))
    rest, parsed = stream.finish(text)
    assert parsed == expected
    assert streamed + rest == (expected.content or "")


def test_streaming_holds_back_a_call_and_flushes_content_at_the_end() -> None:
    stream = ContentStream(HermesParser())
    fed = ["Let", "Let me", "Let me check.\n", "Let me check.\n<tool_", f"Let me check.\n{TIME}"]
    assert [stream.feed(text) for text in fed] == ["Let", " me", " check.", "", ""]
    assert stream.finish(fed[-1]) == (
        "",
        ParsedOutput("Let me check.", [call("get_time", tz="CET")]),
    )


def test_streaming_a_truncated_call_flushes_it_as_content() -> None:
    stream = ContentStream(HermesParser())
    text = 'Ok <tool_call>{"name": "f"'
    assert stream.feed(text) == "Ok"
    assert stream.finish(text) == (' <tool_call>{"name": "f"', content(text))


def test_streaming_without_tools_sends_everything() -> None:
    stream = ContentStream(None)
    assert stream.feed("a <tool_call>") == "a <tool_call>"
    assert stream.feed("a <tool_call>\n") == "\n"
    assert stream.finish("a <tool_call>\n") == ("", content("a <tool_call>\n"))


_MARKERS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>"]
_JSON_BITS = ["{", "}", "[", "]", ";", ":", '"', '"name"', '"arguments"', '"parameters"', "1"]
_fragments = st.sampled_from([*_MARKERS, *_JSON_BITS, " ", "\n", "<", "hi", "é"])


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(sorted(PARSERS)), pieces=st.lists(_fragments, max_size=24))
def test_streamed_content_is_never_taken_back(parser: str, pieces: list[str]) -> None:
    """Any text, fed in any prefix steps: what was streamed is a prefix of the final content."""
    text = "".join(pieces)
    stream = ContentStream(PARSERS[parser])
    streamed = "".join(stream.feed(text[:end]) for end in range(len(text) + 1))
    rest, parsed = stream.finish(text)
    assert streamed + rest == (parsed.content or "")


@settings(max_examples=200, deadline=None)
@given(
    calls=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8),
            st.dictionaries(st.text(max_size=6), st.integers() | st.text(max_size=6), max_size=3),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_hermes_round_trips_any_calls(calls: list[tuple[str, dict[str, object]]]) -> None:
    text = "\n".join(
        f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"
        for name, args in calls
    )
    # Names and arguments are too short to contain a closing tag, which would end a block early.
    parsed = HermesParser().parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls

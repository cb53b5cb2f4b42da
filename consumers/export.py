"""Shard rows as dataset rows (PURE): the two kinds of ``turnstream export`` and its fidelity check.

``tokens``: the shard's training columns as they are (``input_ids``, ``loss_mask``, ``logprobs``,
``versions``, ``turn_ends``, rewards, weight versions) with the ids and ``metadata``.

``messages``: one row per sample for supervised fine-tuning: ``messages`` in the OpenAI chat shape
as a fixed Arrow type, ``tools`` (the schemas the model was given), the reward and the ids, and no
token column (TRL's ``SFTTrainer`` takes a dataset with ``input_ids`` as already tokenized)::

    messages: list<struct<role, content, tool_calls: list<struct<id, type,
              function: struct<name, arguments: json>>>, tool_call_id, name>>   (null where absent)
    tools:    list<json>

``json`` is Arrow's canonical ``arrow.json`` extension type: the text is stored as is (Parquet's
JSON logical type), DuckDB reads it as ``JSON``, and Hugging Face ``datasets`` decodes it (its
``Json`` feature), so ``arguments`` reaches a chat template as the object HF templates expect —
which is what the gateway rendered (``gateway.templates.template_messages``) — and every tool
schema keeps its own shape. ``arguments`` holds the text the conversation held when it is JSON,
else that text as a JSON string. Content given as parts is joined into its text. Fields the
fixed shape has no room for are counted by name (``Conversion.dropped``), not kept. Rows that
hold images are written as vision chat datasets are: content as parts with ``{"type":
"image"}`` where each image sits, and an ``images`` column of ``datasets.Image()`` values
(``consumers.export_images``).

Side calls. A row the fold made of a side request (metadata ``side: true``: compaction,
auxiliary, side_reply, count_tokens; ``schemas.agents``) is not the agent's own turn: ``turnstream
export`` leaves those rows out unless ``--keep-side-calls`` (``without_side_calls``), as the
trainer sink does; the shards keep them.

Fidelity. A row *round-trips* when its ``messages`` and ``tools``, rendered with the chat template
(the whole conversation, no generation prompt) and encoded, are exactly

    input_ids + closing

where ``closing`` is what the template writes after the final assistant message that the model
did not sample: its turn-end text (``<|im_end|>\\n`` for ChatML) minus the stop token the model
sampled itself — ``\\n`` after a sample that stopped on ``<|im_end|>``, all of ``<|im_end|>\\n``
after one cut off by ``max_tokens``. So fine-tuning on the exported conversation trains on the
very tokens the policy saw and produced, and on nothing but the template's closing text after
them. Append-only sessions round-trip; rows that do not (text the model wrote differently from the
template's rendering of its parsed message, a stop string cut from the text but not from the
tokens, a template that rewrites history) are counted and named, never hidden.

>>> messages = [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
...             {"role": "assistant", "content": None, "reasoning": "…", "tool_calls": [
...              {"id": "c1", "function": {"name": "f", "arguments": '{"x": 1}'}}]}]
>>> out = convert_messages(messages)
>>> out.messages[0]["content"], out.messages[1]["tool_calls"][0]["function"]["arguments"]
('hi', '{"x": 1}')
>>> out.dropped
{'reasoning': 1}
>>> first_difference([1, 2, 3], rendered=[1, 2, 3, 9], closing=[9])
>>> first_difference([1, 2, 3], rendered=[1, 5, 3, 9], closing=[9])
1
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from consumers.errors import ExportError
from consumers.export_images import ImageSource, image_parts_of, images_column, with_images
from schemas.agents import is_side_call
from schemas.shards import TRAJECTORY_SCHEMA

__all__ = [
    "EXPORT_KINDS",
    "JSON_TYPE",
    "MESSAGES_IMAGES_SCHEMA",
    "MESSAGES_SCHEMA",
    "MESSAGE_TYPE",
    "TOKENS_SCHEMA",
    "ChatRenderer",
    "Conversion",
    "ExportError",
    "ExportKind",
    "Fidelity",
    "convert_messages",
    "first_difference",
    "messages_table",
    "tokens_table",
    "without_side_calls",
]

# atif: one ATIF document per session (``consumers.atif``), not rows: no schema here
ExportKind = Literal["tokens", "messages", "atif"]
EXPORT_KINDS: tuple[ExportKind, ...] = ("tokens", "messages", "atif")
JSON = dict[str, Any]


JSON_TYPE: pa.DataType = pa.json_(pa.string())
"""Arrow's ``arrow.json`` extension type: JSON text, read back as JSON by readers that know it."""

_S = pa.string()
TOOL_CALL_TYPE = pa.struct(
    [
        ("id", _S),
        ("type", _S),
        ("function", pa.struct([("name", _S), ("arguments", JSON_TYPE)])),
    ]
)
MESSAGE_TYPE = pa.struct(
    [
        ("role", _S),
        ("content", _S),
        ("tool_calls", pa.list_(TOOL_CALL_TYPE)),
        ("tool_call_id", _S),
        ("name", _S),
    ]
)
_MESSAGE_FIELDS = frozenset(MESSAGE_TYPE.names)
_CALL_FIELDS = frozenset(("id", "type", "function"))


def _storage(type_: pa.DataType) -> pa.DataType:
    """``type_`` with every JSON extension replaced by its string storage (to build arrays)."""
    if type_ == JSON_TYPE:
        return _S
    if pa.types.is_list(type_):
        return pa.list_(_storage(type_.value_type))
    if pa.types.is_struct(type_):
        return pa.struct([f.with_type(_storage(f.type)) for f in type_])
    return type_


_SHARD = {f.name: f for f in TRAJECTORY_SCHEMA}
_IDS = ("trajectory_id", "run", "session", "group", "segment", "status")
_TOKEN_COLUMNS = (
    *("input_ids", "loss_mask", "logprobs", "versions", "prompt_len", "response_len"),
    *("turn_ends", "reward", "turn_rewards", "min_weight_version", "max_weight_version"),
    *("num_turns", "finish_reason"),
)
_TAIL = ("created_at", "fold_version")

TOKENS_SCHEMA = pa.schema(
    [
        *(_SHARD[name] for name in (*_IDS, *_TOKEN_COLUMNS)),
        pa.field("metadata", JSON_TYPE, nullable=False),
        *(_SHARD[name] for name in _TAIL),
    ]
)
MESSAGES_SCHEMA = pa.schema(
    [
        *(_SHARD[name] for name in _IDS),
        pa.field("messages", pa.list_(MESSAGE_TYPE), nullable=False),
        pa.field("tools", pa.list_(JSON_TYPE), nullable=False),
        *(_SHARD[n] for n in ("reward", "turn_rewards", "num_turns", "finish_reason")),
        *(_SHARD[n] for n in ("min_weight_version", "max_weight_version")),
        pa.field("metadata", JSON_TYPE, nullable=False),
        *(_SHARD[name] for name in _TAIL),
        # null when the check did not run (no tokenizer, or --no-fidelity)
        pa.field("round_trips", pa.bool_()),
    ]
)
_MESSAGES_STORAGE = pa.schema([f.with_type(_storage(f.type)) for f in MESSAGES_SCHEMA])
MESSAGES_IMAGES_SCHEMA = with_images(MESSAGES_SCHEMA)
"""``messages`` rows that hold images (``consumers.export_images``)."""
_MESSAGES_IMAGES_STORAGE = with_images(_MESSAGES_STORAGE)


def _as_json(column: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A string column of JSON text as the JSON extension type, without copying the text."""
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    return pa.ExtensionArray.from_storage(JSON_TYPE, column.cast(_S))


def tokens_table(shard: pa.Table) -> pa.Table:
    """The ``tokens`` rows of shard rows (TRAJECTORY_SCHEMA columns): a column selection."""
    columns = [
        _as_json(shard.column(f.name)) if f.type == JSON_TYPE else shard.column(f.name)
        for f in TOKENS_SCHEMA
    ]
    return pa.Table.from_arrays(columns, schema=TOKENS_SCHEMA)


def without_side_calls(shard: pa.Table) -> tuple[pa.Table, int]:
    """Shard rows less those of side requests (metadata ``side: true``), and how many those were.

    Only rows whose metadata text mentions ``"side"`` are decoded (a substring scan over the
    column first): most rows are not, and the metadata is the session's, any size."""
    metadata = shard.column("metadata")
    mentions = pc.fill_null(pc.match_substring(metadata, '"side"'), False)
    if not pc.any(mentions).as_py():
        return shard, 0
    texts = metadata.to_pylist()
    keep = [
        not (mentioned and _side_text(text))
        for mentioned, text in zip(mentions.to_pylist(), texts, strict=True)
    ]
    kept = shard.filter(pa.array(keep, pa.bool_()))
    return kept, shard.num_rows - kept.num_rows


def _side_text(text: str | None) -> bool:
    try:
        metadata = _decode.decode(text) if text is not None else None
    except msgspec.DecodeError:  # not ours to judge here: the row is exported as it is
        return False
    return isinstance(metadata, dict) and is_side_call(metadata)


# -- messages ---------------------------------------------------------------------------------

_decode = msgspec.json.Decoder()
_encode = msgspec.json.Encoder()


def _json_text(value: object) -> str:
    return _encode.encode(value).decode()


def _arguments(arguments: object) -> str:
    """A tool call's arguments as JSON text: the text itself when it is JSON, else encoded."""
    if isinstance(arguments, str):
        try:
            json.loads(arguments)  # json, not msgspec: any JSON number, however long
        except ValueError:
            return _json_text(arguments)
        return arguments
    return _json_text(arguments)


def _str(value: object) -> str | None:
    return value if value is None or isinstance(value, str) else _json_text(value)


@dataclass
class Conversion:
    """A conversation in the export's fixed shape, and what the shape had no room for; with
    ``parts``, also its images' digests in order, and the messages the chat template is
    checked against (``checked``: the canonical image parts, whose sizes set the
    placeholders, where ``messages`` hold bare ``{"type": "image"}``)."""

    messages: list[JSON] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)  # field name -> how many times
    images: list[str] = field(default_factory=list)
    checked: list[JSON] = field(default_factory=list)


def convert_messages(messages: Sequence[object], *, parts: bool = False) -> Conversion:
    """The OpenAI chat messages as MESSAGE_TYPE rows (see the module docstring); ``parts``:
    content as parts, images kept in place (``consumers.export_images``)."""
    dropped: Counter[str] = Counter()
    out: list[JSON] = []
    checked: list[JSON] = []
    images: list[str] = []
    for message in messages:
        if not isinstance(message, dict):
            dropped["<not an object>"] += 1
            continue
        dropped.update(k for k in message if k not in _MESSAGE_FIELDS)
        row = {
            "role": _str(message.get("role")),
            "content": None,
            "tool_calls": _tool_calls(message.get("tool_calls"), dropped),
            "tool_call_id": _str(message.get("tool_call_id")),
            "name": _str(message.get("name")),
        }
        if parts:
            content = image_parts_of(message.get("content"), dropped)
            images += content.digests
            row["content"] = content.exported if message.get("content") is not None else None
            raw = message.get("content")
            checked.append({**row, "content": content.checked if isinstance(raw, list) else raw})
        else:
            row["content"] = _content(message.get("content"), dropped)
            checked.append(row)
        out.append(row)
    return Conversion(out, dict(dropped), images, checked)


def _content(content: object, dropped: Counter[str]) -> str | None:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: their text, joined (as the gateway does)
        texts = []
        for part in content:
            text = part.get("text") if isinstance(part, dict) else None
            if isinstance(text, str):
                texts.append(text)
            else:
                dropped[f"content.{part.get('type') if isinstance(part, dict) else '?'}"] += 1
        return "".join(texts)
    return _json_text(content)


def _tool_calls(calls: object, dropped: Counter[str]) -> list[JSON] | None:
    if not isinstance(calls, list) or not calls:
        return None  # [] renders as no tool calls, like null
    out = []
    for call in calls:
        call = call if isinstance(call, dict) else {}
        dropped.update(f"tool_calls.{k}" for k in call if k not in _CALL_FIELDS)
        function = call.get("function")
        function = function if isinstance(function, dict) else {}
        out.append(
            {
                "id": _str(call.get("id")),
                "type": _str(call.get("type")) or "function",
                "function": {
                    "name": _str(function.get("name")),
                    "arguments": _arguments(function.get("arguments")),
                },
            }
        )
    return out


class ChatRenderer(Protocol):
    """What the fidelity check needs of the chat template the samples were rendered with."""

    def conversation_ids(self, messages: Sequence[JSON], tools: Sequence[JSON]) -> list[int]:
        """The whole conversation rendered (no generation prompt) and encoded; ValueError when
        the template cannot render it."""
        ...

    def closing_ids(self, last_token: int | None) -> list[int]:
        """The template's text after a final assistant message that the model did not sample,
        encoded: its turn-end text, minus ``last_token``'s text when that is a stop token."""
        ...


def first_difference(
    input_ids: Sequence[int] | np.ndarray, *, rendered: Sequence[int], closing: Sequence[int]
) -> int | None:
    """Where ``rendered`` first differs from ``input_ids + closing``; None when it does not."""
    expected = np.concatenate(
        [np.asarray(input_ids, dtype=np.int64), np.asarray(closing, dtype=np.int64)]
    )
    got = np.asarray(rendered, dtype=np.int64)
    n = min(len(expected), len(got))
    unequal = np.flatnonzero(expected[:n] != got[:n])
    if len(unequal):
        return int(unequal[0])
    return None if len(expected) == len(got) else n


@dataclass
class Fidelity:
    """How many rows round-trip through the chat template, and which do not (the first few)."""

    checked: int = 0
    round_trips: int = 0
    forked_sessions: int = 0  # rows that do not round-trip, of sessions the fold forked
    examples: list[JSON] = field(default_factory=list)
    max_examples: int = 20

    @property
    def not_round_trips(self) -> int:
        return self.checked - self.round_trips

    def check(
        self,
        renderer: ChatRenderer,
        row: tuple[str, list[JSON], list[JSON], np.ndarray, str],
    ) -> bool:
        """Whether ``(trajectory_id, messages, tools, input_ids, metadata)`` round-trips."""
        trajectory_id, messages, tools, input_ids, metadata = row
        self.checked += 1
        last = int(input_ids[-1]) if len(input_ids) else None
        try:
            rendered = renderer.conversation_ids(messages, tools)
        except ValueError as exc:
            return self._fails(
                trajectory_id, metadata, f"the chat template cannot render it: {exc}"
            )
        closing = renderer.closing_ids(last)
        at = first_difference(input_ids, rendered=rendered, closing=closing)
        if at is None:
            self.round_trips += 1
            return True
        return self._fails(
            trajectory_id,
            metadata,
            f"differs at token {at}: rendered {len(rendered)} tokens, the sample has "
            f"{len(input_ids)} + {len(closing)} closing",
        )

    def _fails(self, trajectory_id: str, metadata: str, why: str) -> bool:
        forks = _decode.decode(metadata).get("forks", 0) if metadata else 0
        if forks:
            self.forked_sessions += 1
        if len(self.examples) < self.max_examples:
            self.examples.append({"trajectory_id": trajectory_id, "forks": forks, "why": why})
        return False

    def summary(self) -> JSON:
        return {
            "checked": self.checked,
            "round_trips": self.round_trips,
            "not_round_trips": self.not_round_trips,
            "not_round_trips_in_forked_sessions": self.forked_sessions,
            "examples": self.examples,
        }


def _token_lists(column: pa.ChunkedArray | pa.Array) -> list[np.ndarray]:
    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    offsets = array.offsets.to_numpy()
    values = array.values.to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] for i in range(len(array))]


def messages_table(
    shard: pa.Table,
    *,
    renderer: ChatRenderer | None = None,
    fidelity: Fidelity | None = None,
    dropped: Counter[str] | None = None,
    images: ImageSource | None = None,
) -> pa.Table:
    """The ``messages`` rows of shard rows; checks each against ``renderer`` into ``fidelity``
    when both are given (``round_trips`` is null otherwise) and counts dropped fields. With
    ``images`` (where the bytes are), the rows are in the image layout (``with_images``)."""
    ids = shard.column("trajectory_id").to_pylist()
    metadata = shard.column("metadata").to_pylist()
    tool_texts = shard.column("tools").to_pylist()
    conversations = []
    tools_column: list[list[str]] = []
    checks: list[bool | None] = []
    input_ids = _token_lists(shard.column("input_ids")) if renderer is not None else []
    row_images: list[list[str]] = []
    for i, text in enumerate(shard.column("messages").to_pylist()):
        conversion = convert_messages(_decode.decode(text), parts=images is not None)
        if dropped is not None:
            dropped.update(conversion.dropped)
        tools = _decode.decode(tool_texts[i]) if tool_texts[i] is not None else []
        conversations.append(conversion.messages)
        row_images.append(conversion.images)
        tools_column.append([_json_text(tool) for tool in tools])
        if renderer is not None and fidelity is not None:
            row = (ids[i], conversion.checked, tools, input_ids[i], metadata[i])
            checks.append(fidelity.check(renderer, row))
        else:
            checks.append(None)
    schema, storage = MESSAGES_SCHEMA, _MESSAGES_STORAGE
    if images is not None:
        schema, storage = MESSAGES_IMAGES_SCHEMA, _MESSAGES_IMAGES_STORAGE
    built: dict[str, pa.Array | pa.ChunkedArray] = {
        "messages": pa.array(conversations, storage.field("messages").type),
        "tools": pa.array(tools_column, pa.list_(_S)),
        "round_trips": pa.array(checks, pa.bool_()),
    }
    if images is not None:
        built["images"] = images_column(row_images, images)
    columns = [built[f.name] if f.name in built else shard.column(f.name) for f in schema]
    return pa.Table.from_arrays(columns, schema=storage).cast(schema)

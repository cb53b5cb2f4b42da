"""Decoding a request body that resends the previous one: only what it adds.

An agent sends its whole conversation on every turn: at 100k tokens a 0.4-0.6 MB body whose
first items are, byte for byte, the ones its previous request sent. Decoding them again costs
~1 ms a turn (msgspec decodes a string with one non-ASCII character as UCS-2, its escapes one
by one), the largest cost of a later turn that grows with the context.

``KeptBodies`` keeps, per client session (the key it sent, the path, the run and session
headers), the last large body: where its conversation's items (``messages``, or the Responses
API's ``input``) end in it, and their decoded values. A body that starts with the bytes of the
kept body's first k items is decoded without them: the bytes before the items' array, then what
follows item k, as one smaller document; the k kept values go in front of its items. The same
bytes decode to the same values, so the result is the full decode's; where any step does not
hold (another prefix, a duplicate key, an error in the rest), the body is decoded in full, and
an error is reported against the body as sent.

A kept head's large members (``SHARED_MIN_BYTES`` of JSON or more: an agent's tools, ~190 KB
decoded for Claude Code's 24) are shared between sessions whose bodies hold them byte for byte:
one agent's sessions send the same tools, and each decoded its own copy (issue 40). Like the
kept values, shared values are never changed; at most an eighth of the budget of their JSON
is looked up that way, the least recently shared dropped first: that table (the JSON and its
values) is held beside the budget, which each kept body's charge (counting its shared
members too) stays within.

>>> import json
>>> from gateway.http.guard import decode_json
>>> bodies = KeptBodies(1 << 20, min_bytes=0)
>>> first = {"messages": [{"role": "user", "content": "hi"}], "model": "m"}
>>> again = {"messages": [*first["messages"], {"role": "assistant", "content": "yo"}]}
>>> a = bodies.decode("s", json.dumps(first).encode(), lambda b: decode_json(b, 64))
>>> b = bodies.decode("s", json.dumps(again).encode(), lambda b: decode_json(b, 64))
>>> b == again, b["messages"][0] is a["messages"][0], bodies.hits
(True, True, 1)
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np
from prometheus_client import Counter, Gauge

from gateway.errors import InvalidRequest
from gateway.protocol.validated_once import Memo, new_memo

__all__ = ["KeptBodies"]

# Below this a body decodes in ~0.1 ms or less: not worth keeping.
MIN_BYTES = 64 * 1024
# A head member this large (its JSON) is shared between the sessions that send it.
SHARED_MIN_BYTES = 4096
_WHITESPACE = frozenset(b" \t\r\n")
_COMMA, _CLOSE = ord(","), ord("]")


class _Items(msgspec.Struct):
    """A body's conversation items, undecoded (``msgspec.Raw`` views into the body)."""

    messages: list[msgspec.Raw] | None = None
    input: str | list[msgspec.Raw] | None = None


class _Array(msgspec.Struct):
    """Where a body's items array is (empty: the member is absent)."""

    messages: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()


_ITEMS = msgspec.json.Decoder(_Items)
_ARRAY = msgspec.json.Decoder(_Array)
_RAWS = msgspec.json.Decoder(list[msgspec.Raw])
_HEAD = msgspec.json.Decoder(dict[str, Any])
_MEMBERS = msgspec.json.Decoder(dict[str, msgspec.Raw])


@dataclass(frozen=True, slots=True)
class _Kept:
    body: bytes
    member: str  # "messages" or "input"
    opening: int  # offset of the items' "["
    ends: tuple[int, ...]  # offset just past each item
    values: tuple[Any, ...]  # each item, decoded
    sizes: tuple[int, ...]  # each decoded item's bytes in memory (its objects' getsizeof)
    # The members before the items' array, decoded (None: not kept). A body sharing an item
    # shares these bytes: an agent's tools and system prompt (Claude Code: ~80 KB) are not
    # decoded and walked again each turn. Its values are shared by the bodies decoded from it.
    head: dict[str, Any] | None = None
    head_size: int = 0  # its bytes in memory
    # What request models made of the head's values, validated once (``validated_once``):
    # shared, like the head, by the bodies decoded from it. None where there is no head.
    memo: Memo | None = None

    @property
    def charge(self) -> int:
        """What it holds against the budget: the body and its decoded items (their strings
        are mostly those the session's kept turns hold too: counted twice, to be safe)."""
        return len(self.body) + sum(self.sizes) + self.head_size


class KeptBodies:
    """The last large body of each client session, by key, least recently used evicted past
    ``budget_bytes``. Thread-safe: a body over 1 MB is decoded on a worker thread."""

    def __init__(
        self,
        budget_bytes: int,
        outcomes: Counter | None = None,
        held: Gauge | None = None,
        *,
        min_bytes: int = MIN_BYTES,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.min_bytes = min_bytes
        self.hits = 0  # bodies decoded without their kept items
        # ``outcomes``: bodies by how they were decoded ("reused", "full"); ``held``: size_bytes.
        self._reused = None if outcomes is None else outcomes.labels("reused")
        self._full = None if outcomes is None else outcomes.labels("full")
        self._held = held
        self._kept: OrderedDict[Hashable, _Kept] = OrderedDict()
        self._size = 0
        self._shared = _Shared(budget_bytes // 8)
        self._lock = threading.Lock()

    @property
    def size_bytes(self) -> int:
        """What the kept bodies hold (``_Kept.charge``), within ``budget_bytes``."""
        return self._size

    def worth_keeping(self, body: bytes) -> bool:
        return self.budget_bytes > 0 and len(body) >= self.min_bytes

    def holds(self, key: Hashable) -> bool:
        """Whether a body is kept under ``key`` (the next one's decode may reuse its items)."""
        with self._lock:
            return key in self._kept

    def decode(self, key: Hashable, body: bytes, decode: Callable[[bytes], Any]) -> Any:
        """``decode(body)``'s value, decoding only what follows the items ``body`` shares with
        the previous body under ``key``."""
        if not self.worth_keeping(body):
            return decode(body)
        with self._lock:
            kept = self._kept.get(key)
        found = None if kept is None else _extend(kept, body, decode)
        if found is None:
            value = decode(body)
            new = _index(body, value, self._shared)
        else:
            value, new = found
        counter = self._full if found is None else self._reused
        if counter is not None:
            counter.inc()
        with self._lock:
            self.hits += found is not None
            self._forget(key)
            if new is not None and new.charge <= self.budget_bytes:
                self._kept[key] = new
                self._size += new.charge
                while self._size > self.budget_bytes:
                    self._forget(next(iter(self._kept)))
            if self._held is not None:
                self._held.set(self._size)
        return value

    def memo_of(self, key: Hashable) -> Memo | None:
        """The memo of the members kept before the conversation of ``key``'s last body (for
        the request models' ``validated_once``); None where none are kept."""
        with self._lock:
            kept = self._kept.get(key)
        return None if kept is None else kept.memo

    def _forget(self, key: Hashable) -> None:
        old = self._kept.pop(key, None)
        if old is not None:
            self._size -= old.charge


def _extend(kept: _Kept, body: bytes, decode: Callable[[bytes], Any]) -> tuple[Any, _Kept] | None:
    """``body`` decoded from the items it shares with ``kept`` and a decode of the rest; None
    where it shares none, or the rest does not decode as the continuation of those items."""
    k = _shared_items(kept, body)
    if k == 0:
        return None
    cut = kept.ends[k - 1]
    while cut < len(body) and body[cut] in _WHITESPACE:
        cut += 1
    if cut == len(body) or body[cut] not in (_COMMA, _CLOSE):
        return None
    view = memoryview(body)
    rest = view[cut + 1 :] if body[cut] == _COMMA else view[cut:]
    # What precedes the array (the kept head's members, or its bytes: the same in both bodies,
    # items 0..k-1 being shared), then what follows item k: body without items 0..k-1.
    opening = (
        b'{"%s":[' % kept.member.encode() if kept.head is not None else view[: kept.opening + 1]
    )
    smaller = b"".join((opening, rest))
    try:
        value = decode(smaller)
        array = getattr(_ARRAY.decode(smaller), kept.member)
    except (InvalidRequest, msgspec.DecodeError, msgspec.ValidationError):
        return None  # decoded in full, its error reported against the body as sent
    # The member decoded must be this array (a later duplicate key would replace it).
    if not array or _offset(array, smaller) != len(opening) - 1:
        return None
    if kept.head is not None and isinstance(value, dict):
        value = {**kept.head, **value}  # the body's order; a later duplicate wins, as in full
    items = value.get(kept.member) if isinstance(value, dict) else None
    raws = _RAWS.decode(array)
    placed = _placed(raws, smaller, items)
    if placed is None:
        return None
    items, starts, sizes = placed
    shift = len(body) - len(smaller)
    ends = kept.ends[:k] + tuple(s + len(r) + shift for s, r in zip(starts, raws, strict=True))
    values = kept.values[:k] + tuple(items)
    value[kept.member] = list(values)
    sizes = kept.sizes[:k] + sizes
    head, head_size, memo = kept.head, kept.head_size, kept.memo
    return value, _Kept(body, kept.member, kept.opening, ends, values, sizes, head, head_size, memo)


def _shared_items(kept: _Kept, body: bytes) -> int:
    """How many of ``kept``'s items ``body`` starts with, byte for byte (with what precedes
    them). A client appends to its conversation (all shared) or changes its last items (an
    agent moving a cache marker): the longest first, then a binary search."""
    old = memoryview(kept.body)
    ends = kept.ends
    if body.startswith(old[: ends[-1]]):
        return len(ends)
    lo, hi = 0, len(ends) - 1  # lo items shared; hi + 1 not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if body.startswith(old[: ends[mid - 1]]):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _index(body: bytes, value: Any, shared: _Shared) -> _Kept | None:
    """Where ``body``'s items end; None where it has no items array to keep."""
    try:
        shape = _ITEMS.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None
    for member in ("messages", "input"):
        raws = getattr(shape, member)
        if isinstance(raws, list) and raws:
            break
    else:
        return None
    items = value.get(member) if isinstance(value, dict) else None
    placed = _placed(raws, body, items)
    if placed is None:
        return None
    items, starts, sizes = placed
    opening = body.rfind(b"[", 0, starts[0])
    if opening < 0 or body[opening + 1 : starts[0]].strip():
        return None
    ends = tuple(start + len(r) for start, r in zip(starts, raws, strict=True))
    head, head_size = _head(body, opening, member, value, shared)
    memo = None if head is None else new_memo()
    return _Kept(body, member, opening, ends, tuple(items), sizes, head, head_size, memo)


def _head(
    body: bytes, opening: int, member: str, value: dict[str, Any], shared: _Shared
) -> tuple[dict[str, Any] | None, int]:
    """The members before the items' array at ``opening``, and their bytes in memory: found
    by decoding the head's bytes closed with an empty array (the body they are part of was
    checked when decoded in full, as ``value``), their values ``value``'s own objects where no
    later member replaced them (so a session's first turn and the next share its tools); None
    where they are not a JSON object's members ending with that array, or hold more than an
    object per 64 bytes. A large member's value is the one ``shared`` holds for its bytes,
    in ``value`` too (the request decoded in full uses it)."""
    try:
        head = _HEAD.decode(b"".join((memoryview(body)[: opening + 1], b"]}")))
        last = _MEMBERS.decode(body)  # each member's last occurrence, where it is
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None, 0
    if list(head)[-1:] != [member] or head.pop(member) != []:
        return None, 0  # the array is not the head's last member (a duplicate key before it)
    for key in head:
        raw = last.get(key)
        if raw is not None and 0 <= _offset(raw, body) < opening:
            head[key] = value[key]
            if len(raw) >= SHARED_MIN_BYTES:
                head[key] = value[key] = shared.one(bytes(raw), value[key])
    size = _sizes([head], opening)
    return (None, 0) if size is None else (head, size[0])


class _Shared:
    """Decoded values by their JSON bytes, one value per distinct text, at most ``budget_bytes``
    of text (least recently shared dropped first). Thread-safe."""

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = budget_bytes
        self._values: OrderedDict[bytes, Any] = OrderedDict()
        self._size = 0
        self._lock = threading.Lock()

    def one(self, text: bytes, value: Any) -> Any:
        """The value kept for ``text``, else ``value`` (a decode of ``text``), kept where it
        fits: hashing ``text`` costs ~1 µs per KB, once per body decoded in full."""
        if len(text) > self.budget_bytes:
            return value
        with self._lock:
            kept = self._values.get(text)
            if kept is not None:
                self._values.move_to_end(text)
                return kept
            self._values[text] = value
            self._size += len(text)
            while self._size > self.budget_bytes:
                self._size -= len(self._values.popitem(last=False)[0])
        return value


def _placed(
    raws: list[msgspec.Raw], within: bytes, items: Any
) -> tuple[list[Any], list[int], tuple[int, ...]] | None:
    """The decoded ``items``, where each starts in ``within`` and each one's size; None where
    they are not those ``raws``, a raw is not a view into ``within``, or the items are too many
    objects to keep."""
    if not isinstance(items, list) or len(items) != len(raws):
        return None
    starts = [_offset(r, within) for r in raws]
    if starts and min(starts) < 0:
        return None
    sizes = _sizes(items, len(within))
    return None if sizes is None else (items, starts, sizes)


def _sizes(items: list[Any], body_bytes: int) -> tuple[int, ...] | None:
    """Each item's bytes in memory; None where the items hold more than an object per 64
    bytes of body (a conversation holds ~1 per 1,000: such a body is not kept)."""
    budget = max(body_bytes, MIN_BYTES) // 64
    sizes = []
    for item in items:
        size, stack = 0, [item]
        while stack:
            node = stack.pop()
            size += sys.getsizeof(node)
            if type(node) is dict:
                stack.extend(node.values())
            elif type(node) is list:
                stack.extend(node)
            budget -= 1
            if budget < 0:
                return None
        sizes.append(size)
    return tuple(sizes)


def _offset(raw: msgspec.Raw, within: bytes) -> int:
    """Where ``raw`` (a view msgspec decoded out of ``within``) starts in it; -1 where it is
    not inside it (msgspec copied it: the body is then decoded in full, not kept)."""
    start = int(_address(raw) - _address(within))
    return start if 0 <= start <= len(within) - len(raw) else -1


def _address(buffer: msgspec.Raw | bytes) -> int:
    return int(np.frombuffer(buffer, np.uint8).ctypes.data)

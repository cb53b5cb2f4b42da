"""What the gateway benchmarks check in EVENTS after their load: the turn each answer was
recorded as, and that every turn of a conversation after its first continues that
conversation's previous turn, token-exact.

An answer's id ends in the turn's ``reply`` (``chatcmpl-<session>-<reply>``,
``msg_<session>_<reply>``): its per-request ``reply_id``, or for a gateway that records none
(an older revision run by ``--compare-with``) the turn index, which stood in for it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

from eventlog import read_session
from harness.processes import RUN, STREAM
from schemas.events import TurnCompleted


async def session_turns(js: Any, session: str) -> dict[str, TurnCompleted]:
    """The session's turns in EVENTS by ``reply``."""
    events = await read_session(js, RUN, session, stream=STREAM)
    return {e.reply: e for e in events if isinstance(e, TurnCompleted)}


def turn_of(turns: dict[str, TurnCompleted], answer_id: str) -> TurnCompleted:
    """The turn whose reply ``answer_id`` ends in (the longest first: reply "1" must not take
    the answer "...-11")."""
    for reply in sorted(turns, key=len, reverse=True):
        if answer_id.endswith(("-" + reply, "_" + reply)):
            return turns[reply]
    raise RuntimeError(f"no turn in EVENTS for the answer {answer_id!r}")


def whole_context(turn: TurnCompleted) -> int:
    return turn.prefix_len + len(turn.prompt_ids) + len(turn.completion_ids)


async def check_continued(js: Any, conversations: Iterable[tuple[str, list[str]]]) -> int:
    """Every answer of a conversation ((session, its answers' ids in order)) after the first was
    recorded as a turn whose ``parent_turn`` is the previous answer's turn and whose
    ``prefix_len`` is that turn's whole context (continued token for token, no fork); the
    number of such turns. Raises at the first that is not."""
    checked = 0
    cache: dict[str, dict[str, TurnCompleted]] = {}
    for session, answers in conversations:
        if session not in cache:
            cache[session] = await session_turns(js, session)
        events = [turn_of(cache[session], answer) for answer in answers]
        for previous, event in itertools.pairwise(events):
            whole = whole_context(previous)
            if event.parent_turn != previous.turn or event.prefix_len != whole:
                raise RuntimeError(
                    f"session {session}: turn {event.turn} has parent_turn {event.parent_turn} "
                    f"and prefix_len {event.prefix_len}; expected turn {previous.turn} and its "
                    f"whole context of {whole} tokens"
                )
            checked += 1
    return checked

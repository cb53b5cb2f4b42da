"""What one turn is on its way through the core, in three values, each made once:

* ``Turn``: the prepared request (frozen): the prompt, the sampling parameters, what to record,
  where the turn joins the session, the messages and their keys (``TurnRequest.keys``, computed
  once and carried to the resend check, continuation, the event and its node);
* ``Generation``: what the backend produced so far (the accumulator: tokens, logprobs and text
  in the detokenizer, the finish reason, the replica, the weight version);
* ``TurnResult``: what the API adapters answer with, made from the turn's ``TurnCompleted``
  (``TurnResult.of``), live and for a resend alike.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from gateway.backends.interface import Prompt, SamplingParams
from gateway.core.conversation import MessageKey
from gateway.core.session_store import Session
from gateway.core.versions import TokenVersions
from gateway.decoding import Detokenizer
from schemas.events import TurnCompleted

__all__ = ["CLIENT_FINISH", "ChatPrompt", "Generation", "Kind", "Turn", "TurnResult"]

JSON = dict[str, Any]
# The API that carried a turn (TurnRequest.api); also the label of the turns metric.
Kind = Literal["chat.completions", "completions", "messages", "responses"]
# Finish reasons the log records that no client API has, as the client is told them: a turn
# ended at --max-versions-per-turn was cut short, as by max_tokens ("length"; Anthropic's
# "max_tokens", Responses' "incomplete").
CLIENT_FINISH = {"version_limit": "length"}


class ChatPrompt(NamedTuple):
    """A chat turn's prompt and where it joins the session (``TurnEngine.chat_prompt``)."""

    prompt: Prompt
    parent: int  # the kept turn it continues, else the one sharing the longest prefix (-1: none)
    prefix_len: int | None  # a continued turn's: the parent's whole context; None: not known
    # The UTF-8 of what the prompt's ids stand for (the render), where it is that exactly.
    text: bytes | None
    agent: JSON  # TurnCompleted.agent: the identity and how the tokens resolved it ({}: none)
    unsure: bool = False  # a turn this copy lacks could place it otherwise (Placement.unsure)


@dataclass(frozen=True, slots=True)
class Turn:
    """A prepared turn: what to send to the backend and what to record. Never changed: what
    generation produces is the ``Generation``'s."""

    session: Session
    kind: Kind
    prompt: Prompt
    messages: list[JSON]  # the full conversation of this turn (chat); [] for completions
    tools: list[JSON] | None
    params: SamplingParams
    stop_strings: list[str]
    parse_tools: bool
    logprobs: bool
    top_logprobs: int
    sampling: JSON
    forced_text: str = ""  # tool-call opening appended to the prompt to enforce tool_choice
    request: JSON = field(default_factory=dict)  # TurnRequest.record
    parallel_tool_calls: bool = True  # False: the reply keeps its first tool call only
    started: float = field(default_factory=time.perf_counter)
    # The turn it continues or shares the most with (-1: none); None: the kept turn sharing
    # the longest token prefix with the prompt, found when the event is built (completions).
    parent: int | None = None
    prefix_len: int | None = None  # ChatPrompt.prefix_len
    prompt_text: bytes | None = None  # ChatPrompt.text (the forced_text follows it)
    # message_key of each of ``messages`` (TurnRequest.keys); None: computed where needed.
    keys: Sequence[MessageKey] | None = None
    # The request's own id, every client-visible id's (TurnCompleted.reply_id): made when the
    # turn is prepared, its index only when it is appended.
    reply_id: str = ""
    agent: JSON = field(default_factory=dict)  # TurnCompleted.agent (Placement.record)
    # The session's turns in the state it was prepared from: turns from this index on were not
    # known to it (another gateway's, a concurrent request's), checked again at the append.
    known_turns: int = 0


@dataclass(slots=True, eq=False)
class Generation:
    """What the backend has produced for a turn so far (``Generating.tokens`` fills it)."""

    detok: Detokenizer  # the completion's ids, logprobs and text
    backend_id: str = ""  # the replica that served the turn
    finish: str = "length"  # set from the backend's last chunk
    logprobs_kind: str = "sampled"  # "raw" when the backend said so (TurnCompleted.logprobs_kind)
    first_token_at: float | None = None  # perf_counter at the first chunk (ttft)
    # Each token's policy version (TurnCompleted.version_spans, gateway.core.versions).
    versions: TokenVersions = field(default_factory=TokenVersions)
    # The resubmissions after the backend aborted the generation (sampling["continued"]): the
    # tokens before each, and its seed; and the time spent waiting for them to start.
    continued: list[JSON] = field(default_factory=list)
    interrupted_s: float = 0.0
    aborted_at: float = 0.0  # perf_counter at the latest abort
    # The prompt the backend read where it differs from the turn's (its server expanded the
    # images otherwise: GenerationChunk.served_prompt): the turn is recorded with it, marked
    # sampling["prompt_fork"] (gateway.serving.generating). None: the turn's own, as sent.
    served_prompt: Prompt | None = None


@dataclass
class TurnResult:
    reply: str  # the id the client's ids derive from (TurnCompleted.reply)
    completion_id: str
    text: str
    content: str | None
    tool_calls: list[JSON]
    finish_reason: str
    completion_ids: list[int]
    detok: Detokenizer
    prompt_tokens: int
    weight_version: int
    event: TurnCompleted  # what the log holds of the turn

    @property
    def usage(self) -> tuple[int, int]:
        return self.prompt_tokens, len(self.completion_ids)

    @classmethod
    def of(cls, event: TurnCompleted, detok: Detokenizer, *, tools_parsed: bool) -> TurnResult:
        """The result of the turn ``event`` records: live, with the detokenizer that generated
        it; for a resent request, with one that decoded the recorded ids again.

        ``tools_parsed``: the reply was parsed for tool calls. Its content is then None where
        the model wrote nothing but tool calls (the event records ""); else the text, as
        sampled, "" included."""
        prefix = "cmpl" if event.request.get("api") == "completions" else "chatcmpl"
        return cls(
            event.reply,
            f"{prefix}-{event.session}-{event.reply}",
            detok.text,
            (event.text or None) if tools_parsed else event.text,
            list(event.tool_calls),
            CLIENT_FINISH.get(event.finish_reason, event.finish_reason),
            list(detok.ids),
            detok,
            int(event.usage.get("prompt_tokens", 0)),
            event.weight_version,
            event,
        )

"""One turn, from a validated request to a durable event (the core every endpoint shares).

For a turn of a session: build the prompt ids (extending, token for token, the kept turn whose
conversation the request extends furthest: a session is a tree of conversations, e.g. a main
agent's and its sub-agents', attributed by the agent identity the client sent where it sent one:
``gateway.core.branches.placement``), generate on the backend, parse tool calls, then append:
publish ``TurnCompleted`` (delta-encoded against that parent turn) and wait for JetStream's ack,
and only then apply the event to the session.

Turns of one session run concurrently (DESIGN §4): preparing reads a snapshot of the session's
state (immutable), generating holds nothing, and only the append holds the session's lock
(``Session.lock``): the event is built against the state as it is then, which assigns the turn's
index. Nothing a client sees before depends on that index: every id derives from the request's
own ``reply_id``.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import hashlib
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, TypeVar

import msgspec
import numpy as np

from eventlog import AppendRefused, Publisher
from gateway.backends.interface import Backend, Prompt, PromptImage, SamplingParams
from gateway.core.agents import AgentIdentity
from gateway.core.aggregate import (
    SessionState,
    TurnDraft,
    TurnNode,
    prefix_parent,
    turn_event,
)
from gateway.core.branches import attachment, continued_turn, placement
from gateway.core.conversation import MessageKey, render_chars, text_chars
from gateway.core.session_store import ContextCache, Session, SessionLog, SessionStore
from gateway.core.versions import VersionTimeline
from gateway.decoding import Detokenizer
from gateway.errors import ContextLengthExceeded, InvalidRequest, ModelNotFound
from gateway.frozen import evolved
from gateway.images.uploads import ImageUploads
from gateway.metrics import GatewayMetrics
from gateway.serving.generating import SEED_MASK, Generating, prompt_fork
from gateway.serving.model_names import ModelAlias, ModelNames
from gateway.serving.turn_data import ChatPrompt, Generation, Turn, TurnResult
from gateway.templates import ChatTemplate
from gateway.tools import ToolCallParser
from schemas.errors import EventLogUnavailable
from schemas.events import SessionEvent, TurnCompleted
from schemas.images import ImageRef, image_parts, part_digest

__all__ = ["TurnEngine", "derived_seed", "renders_off_loop", "sampling_record"]

log = logging.getLogger(__name__)
JSON = dict[str, Any]
# Prompts whose render holds more characters than this (``render_chars``: text, tool calls'
# arguments, tools) or more messages are rendered and tokenized on a worker thread, so that the
# event loop (and /health) stays responsive while a long prompt is built or refused: a coding
# agent's turn at 100k tokens is ~36k characters of message text but ~100k rendered (its 63 KB
# of tools, its tool calls' arguments), whose render took ~15 ms and whose first tokenization
# ~65 ms on the loop when only the text was counted (issue 40: the fleet's loop stalls). Not
# lower: a 1,000-session fleet of 30k-token turns (~25k rendered) waited longer with them on
# the prompt thread (16k: added p99 700-740 ms against 475 ms at 32k, full runs, 2 cores).
_OFF_LOOP_CHARS = 32 * 1024
_OFF_LOOP_MESSAGES = 512
_NO_CACHE = ContextCache()
_NO_IMAGES: Mapping[str, bytes] = {}
T = TypeVar("T")


def renders_off_loop(messages: Sequence[JSON], tools: Sequence[JSON] | None) -> bool:
    """Whether a prompt of ``messages`` and ``tools`` is rendered and tokenized on a worker
    thread (``_OFF_LOOP_CHARS``)."""
    return len(messages) > _OFF_LOOP_MESSAGES or render_chars(messages, tools) > _OFF_LOOP_CHARS


class TurnEngine:
    def __init__(
        self,
        *,
        template: ChatTemplate,
        backend: Backend,
        publisher: Publisher,
        parser: ToolCallParser,
        model_name: str,
        metrics: GatewayMetrics,
        weight_version: Callable[[], int] = lambda: 0,
        store: SessionStore | None = None,
        allow_raw_logprobs: bool = False,
        instance: str = "",
        continue_wait_s: float = 120.0,
        max_versions_per_turn: int = 4,
        timeline: VersionTimeline | None = None,
        policy_version: Callable[[], Awaitable[int]] | None = None,
        model_aliases: Sequence[ModelAlias] = (),
        images: ImageUploads | None = None,
    ) -> None:
        self.template = template
        self.backend = backend
        self.publisher = publisher
        self.parser = parser
        self.model_name = model_name
        # The names requests may ask for: the served one and --model-aliases (a ValueError here
        # for an alias to another model: the gateway refuses to start).
        self.names = ModelNames.of(model_name, model_aliases)
        self.metrics = metrics
        self.weight_version = weight_version
        # The sessions and the log behind them: appends state what they expect of it, and a
        # refused one catches up (None: no log, as in tests of the core).
        self.store = store
        # Where a turn's images go before its event (the log's object store; None: nowhere,
        # as in tests of the core without a log).
        self.images = images
        # This gateway's name among a fleet's, mixed into derived seeds (derived_seed).
        self.instance = instance
        # --allow-raw-logprobs: a raw-mode replica serves any sampling, its turns marked "raw".
        self.allow_raw_logprobs = allow_raw_logprobs
        # The backend side: generation, continued through weight updates (``Generating``).
        self.generating = Generating(
            template=template,
            backend=backend,
            metrics=metrics,
            weight_version=weight_version,
            continue_wait_s=continue_wait_s,
            max_versions_per_turn=max_versions_per_turn,
            timeline=timeline,
            policy_version=policy_version,
        )
        # Streamed turns generating on their own (their client may have gone): see detach.
        self._detached: set[asyncio.Task[None]] = set()
        # Long prompts' renders and tokenizations (``renders_off_loop``), one at a time per
        # queue: in Python they hold the GIL but in the tokenizer's encode, so a pool adds no
        # speed, only contention for the GIL with the event loop and first turns' transient
        # token lists side by side (a 100k-token list of ints is ~3.6 MB, freed into memory the
        # process keeps: +1.5 MB RSS a 100k session with asyncio's default pool; issue 40).
        # Two queues: a session's first prompt (a whole conversation tokenized, 65-140 ms at
        # 100k tokens, mostly in Rust without the GIL) does not hold up the later turns of other
        # sessions, which render and encode only what is new.
        self._prompts = ThreadPoolExecutor(max_workers=1, thread_name_prefix="turnstream-prompt")
        self._first_prompts = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="turnstream-first-prompt"
        )

    async def off_loop(self, build: Callable[..., T], *args: Any, first: bool = False) -> T:
        """``build(*args)`` on a prompt thread (in this context, as ``asyncio.to_thread``):
        ``first``, a prompt built from nothing kept (its own queue), else the later turns'."""
        run = functools.partial(contextvars.copy_context().run, build, *args)
        queue = self._first_prompts if first else self._prompts
        return await asyncio.get_running_loop().run_in_executor(queue, run)

    def detach(self, work: Awaitable[None], name: str) -> asyncio.Task[None]:
        """Run ``work`` (a streamed turn's generation and append) as its own task, outliving
        the request that started it; ``close`` cancels what is left."""
        task: asyncio.Task[None] = asyncio.ensure_future(work)
        task.set_name(name)
        self._detached.add(task)
        task.add_done_callback(self._detached.discard)
        return task

    async def close(self) -> None:
        """Cancel the turns still generating (the gateway is stopping: none of them is
        appended, so none is half-written) and wait for them to end."""
        tasks = list(self._detached)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._prompts.shutdown(wait=False, cancel_futures=True)
        self._first_prompts.shutdown(wait=False, cancel_futures=True)

    def check_model(self, model: str | None) -> None:
        """A 404 for a requested model name that is neither the served one nor matched by an
        alias (None, as Chat Completions and Responses allow: the served one)."""
        if model is None or self.names.resolve(model) is not None:
            return
        shown = model if len(model) <= 120 else model[:120] + "..."  # a name is the client's
        head = shown.split("-", 1)[0]
        pattern = f"{head}-*" if head != shown else shown
        raise ModelNotFound(
            f"model {shown!r} is not served here; this gateway serves {self.model_name!r} "
            f"(GET /v1/models): ask for it by that name, or start the gateway with "
            f"--model-aliases '{pattern}={self.model_name}' to answer such names with it",
            param="model",
        )

    # -- preparing ------------------------------------------------------------------------

    async def chat_prompt(
        self,
        session: Session,
        messages: list[JSON],
        tools: list[JSON] | None,
        keys: Sequence[MessageKey],
        agent: AgentIdentity | None = None,
        images: Mapping[str, bytes] = _NO_IMAGES,
    ) -> ChatPrompt:
        """The prompt and the parent turn, from a snapshot of the session's state: the kept turn
        the request continues (``placement``: by ``agent``'s identity, then its tokens),
        continued token for token (its context ids, as an array, + the new messages' ids; its
        cached JSON text too), else the rendered conversation and its delta base (a fork's
        spawning turn; else the kept turn sharing the longest token prefix with it; -1: none).
        ``keys``: the messages' (``TurnRequest.keys``); ``images``: the bytes of their image
        parts, by digest (``TurnRequest.images``)."""
        chars = sum(text_chars(m) for m in messages)
        least = self.template.min_tokens(chars)
        if least > self.backend.max_context:
            raise ContextLengthExceeded(
                f"the messages hold {chars} characters, at least {least} tokens: more than the "
                f"model's context length of {self.backend.max_context} tokens",
                param="messages",
            )
        self.takes(images)
        state = session.state  # immutable: the snapshot this turn is prepared from
        if renders_off_loop(messages, tools):
            return await self.off_loop(
                self._chat_prompt,
                *(session, state, messages, tools, keys, agent, images),
                first=not state.nodes,  # nothing kept: the whole conversation tokenized
            )
        return self._chat_prompt(session, state, messages, tools, keys, agent, images)

    def takes(self, images: Mapping[str, bytes]) -> None:
        """A 400 where a request shows images to a model that takes none."""
        if images and self.template.vision is None:
            raise InvalidRequest(
                f"model {self.model_name!r} takes no images (its directory has no image "
                "processor, preprocessor_config.json): send text only, or serve a "
                "vision-language model",
                param="messages",
            )

    def _chat_prompt(
        self,
        session: Session,
        state: SessionState,
        messages: list[JSON],
        tools: list[JSON] | None,
        keys: Sequence[MessageKey],
        agent: AgentIdentity | None,
        images: Mapping[str, bytes],
    ) -> ChatPrompt:
        place = placement(state, messages, tools, keys, agent)
        recorded = place.record(agent)
        node = place.continued
        if node is not None and self._sampled_a_placeholder(node):
            node = None  # rendered from the conversation's text below: a fork at that token
        full: str | None = None
        utf8: bytes | None = None
        if node is not None:
            # Taken: this turn's context will hold the next turn's cache (one per chain).
            cache = session.take_context(node.turn) or _NO_CACHE
            text, head = cache.text, cache.json_head
            suffix: list[int] | None = None
            if text is not None:  # one render, where it starts with the kept turn's text
                # The kept turn's tools (continued_turn: equal to these), whose JSON the
                # template wrote once for the session (an agent's 63 KB of tools, every turn).
                tools = node.tools
                self.template.keep_json(tools)
                suffix, full, utf8 = self.template.extension_ids(text, messages, tools)
            rendered = suffix is not None
            if suffix is None:  # the render and the kept turn's render without this turn's
                done = len(node.conversation)
                suffix = self.template.continuation_ids(
                    node.conversation, node.completion_ids, messages[done:], tools
                )
            if suffix is not None:
                context = node.context_ids
                ids = np.concatenate([context, np.asarray(suffix, dtype=np.int32)])
                prompt = Prompt(
                    ids,
                    head=head,
                    head_len=len(context) if head else 0,
                    images=self._images(ids, messages, images, node.images, len(context)),
                )
                said = utf8 if rendered else None
                return ChatPrompt(prompt, node.turn, len(context), said, recorded, place.unsure)
        if full is None:
            full = self.template.render(messages, tools, generation=True)
        encoded = self.template.prompt_ids_of(full, messages)
        prompt = Prompt(encoded, images=self._images(encoded, messages, images))
        base = place.base if place.base is not None else prefix_parent(state, prompt.ids)
        said = full.encode("utf-8") if utf8 is None else utf8
        return ChatPrompt(prompt, base, None, said, recorded, place.unsure)

    def _sampled_a_placeholder(self, node: TurnNode) -> bool:
        """Whether the kept turn's completion holds the model's image placeholder, which a
        model can sample (the tiny random one does, now and then). No image stands for it, and
        neither a backend nor the trainer's forward reads a placeholder beside real images that
        is not one of theirs (their counts differ): the turn continuing it is rendered from the
        conversation's text instead (the reply's text leaves the special token out), its prompt
        sharing the kept ids up to that token, recorded as what it is."""
        vision = self.template.vision
        if vision is None or not np.any(node.completion_ids == vision.image_token_id):
            return False
        log.info(
            "turn %d sampled the image placeholder %s: the turn continuing it is rendered from "
            "the conversation's text",
            node.turn,
            vision.image_token,
        )
        return True

    def _images(
        self,
        ids: Sequence[int] | np.ndarray,
        messages: list[JSON],
        images: Mapping[str, bytes],
        kept: Sequence[ImageRef] = (),
        context_len: int = 0,
    ) -> tuple[PromptImage, ...]:
        """The images of a chat prompt's ids (() for a text prompt). A prompt that continues a
        kept turn (``context_len`` of its ids are that turn's context) keeps that turn's images
        where they are (``kept``: placed as the backend read them, which may differ from this
        gateway's expansion: gateway.serving.generating) and locates only the new ones."""
        vision = self.template.vision
        if vision is None:
            return ()
        parts = list(image_parts(messages))
        if not kept or [part_digest(p) for p in parts[: len(kept)]] != [r.sha256 for r in kept]:
            return vision.locate(np.asarray(ids), parts, images)
        missing = next((r.sha256 for r in kept if r.sha256 not in images), None)
        if missing is not None:  # as VisionSpec.locate says it
            raise InvalidRequest(
                f"image sha256:{missing[:16]}... is named but its bytes were not sent: send "
                "each image of the conversation as data (a data URL or base64)",
                param="messages",
            )
        new = vision.locate(np.asarray(ids)[context_len:], parts[len(kept) :], images)
        return (
            *(PromptImage(ref, images[ref.sha256]) for ref in kept),
            *(
                PromptImage(
                    msgspec.structs.replace(i.ref, offset=i.ref.offset + context_len), i.data
                )
                for i in new
            ),
        )

    def params(
        self,
        session: Session,
        prompt_len: int,
        budget: int | None,
        temperature: float | None,
        top_p: float | None,
        seed: int | None,
        top_logprobs: int,
    ) -> SamplingParams:
        room = self.backend.max_context - prompt_len
        if room <= 0:
            raise ContextLengthExceeded(
                f"session {session.name}: prompt of {prompt_len} tokens leaves no room in the "
                f"model's context length of {self.backend.max_context} tokens",
                param="messages",
            )
        started = session.next_request()
        if seed is None:
            # Every request's randomness is its own (issue 19): without one a replica draws from
            # its engine's generator, and replicas started alike sample alike. The number is the
            # request's among the session's started ones (Session.started: from its turns, so a
            # session served one request at a time, none failing, derives seed t for turn t),
            # never shared by two requests in flight together. The event's index is assigned at
            # its append and may differ (turns appended in another order, an earlier attempt
            # answered 503 that took an index): the recorded seed is the one sent, and a replay
            # sends it.
            seed = derived_seed(session.state.run, session.state.id, started, self.instance)
        # max_tokens is a cap (DESIGN §4): agents ask for 32k-64k whatever the model, so a cap
        # past the room left is lowered to fit (the sampling record keeps both values).
        return SamplingParams(
            max_tokens=room if budget is None else min(budget, room),
            temperature=1.0 if temperature is None else temperature,
            top_p=1.0 if top_p is None else top_p,
            seed=seed,
            stop_token_ids=self.template.stop_token_ids,
            top_logprobs=top_logprobs,
            allow_raw_logprobs=self.allow_raw_logprobs,
        )

    # -- running ----------------------------------------------------------------------------

    def generation(self, turn: Turn) -> Generation:
        """An empty accumulator for ``turn``'s completion."""
        return self.generating.generation(turn)

    def tokens(
        self, turn: Turn, gen: Generation, params: SamplingParams | None = None
    ) -> AsyncIterator[Generation]:
        """``Generating.tokens``: the turn's generation, continued through aborts."""
        return self.generating.tokens(turn, gen, params)

    async def run(self, turn: Turn) -> TurnResult:
        """A whole turn, not streamed (generated concurrently with the session's others).

        Nothing reads this turn token by token, so without stop strings the backend is asked
        for the completion in one response (``SamplingParams.stream``), decoded and detokenized
        once (its ``ttft_ms`` is then the whole generation's). Stop strings keep the stream:
        the backend would otherwise generate past the first match, up to ``max_tokens``."""
        params = turn.params if turn.stop_strings else evolved(turn.params, stream=False)
        gen = self.generation(turn)
        async for _ in self.tokens(turn, gen, params):
            pass
        return await self.finish(turn, gen)

    async def finish(
        self, turn: Turn, gen: Generation, client_gone: Callable[[], bool] | None = None
    ) -> TurnResult:
        """Parse, then append: under the session's lock, build the event against the state as
        it is now (its index: the turns so far), publish it (awaiting the ack) and apply it. A
        session closed meanwhile records nothing (SessionClosed: 409). ``client_gone``, asked at
        the append: the client left before the reply was whole (``TurnCompleted.client_gone``)."""
        session = turn.session
        detok = gen.detok
        text = detok.text
        content: str | None = text
        tool_calls: list[JSON] = []
        finish = gen.finish
        if turn.parse_tools:
            parsed = self.parser.parse(turn.forced_text + text)
            content = parsed.content
            tool_calls = [
                {
                    "id": f"call_{secrets.token_hex(12)}",
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.tool_calls
            ]
            if not turn.parallel_tool_calls:
                tool_calls = tool_calls[:1]
            if tool_calls:
                finish = "tool_calls"
        gen.versions.resolve(self.generating.timeline)
        version = gen.versions.oldest
        if version is None:
            version = self.weight_version()
        sampling = turn.sampling
        if gen.continued:
            sampling = {**sampling, "continued": gen.continued}
        # The prompt the backend read (gateway.serving.generating): the turn's, or another
        # expansion of its images, recorded as it was read, its delta against the parent taken
        # anew (prefix_len None), marked.
        prompt = turn.prompt
        prefix_len = turn.prefix_len
        if gen.served_prompt is not None:
            prompt, prefix_len = gen.served_prompt, None
            fork = prompt_fork(turn.prompt, prompt, gen.backend_id)
            sampling = {**sampling, "prompt_fork": fork}
        generated = time.perf_counter()
        draft = TurnDraft(
            prompt_ids=prompt.ids,
            messages=turn.messages,
            tools=turn.tools,
            completion_ids=detok.ids,
            logprobs=detok.logprobs,
            text=content or "",
            tool_calls=tool_calls,
            finish_reason=finish,
            sampling=sampling,
            weight_version=version,
            version_spans=gen.versions.spans(),
            template_hash=self.template.hash,
            backend=gen.backend_id,
            timings=_timings(turn, gen, generated),
            created_at=time.time(),
            request=turn.request,
            logprobs_kind=gen.logprobs_kind,
            parent_turn=turn.parent,
            prefix_len=prefix_len,
            keys=turn.keys,
            reply_id=turn.reply_id,
            agent=turn.agent,
            images=tuple(image.ref for image in prompt.images),
        )
        if turn.prompt.images:
            await self._store_images(turn)
        async with session.lock:
            session.ensure_open()  # closed while this turn generated: it is not recorded
            if client_gone is not None and client_gone():
                draft = replace(draft, client_gone=True)
            if session.state.turns > turn.known_turns:  # turns it was not prepared with
                draft = self._rebased(session, draft, turn.known_turns)
            event = await self._append(session, draft)
            # What the turn continuing this one will reuse of it (beside the state, not in it).
            if session.state.nodes.get(event.turn) is not None:
                text_parts = None
                if turn.prompt_text is not None:
                    sampled = self.template.decode(detok.ids, skip_special_tokens=False)
                    forced = turn.forced_text.encode("utf-8")
                    text_parts = (turn.prompt_text, forced, sampled.encode("utf-8"))
                head = prompt.extended_json_head(detok.ids) if prompt.encoded else ()
                if text_parts is not None or head:
                    session.keep_context(event.turn, ContextCache(text_parts, head))
        self.metrics.tokens_in.inc(len(turn.prompt))
        self.metrics.tokens_out.inc(len(detok.ids))
        self.metrics.turns_of(turn.kind).inc()
        return TurnResult.of(event, detok, tools_parsed=turn.parse_tools)

    async def _store_images(self, turn: Turn) -> None:
        """Put the turn's new images (those after the kept context it continues; all of them
        for a turn that continues none) in the log's object store, before the event that names
        them is published: a stored event never names a missing image."""
        if self.images is None:
            return
        after = turn.prefix_len or 0
        for image in turn.prompt.images:
            if image.ref.offset >= after:
                await self.images.put(image.data, image.ref.sha256)

    async def _append(self, session: Session, draft: TurnDraft) -> TurnCompleted:
        """``draft`` as the session's next turn: published stating the session's last sequence
        as this gateway knows it, acknowledged, applied. The caller holds the session's lock.

        The log decides (DESIGN §4): refused because another writer stored events meanwhile
        (a turn of a sibling agent on another gateway, a close), the session catches up on
        those only, and the turn is built again against it (its index; its parent, where the
        prompt extends a turn it did not know token for token): a closed session records
        nothing (409). An earlier attempt of this very request found in the catch-up (stored,
        its ack lost) is the turn."""
        log_ = None if self.store is None else self.store.log
        for _ in range(SessionLog.max_refusals):
            event = turn_event(session.state, draft)
            try:
                with self.metrics.publish_latency.time():
                    if log_ is None:
                        receipt = await self.publisher.publish(event)
                    else:
                        expect = log_.expectation(session)
                        receipt = await self.publisher.publish(event, expect=expect)
            except AppendRefused as refused:
                reach: int | None = refused.last_seq
            else:
                if not (receipt.duplicate and log_ is not None):
                    break
                reach = None
            # Refused (another writer stored events since), or answered as a duplicate (a
            # replicated stream de-duplicates a Msg-Id before it checks the expectation: another
            # gateway's turn at this index, or an earlier try of ours whose ack was lost): read
            # back what the log holds.
            assert self.store is not None  # only an expected append gets here
            caught = await self.store.catch_up(session, "refused", reach=reach)
            ours = _own_event(caught, draft.reply_id)
            if ours is not None:
                return ours  # applied by the catch-up
            self.metrics.appends_refused.labels("turn").inc()
            session.ensure_open()  # closed by another writer: not recorded (409)
            draft = self._rebased(session, draft, _first_turn(caught, session))
        else:
            raise EventLogUnavailable(
                f"session {session.name}: {SessionLog.max_refusals} appends in a row were "
                "refused, other writers appending to it each time; nothing was recorded, send "
                "the request again"
            )
        if log_ is not None:
            log_.appended(session, receipt)
        self.metrics.attached_as(attachment(session.state, event)).inc()
        session.apply(event, draft.keys)
        return event

    def _rebased(self, session: Session, draft: TurnDraft, unknown_from: int) -> TurnDraft:
        """``draft`` against turns it was not prepared with (``unknown_from`` on: another
        gateway's, caught up; a concurrent request's): where its prompt starts with the whole
        context of such a turn, longer than its parent's, that turn is its parent (the delta
        against it is exact). A prompt that continues such a turn by its messages but not
        token for token was built from a stale copy: counted, recorded as generated."""
        state, prompt = session.state, np.asarray(draft.prompt_ids)
        parent, shared = draft.parent_turn, draft.prefix_len
        if parent is None or parent not in state.nodes or shared is None:
            parent, shared = -1, 0
        for node in state.nodes.values():
            n = len(node.context_ids)
            if (
                shared < n <= len(prompt)
                and not node.event.client_gone
                and np.array_equal(node.context_ids, prompt[:n])
            ):
                parent, shared = node.turn, n
        by_messages = continued_turn(state, draft.messages, draft.tools, draft.keys)
        if (
            by_messages is not None
            and by_messages.turn >= unknown_from
            and by_messages.turn != parent
        ):
            self.metrics.stale_prompts.inc()
            log.warning(
                "session %s: a turn continues turn %d, which this gateway did not know when it "
                "built the prompt, not token for token (recorded as generated)",
                session.name,
                by_messages.turn,
            )
        if parent == draft.parent_turn:
            return draft
        return replace(draft, parent_turn=parent, prefix_len=shared if parent >= 0 else None)

    def recorded(self, event: TurnCompleted, *, tools_parsed: bool) -> TurnResult:
        """The result of a turn already in the log (a resent request gets it again)."""
        detok = Detokenizer(self.template.decode)
        detok.add(event.completion_ids.tolist(), event.logprobs.tolist())
        detok.finish()
        return TurnResult.of(event, detok, tools_parsed=tools_parsed)


def _timings(turn: Turn, gen: Generation, generated: float) -> dict[str, float]:
    timings = {
        "ttft_ms": round(1000 * ((gen.first_token_at or generated) - turn.started), 3),
        "generate_ms": round(1000 * (generated - turn.started), 3),
    }
    if gen.continued:  # waiting for the backend to take the continuations
        timings["interrupted_ms"] = round(1000 * gen.interrupted_s, 3)
    return timings


def _first_turn(caught: Sequence[SessionEvent], session: Session) -> int:
    """The first turn index among ``caught`` (the session's turns if none)."""
    return min(
        (e.turn for e in caught if isinstance(e, TurnCompleted)), default=session.state.turns
    )


def _own_event(events: Sequence[SessionEvent], reply_id: str) -> TurnCompleted | None:
    """The turn among ``events`` that this request's own reply id names (None: none)."""
    if not reply_id:
        return None
    return next(
        (e for e in events if isinstance(e, TurnCompleted) and e.reply_id == reply_id), None
    )


def derived_seed(run: str, session: str, turn: int, instance: str = "") -> int:
    """The seed of a turn whose request sets none: BLAKE2b with an 8-byte digest of
    ``turnstream/seed/<run>/<session>/<turn>`` (``/<instance>`` appended where given), read
    big-endian, masked to 63 bits; ``turn`` is the request's number among the session's started
    requests (``Session.next_request``: the turn index where the session serves one request at a
    time), ``instance`` the gateway's name among a fleet's (``GatewaySettings.instance_id``): two
    gateways serving one session count its requests apart, and would otherwise derive one seed
    for two requests started at once.

    Stable across processes, hosts and Python versions (no ``hash()``), and distinct per
    session and request, so the sessions of a GRPO group (one prompt) never share a sample stream,
    wherever they are routed. 63 bits: vLLM takes an int64 seed (its OpenAI server bounds it to
    ``torch.long``), torch's ``Generator.manual_seed`` one below 2**64; a non-negative int64
    suits both, and the gateway's own ``seed`` field (int64).

    >>> derived_seed("r1", "s1", 0), derived_seed("r1", "s1", 1)
    (4799148068869229546, 6702576449194413337)
    """
    key = f"turnstream/seed/{run}/{session}/{turn}{'/' + instance if instance else ''}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") & SEED_MASK


def sampling_record(
    params: SamplingParams,
    stop: Sequence[str],
    tool_choice: object,
    asked: int | None,
    *,
    asked_seed: int | None,
) -> JSON:
    """What the turn was sampled with, recorded in its event: all a replay needs to send it
    again (``turnstream replay --regenerate``). ``asked`` and ``asked_seed`` are the request's
    max_tokens and seed; a seed the request did not set was derived (``derived_seed``)."""
    record: JSON = {
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "stop_token_ids": list(params.stop_token_ids),
    }
    if asked is not None and asked != params.max_tokens:
        record["max_tokens_requested"] = asked
    if params.seed is not None:
        record["seed"] = params.seed
        if asked_seed is None:
            record["seed_derived"] = True
    if stop:
        record["stop"] = list(stop)
    if tool_choice is not None:
        record["tool_choice"] = tool_choice
    return record

"""Completions: a turn from a text or token-id prompt (not streamed), generated concurrently with
the session's other turns (``TurnEngine.finish`` appends it under the session's lock). Its
parent is the kept turn sharing the longest token prefix, found at the append; the agent
identity is recorded as sent (a raw prompt has no conversation to resolve it against)."""

from __future__ import annotations

import secrets
import time

import numpy as np

from gateway.backends.interface import Prompt
from gateway.core.agents import AgentIdentity
from gateway.core.session_store import Session
from gateway.errors import InvalidRequest
from gateway.protocol.completions import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
)
from gateway.serving.chat_service import usage
from gateway.serving.engine import TurnEngine, sampling_record
from gateway.serving.model_names import answered_as
from gateway.serving.turn_data import Turn, TurnResult

__all__ = ["CompletionServing"]


class CompletionServing:
    def __init__(self, engine: TurnEngine) -> None:
        self.engine = engine

    def prepare(
        self, session: Session, req: CompletionRequest, agent: AgentIdentity | None = None
    ) -> Turn:
        engine = self.engine
        if isinstance(req.prompt, str):
            prompt_ids = engine.template.encode(req.prompt)
        else:
            prompt_ids = list(req.prompt)
            vocab = engine.template.vocab_size
            if max(prompt_ids) >= vocab:
                raise InvalidRequest(
                    f"token id {max(prompt_ids)} is outside the vocabulary (0..{vocab - 1})",
                    param="prompt",
                )
        vision = engine.template.vision
        if vision is not None and vision.image_token_id in prompt_ids:
            # A placeholder with no image behind it: the backend would read pixels it lacks.
            raise InvalidRequest(
                f"the prompt holds the model's image placeholder {vision.image_token!r} (id "
                f"{vision.image_token_id}); /v1/completions takes text only: send images as "
                "image parts through chat/completions, messages or responses",
                param="prompt",
            )
        top = req.logprobs or 0
        params = engine.params(
            session, len(prompt_ids), req.max_tokens, req.temperature, req.top_p, req.seed, top
        )
        return Turn(
            session,
            "completions",
            Prompt(prompt_ids),
            [],
            None,
            params,
            req.stop_strings,
            False,
            req.logprobs is not None,
            top,
            sampling_record(params, req.stop_strings, None, req.max_tokens, asked_seed=req.seed),
            request={"api": "completions", **({} if req.model is None else {"model": req.model})},
            reply_id=secrets.token_hex(6),
            agent={} if agent is None else agent.record(),
        )

    async def complete(
        self, session: Session, req: CompletionRequest, agent: AgentIdentity | None = None
    ) -> Completion:
        session.ensure_open()
        turn = self.prepare(session, req, agent)
        result = await self.engine.run(turn)
        choice = CompletionChoice.build(
            text=result.text,
            finish_reason=result.finish_reason,
            logprobs=self._logprobs(turn, result) if turn.logprobs else None,
        )
        return Completion.build(
            id=result.completion_id,
            created=int(time.time()),
            model=answered_as(req.model, self.engine.model_name),
            choices=[choice],
            usage=usage(result),
        )

    def _logprobs(self, turn: Turn, result: TurnResult) -> CompletionLogprobs:
        decode = self.engine.template.decode
        tokens = [decode([i], skip_special_tokens=False) for i in result.completion_ids]
        return CompletionLogprobs.build(
            tokens=tokens,
            token_logprobs=result.detok.logprobs,
            top_logprobs=[
                {
                    decode([a.token_id], skip_special_tokens=False): a.logprob
                    for a in alts[: turn.top_logprobs]
                }
                for alts in result.detok.top_logprobs
            ],
            text_offset=np.cumsum([0, *[len(t) for t in tokens[:-1]]]).tolist(),
        )

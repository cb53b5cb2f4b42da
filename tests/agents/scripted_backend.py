"""A scripted policy behind a vLLM-compatible server: the ONLY stand-in of the agent tests.

Why a stand-in at all: the tiny model (gateway.model) emits noise, so it can never decide to call
Claude Code's ``Bash`` or Codex's ``exec_command`` with a valid command, and a real agent session
needs that decision. Everything else in these tests is real: the CLIs, the gateway started by
``turnstream up --backend vllm``, NATS, the fold, the shards. The stand-in replaces only the
*choice* of tokens, not their accounting:

- it speaks the subset of vLLM's ``POST /v1/completions`` that gateway/backends/vllm.py uses
  (token-id ``prompt``, ``return_token_ids``, ``return_tokens_as_token_ids``, ``logprobs: k``,
  ``stop_token_ids``, ``stream`` with ``stream_options.include_usage``, or not streamed), plus
  ``GET /v1/models`` (name and ``max_model_len``) and ``GET /health``;
- it decodes the prompt ids with the tiny model's own tokenizer and picks the scripted step
  (tests/agents/script.py) from the decoded prompt: how many ``<tool_response>`` blocks the
  conversation holds, and which shell tool the ``<tools>`` section offers (Claude Code's ``Bash``,
  Codex's ``exec_command`` / ``shell_command`` / ``shell``);
- it writes the reply as the model would, in the template's tool-call format (hermes:
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``), ends it with the template's
  end-of-turn token ``<|im_end|>`` (which must be one of the request's ``stop_token_ids``), and
  tokenizes it with the same tokenizer;
- the log-probs it returns are REAL: the tiny model's, teacher-forced over prompt + reply
  (``log_softmax`` of the logits divided by the temperature, gathered at the reply's ids), and the
  top-k alternatives of that same distribution.

One liberty, on purpose: the agents' prompts are 40-50k byte-level tokens while the tiny model
has 4096 positions (a real vLLM serving it would refuse them), and a full-length forward pass on
a 2-core machine takes ~17 s, quadratic in length. The log-probs are therefore conditioned on the
last ``--window`` tokens of the prompt (default: the model's positions less the reply's length;
``--window 0`` conditions on the whole prompt). ``scored_logprobs`` is the one function that
computes them, so a test can recompute a recorded turn's log-probs from the shard's tokens.

``GET /requests`` lists every completion request served (prompt and reply ids, step, scripted
role, reply, streamed, arrival and answer times), so a test counts the model calls that reached
the backend, compares the recorded tokens with them, and sees which were in flight together
(``--delay S`` holds every answer S seconds, so concurrent requests overlap visibly). Run::

    .venv/bin/python -m tests.agents.scripted_backend --model DIR --port 8100 --max-model-len 131072
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import threading
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from tests.agents.script import FINAL_TEXT, claude_bash_call, codex_shell_call, step_for
from tests.agents.subagent_script import subagent_step

__all__ = ["Scorer", "ScriptedReply", "scored_logprobs", "scripted_reply", "served_app"]

END_OF_TURN = "<|im_end|>"
_TOOLS_SECTION = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_TOOL_RESPONSE = "\n<tool_response>\n"


@dataclass(frozen=True)
class ScriptedReply:
    step: int  # 1-based model call of the script (tool results seen + 1)
    agent: str  # "claude_code", "codex" or "none" (no shell tool offered)
    text: str  # without the end-of-turn token
    role: str = "script"  # the sub-agent script's "main", "FORK" or "FRESH"; else "script"


def offered_tools(prompt_text: str) -> dict[str, dict[str, Any]]:
    """The tools the rendered prompt's ``<tools>`` section lists (one JSON per line): their
    parameter schemas by name."""
    section = _TOOLS_SECTION.search(prompt_text)
    tools: dict[str, dict[str, Any]] = {}
    for line in section.group(1).splitlines() if section else []:
        try:
            tool = json.loads(line)
        except ValueError:
            continue
        if isinstance(tool, dict):
            function = tool.get("function", tool)
            if isinstance(function, dict) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                tools[function["name"]] = parameters if isinstance(parameters, dict) else {}
    return tools


def scripted_reply(prompt_text: str) -> ScriptedReply:
    """The scripted step for a decoded prompt (pure): the sub-agent script's
    (tests/agents/subagent_script.py) when the conversation is one of its agents', else the
    three-call script's (tests/agents/script.py).

    >>> scripted_reply("<|im_start|>user\\nhi<|im_end|>\\n<|im_start|>assistant\\n").text
    'Done: notes.txt read and answer.txt written.'
    """
    tools = offered_tools(prompt_text)
    # Results only count after the tools section (whose instructions name no <tool_response>).
    section = _TOOLS_SECTION.search(prompt_text)
    conversation = prompt_text[section.end() :] if section else prompt_text
    results = conversation.count(_TOOL_RESPONSE)
    if "Bash" in tools:
        agent = "claude_code"
    elif tools.keys() & {"exec_command", "shell_command", "shell"}:
        agent = "codex"
    else:
        agent = "none"
    scripted = subagent_step(conversation, tools)
    if scripted is not None:
        role, text = scripted
        return ScriptedReply(results + 1, agent, text, role)
    command = step_for(results) if agent != "none" else None
    if command is None:
        return ScriptedReply(results + 1, agent, FINAL_TEXT)
    if agent == "claude_code":
        name, arguments = claude_bash_call(command)
    else:
        name, arguments = codex_shell_call(set(tools), command)
    call = json.dumps({"name": name, "arguments": arguments})
    return ScriptedReply(results + 1, agent, f"<tool_call>\n{call}\n</tool_call>")


def scored_logprobs(
    model: Any,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    *,
    temperature: float,
    window: int | None,
    top_k: int = 0,
) -> tuple[list[float], list[dict[int, float]]]:
    """The model's log-probs of ``completion_ids`` after ``prompt_ids`` (teacher-forced), and the
    ``top_k`` most likely ids at each position. ``window``: condition on only the last that many
    prompt tokens (None: the model's positions less the completion; 0: the whole prompt)."""
    if window is None:
        window = max(1, int(model.config.max_position_embeddings) - len(completion_ids))
    context = list(prompt_ids[-window:]) if window > 0 else list(prompt_ids)
    ids = torch.tensor([context + list(completion_ids)])
    with torch.inference_mode():
        logits = model(ids, logits_to_keep=len(completion_ids) + 1).logits[0, :-1].float()
    if temperature > 0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(list(completion_ids))
    sampled = logprobs.gather(1, targets[:, None])[:, 0].tolist()
    top: list[dict[int, float]] = []
    if top_k > 0:
        values, indices = logprobs.topk(top_k, dim=-1)
        top = [
            dict(zip(row_ids, row_values, strict=True))
            for row_ids, row_values in zip(indices.tolist(), values.tolist(), strict=True)
        ]
    return sampled, top


class Scorer:
    """The tiny model and its tokenizer; one forward pass at a time."""

    def __init__(self, model_dir: Path, window: int | None) -> None:
        self.tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        self.window = window
        self.end_of_turn = self.tokenizer.convert_tokens_to_ids(END_OF_TURN)
        self._lock = threading.Lock()

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=False))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def score(
        self, prompt_ids: Sequence[int], completion_ids: Sequence[int], temperature: float, k: int
    ) -> tuple[list[float], list[dict[int, float]]]:
        with self._lock:
            return scored_logprobs(
                self.model,
                prompt_ids,
                completion_ids,
                temperature=temperature,
                window=self.window,
                top_k=k,
            )


@dataclass
class ServedRequest:
    prompt_tokens: int
    completion_tokens: int
    completion_ids: list[int]
    logprobs: list[float]
    temperature: float
    step: int
    agent: str
    reply: str
    stream: bool
    finish_reason: str
    role: str  # ScriptedReply.role
    prompt_ids: list[int]
    # In flight at the backend from ``arrived`` to at least ``answered`` (the reply computed,
    # after the --delay): one request arriving before another is answered overlaps it.
    arrived: float
    answered: float


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "BadRequestError"}}, status)


def served_app(
    scorer: Scorer,
    model_name: str,
    max_model_len: int,
    log_path: Path | None,
    delay: float = 0.0,
) -> Starlette:
    """``delay``: seconds every answer waits before it is computed (requests in flight together
    at the backend overlap visibly, as they would on a real server)."""
    served: list[ServedRequest] = []

    async def completions(request: Request) -> Response:
        arrived = time.time()
        try:
            body = await request.json()
            prompt = [int(token) for token in body["prompt"]]
        except (ValueError, KeyError, TypeError):
            return _error(400, "expected a JSON body with a token-id 'prompt'")
        if not prompt or isinstance(body["prompt"][0], str):
            return _error(400, "this stand-in takes token-id prompts only")
        stop_ids = [int(token) for token in body.get("stop_token_ids") or []]
        if scorer.end_of_turn not in stop_ids:
            return _error(400, f"{END_OF_TURN} ({scorer.end_of_turn}) is not among stop_token_ids")
        k = int(body.get("logprobs") or 0)
        temperature = float(body.get("temperature", 1.0))
        max_tokens = int(body.get("max_tokens") or 16)
        reply = scripted_reply(scorer.decode(prompt))
        if delay > 0:
            await asyncio.sleep(delay)
        ids = [*scorer.encode(reply.text), scorer.end_of_turn]
        finish_reason = "stop" if len(ids) <= max_tokens else "length"
        ids = ids[:max_tokens]
        sampled, top = await asyncio.to_thread(scorer.score, prompt, ids, temperature, k)
        stream = bool(body.get("stream"))
        record = ServedRequest(
            len(prompt),
            len(ids),
            ids,
            sampled,
            temperature,
            reply.step,
            reply.agent,
            reply.text,
            stream,
            finish_reason,
            reply.role,
            prompt,
            arrived,
            time.time(),
        )
        served.append(record)
        if log_path is not None:
            with log_path.open("a") as log:
                log.write(json.dumps(asdict(record)) + "\n")
        texts = [scorer.decode([token]) for token in ids]
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "total_tokens": len(prompt) + len(ids),
        }
        envelope = {
            "id": f"cmpl-{uuid.uuid4().hex[:16]}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": model_name,
        }
        if not stream:
            choice = _choice(ids, texts, sampled, top, k, 0, finish_reason)
            choice["prompt_token_ids"] = prompt
            return JSONResponse({**envelope, "choices": [choice], "usage": usage})

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(ids)):
                last = i == len(ids) - 1
                choice = _choice(
                    ids[i : i + 1],
                    texts[i : i + 1],
                    sampled[i : i + 1],
                    top[i : i + 1],
                    k,
                    sum(len(text) for text in texts[:i]),
                    finish_reason if last else None,
                )
                if i == 0:
                    choice["prompt_token_ids"] = prompt  # the first event echoes it, as vLLM does
                yield _sse({**envelope, "choices": [choice], "usage": None})
            if (body.get("stream_options") or {}).get("include_usage"):
                yield _sse({**envelope, "choices": [], "usage": usage})
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def models(_: Request) -> Response:
        card = {
            "id": model_name,
            "object": "model",
            "owned_by": "scripted",
            "max_model_len": max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(_: Request) -> Response:
        return Response(status_code=200)

    async def requests(request: Request) -> Response:
        """What was served, in the order answered; ``?since=N`` skips the first N."""
        try:
            since = max(0, int(request.query_params.get("since", "0")))
        except ValueError:
            return _error(400, "since must be an integer")
        return JSONResponse([asdict(record) for record in served[since:]])

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/requests", requests, methods=["GET"]),
        ]
    )


def _choice(
    ids: list[int],
    texts: list[str],
    sampled: list[float],
    top: list[dict[int, float]],
    k: int,
    offset: int,
    finish_reason: str | None,
) -> dict[str, Any]:
    offsets = [offset + sum(len(text) for text in texts[:i]) for i in range(len(ids))]
    logprobs = {
        "tokens": [f"token_id:{token}" for token in ids],
        "token_logprobs": sampled,
        # vLLM's shape: the k most likely, plus the sampled token when it is not among them.
        "top_logprobs": [
            {
                **{f"token_id:{alt}": value for alt, value in position.items()},
                f"token_id:{token}": logprob,
            }
            for token, logprob, position in zip(ids, sampled, top or [{}] * len(ids), strict=True)
        ]
        if k > 0
        else None,
        "text_offset": offsets,
    }
    return {
        "index": 0,
        "text": "".join(texts),
        "token_ids": ids,
        "logprobs": logprobs,
        "finish_reason": finish_reason,
        "stop_reason": None,
    }


def _sse(event: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="the tiny model's directory")
    parser.add_argument("--model-name", default="tiny")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, default=131072)
    parser.add_argument(
        "--window", type=int, default=None, help="prompt tokens the log-probs are conditioned on"
    )
    parser.add_argument("--log", type=Path, default=None, help="JSON lines, one per request")
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument(
        "--delay", type=float, default=0.0, help="seconds every answer waits before it is made"
    )
    args = parser.parse_args()
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    scorer = Scorer(args.model, args.window)
    app = served_app(scorer, args.model_name, args.max_model_len, args.log, args.delay)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

"""A weight update in the middle of a turn (issue 37), end to end on the local backend: a real
gateway process on the tiny model, agents on the openai SDK, and the reference trainer's own
``publish`` putting a new version into ``ts_policy`` with ``update_mode="abort"`` while a turn
generates. The turn continues on the new weights: the client gets one answer, the log records it
once, each token at the version that sampled it, and a fp32 recomputation under each version's
weights gives each part's recorded log-probs. (vLLM's pause/abort/resume: tests/deploy/.)"""

from __future__ import annotations

import asyncio
from pathlib import Path

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from eventlog import read_session
from eventlog.buckets import Bucket
from gateway.backends.sampler import processed_log_probs
from gateway.model import ensure_tiny_model
from schemas import TurnCompleted
from tests.conftest import Log
from tests.helpers.gateway_process import GatewayProcess
from turnstream.trainer.reference import ReferenceTrainer, ReferenceTrainerSettings, StepReport

pytestmark = pytest.mark.integration

RUN = "e2e"  # GatewayProcess serves this run
TEMPERATURE = 0.8
MAX_TOKENS = 400
TRIES = 4  # a turn the random model ends before the update lands is tried again, in a new session


def recomputed(model_dir: Path, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The log-probs of ``completion`` after ``prompt`` under ``model_dir``'s weights, fp32."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    scores = logits[len(prompt) - 1 : -1]
    chosen = torch.tensor(completion)[:, None]
    return processed_log_probs(scores, TEMPERATURE).gather(-1, chosen).squeeze(-1)


async def test_a_turn_interrupted_by_the_trainers_update_continues_on_the_new_weights(
    log: Log, tiny_model_dir: Path, tmp_path: Path
) -> None:
    # Version v serves weights[v % 2]: each try's update really changes the weights.
    weights = [tiny_model_dir, ensure_tiny_model(tmp_path / "other", seed=1)]
    gateway = await asyncio.to_thread(
        GatewayProcess, log.server.url, tiny_model_dir, tmp_path / "gateway"
    )
    trainer = ReferenceTrainer(
        ReferenceTrainerSettings(
            model_dir=tiny_model_dir, checkpoint_dir=tmp_path, run=RUN, update_mode="abort"
        )
    )
    kv = await Bucket.open(log.js, "ts_policy")
    try:
        for attempt in range(TRIES):
            opened = gateway.session()
            client = openai.AsyncOpenAI(
                base_url=str(opened["base_url"]), api_key="unused", max_retries=0
            )
            stream = await client.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": f"Tell a long story ({attempt})."}],
                max_tokens=MAX_TOKENS,
                temperature=TEMPERATURE,
                stream=True,
            )
            text, finishes, published = "", [], False
            async for chunk in stream:
                if not chunk.choices:
                    continue
                text += chunk.choices[0].delta.content or ""
                if chunk.choices[0].finish_reason:
                    finishes.append(chunk.choices[0].finish_reason)
                if not published and len(text) >= 8:  # generating: the trainer publishes
                    checkpoint = weights[(attempt + 1) % 2]
                    report = StepReport(attempt + 1, attempt + 1, 0, 0, 0, 0, None, 0, checkpoint)
                    await trainer.publish(kv, report)
                    published = True
            events = [
                e
                for e in await read_session(log.js, RUN, str(opened["session_id"]))
                if isinstance(e, TurnCompleted)
            ]
            assert len(events) == 1, "recorded once"
            (event,) = events
            assert finishes == [event.finish_reason] and text == event.text, "one whole answer"
            if event.version_spans is not None:
                break
            # The random model ended the turn before the update reached its backend: again,
            # from the version it now serves.
        else:
            pytest.fail(f"no turn of {MAX_TOKENS} tokens outlasted the update in {TRIES} tries")
    finally:
        gateway.stop()

    before = attempt  # the version the turn started on
    ((v0, k), (v1, rest)) = event.version_spans
    assert (v0, v1) == (before, before + 1) and k > 0 and rest > 0
    assert event.sampling["continued"][0]["at"] == k and event.weight_version == before
    assert event.timings["interrupted_ms"] > 0
    ids = event.completion_ids.tolist()
    prompt = event.prompt_ids.tolist()  # turn 0 of its session: no parent, the whole prompt
    recorded = torch.from_numpy(event.logprobs.copy())
    old_dir, new_dir = weights[before % 2], weights[(before + 1) % 2]
    first = recomputed(old_dir, prompt, ids[:k])
    second = recomputed(new_dir, prompt + ids[:k], ids[k:])
    assert (first - recorded[:k]).abs().max().item() <= 1e-4
    assert (second - recorded[k:]).abs().max().item() <= 1e-4
    # The other weights would not have given them: the check can tell the versions apart.
    assert (recomputed(old_dir, prompt + ids[:k], ids[k:]) - recorded[k:]).abs().max() > 1e-3

"""verl's agent loop fed through the log (verl 0.9.1): samples run by ``TurnstreamAgentLoop.run``
against a real turnstream stack in this process (nats-server, gateway on the tiny model, fold
worker, shard writer), agents on the real openai SDK.

Each loop object is made as verl's ``AgentLoopWorker`` makes it: its entry read from an
agent-loop yaml into verl's registry, then ``hydra.utils.instantiate`` with the worker's
arguments. The outputs then go through verl's own post-processing (``_agent_loop_postprocess``
and ``_postprocess``, the ``AgentLoopWorker`` methods that turn agent-loop outputs into the
rollout batch) and verl's GRPO advantage and vanilla policy loss.

Stand-ins, for what cannot run here: an ``AgentLoopWorker`` proper needs Ray and a full trainer
config, so its two methods run on one made with ``__new__`` and given the attributes they read
(``worker_for_postprocess``); verl's vLLM server (no GPU vLLM here) is the tiny model behind an
adapter that reports no weight version, as the gateway's vllm backend does
(``VerlServerStandIn``), and verl's checkpoint manager (Ray workers) an object that records the
syncs it is asked for.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import hydra
import numpy as np
import openai
import pytest
import torch
from hydra.errors import InstantiationException
from omegaconf import OmegaConf
from transformers import AutoModelForCausalLM
from verl import DataProto
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopOutput,
    AgentLoopWorker,
    DictConfigWrap,
    ToolListWrap,
    _agent_loop_registry,
)
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema
from verl.trainer.ppo import core_algos
from verl.utils import hf_tokenizer
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.workers.config import ActorConfig, PolicyLossConfig

from consumers import ShardWriterSettings
from gateway.backends.interface import GenerationChunk, Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from tests.helpers.services import shard_table_rows
from tests.helpers.waiting import eventually
from turnstream.integrations.errors import AgentFailed
from turnstream.integrations.samples import EXTRA_FIELDS
from turnstream.integrations.verl import AgentTask, TurnstreamAgentLoop, publish_weight_syncs
from turnstream.services.gateway import assembly
from turnstream.stack.up import Stack, UpSettings, embedded_stack
from turnstream.trainer.objective import response_log_probs

pytestmark = pytest.mark.integration

RUN = "verl"
PROMPT_LENGTH, RESPONSE_LENGTH = 160, 96
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0}


# -- agents, named in the agent-loop yaml as tests.verl.test_agent_loop:<name> -------------------


async def chat(task: AgentTask, messages: list[Any], seed: int) -> str:
    async with openai.AsyncOpenAI(base_url=task.base_url, api_key=task.api_key, max_retries=0) as c:
        reply = await c.chat.completions.create(
            model=task.model, messages=messages, max_tokens=6, seed=seed, **task.openai_sampling()
        )
    return reply.choices[0].message.content or ""


async def two_turns(task: AgentTask) -> float:
    """Two turns of chat; the reward is the share of lowercase letters it wrote."""
    seed = int(task.extra_info["seed"])
    messages = list(task.messages)
    first = await chat(task, messages, seed)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
    second = await chat(task, messages, seed + 1)
    text = first + second
    return sum(c.islower() for c in text) / max(len(text), 1)


async def forgetful(task: AgentTask) -> float:
    """The second turn drops the first exchange and starts over: a second segment. It shares
    no token the model generated with the first turn, so it is a new conversation, not a fork."""
    seed = int(task.extra_info["seed"])
    await chat(task, list(task.messages), seed)
    await chat(task, [{"role": "user", "content": "Start over: say hi."}], seed + 1)
    return 0.5


async def crashes_after_a_turn(task: AgentTask) -> float:
    await chat(task, list(task.messages), int(task.extra_info["seed"]))
    raise RuntimeError("the sandbox died")


async def crashes_at_once(task: AgentTask) -> float:
    raise RuntimeError("no sandbox to be had")


def not_async(task: AgentTask) -> float:
    return 0.0


# -- the stack and verl's side ---------------------------------------------------------------------


class VerlServerStandIn:
    """Stands in for a vLLM server that verl's trainer updates in place (no vLLM runs here): the
    tiny local model generates, but like the gateway's vllm backend it reports no weight
    version, so the gateway follows the versions put in ``ts_policy`` (``PolicyVersion``)."""

    def __init__(self, local: LocalBackend) -> None:
        self._local = local

    @property
    def id(self) -> str:
        return "verl-vllm-0"

    @property
    def max_context(self) -> int:
        return self._local.max_context

    async def generate(
        self, prompt: Prompt, params: SamplingParams, *, session: str | None = None
    ) -> AsyncIterator[GenerationChunk]:
        async for chunk in self._local.generate(prompt, params, session=session):
            yield dataclasses.replace(chunk, weight_version=None)

    async def admit(self, params: SamplingParams) -> str | None:
        return await self._local.admit(params)

    async def close(self) -> None:
        await self._local.close()


@contextlib.asynccontextmanager
async def running_stack(data_dir: Path, model_dir: Path) -> AsyncIterator[Stack]:
    settings = UpSettings(
        data_dir=data_dir,
        run=RUN,
        model=model_dir,
        model_name="tiny",
        port=0,
        shards=ShardWriterSettings(max_age_s=0.2),
    )
    async with embedded_stack(settings) as stack:
        try:
            yield stack
        finally:
            await TurnstreamAgentLoop.shared.aclose()


@pytest.fixture
async def stack(tmp_path: Path, tiny_model_dir: Path) -> AsyncIterator[Stack]:
    async with running_stack(tmp_path, tiny_model_dir) as stack:
        yield stack


@pytest.fixture
def tokenizer(tiny_model_dir: Path) -> Any:
    return hf_tokenizer(str(tiny_model_dir))


@contextlib.contextmanager
def agent_loop_yaml(
    tmp_path: Path, stack: Stack | None, fields: dict[str, Any] | None = None, **agents: str
) -> Iterator[None]:
    """The agent-loop yaml a verl user writes, one entry per agent (``fields`` added to each),
    loaded into verl's registry as ``AgentLoopWorker.__init__`` loads it. No stack: URLs where
    nothing answers, for loops that contact nothing."""
    entries = [
        {
            "name": name,
            "_target_": "turnstream.integrations.verl.TurnstreamAgentLoop",
            "gateway_url": stack.url if stack else "http://127.0.0.1:9",
            "log_url": stack.event_log.url if stack else "nats://127.0.0.1:9",
            "run": RUN,
            "agent": f"tests.verl.test_agent_loop:{agent}",
            "trajectory_timeout_s": 30,
            **({"on_agent_error": "raise"} if name.endswith("-raise") else {}),
            **(fields or {}),
        }
        for name, agent in agents.items()
    ]
    path = tmp_path / "agent_loops.yaml"
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(entries)))
    for entry in OmegaConf.load(path):
        _agent_loop_registry[entry.name] = entry
    try:
        yield
    finally:
        for name in agents:
            _agent_loop_registry.pop(name, None)


def tool(name: str) -> BaseTool:
    schema = {"type": "function", "function": {"name": name, "description": f"the {name} tool"}}
    return BaseTool({}, OpenAIFunctionToolSchema.model_validate(schema))


def trainer_config() -> Any:
    return OmegaConf.create(
        {
            "actor_rollout_ref": {
                "rollout": {"prompt_length": PROMPT_LENGTH, "response_length": RESPONSE_LENGTH}
            },
            "data": {},
        }
    )


def new_loop(name: str, tokenizer: Any, tools: Sequence[BaseTool] = ()) -> TurnstreamAgentLoop:
    """A loop object for one sample, made as ``AgentLoopWorker._run_agent_loop`` makes it."""
    config = trainer_config()
    loop = hydra.utils.instantiate(
        config=_agent_loop_registry[name],
        trainer_config=DictConfigWrap(config=config),
        server_manager=None,
        tokenizer=tokenizer,
        processor=None,
        hf_model_type=None,
        dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(config.data),
        tools=ToolListWrap(list(tools)),
    )
    assert isinstance(loop, TurnstreamAgentLoop)
    return loop


def verl_samples(prompts: Sequence[str], n: int, seed: int = 0) -> list[dict[str, Any]]:
    """Dataset fields as verl hands them to ``run``: one ``uid`` per prompt, its n rollouts."""
    samples = []
    for i, text in enumerate(prompts):
        uid = str(uuid.uuid4())
        messages = np.empty(1, dtype=object)  # verl's non-tensor batch holds numpy objects
        messages[0] = {"role": "user", "content": text}
        for r in range(n):
            samples.append(
                {
                    "raw_prompt": messages,
                    "uid": uid,
                    "index": np.int64(i),
                    "extra_info": {"index": i, "seed": np.int64(seed + 10 * i + r)},
                    "tools_kwargs": {},
                    "data_source": "test",
                }
            )
    return samples


async def run_samples(
    name: str, tokenizer: Any, samples: list[dict[str, Any]]
) -> list[AgentLoopOutput]:
    """A batch of samples at once, each on its own loop object, as verl's worker runs them."""
    return list(
        await asyncio.gather(
            *(new_loop(name, tokenizer).run(dict(SAMPLING, logprobs=True), **s) for s in samples)
        )
    )


async def shard_rows(stack: Stack, ids: set[str]) -> dict[str, dict[str, Any]]:
    """The shard rows of ``ids``, once the shard writer committed them all."""
    root = Path(stack.shard_target)
    found: dict[str, dict[str, Any]] = {}

    def read() -> bool:
        found.update({str(r["trajectory_id"]): r for r in shard_table_rows(root)})
        return ids <= found.keys()

    await eventually(read, 30, f"{len(ids)} trajectories in the shards")
    return found


def assert_is_the_shard_row(output: AgentLoopOutput, row: dict[str, Any]) -> None:
    p = row["prompt_len"]
    assert output.prompt_ids == row["input_ids"][:p]
    assert output.response_ids == row["input_ids"][p:]
    assert output.response_mask == row["loss_mask"][p:]
    assert output.response_logprobs == pytest.approx(row["logprobs"][p:], abs=0)
    assert output.num_turns == row["num_turns"]
    assert output.extra_fields["min_global_steps"] == row["min_weight_version"]
    assert output.extra_fields["max_global_steps"] == row["max_weight_version"]


def worker_for_postprocess(tokenizer: Any) -> AgentLoopWorker:
    """An AgentLoopWorker with what ``_agent_loop_postprocess`` and ``_postprocess`` read (a
    real one needs Ray and a whole trainer config)."""
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.rollout_config = SimpleNamespace(
        prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH
    )
    worker.tokenizer = tokenizer
    worker.processor = None
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.mm_processor_kwargs = {}
    return worker


async def verl_batch(
    tokenizer: Any, outputs: list[AgentLoopOutput], samples: list[dict[str, Any]]
) -> DataProto:
    worker = worker_for_postprocess(tokenizer)
    padded = [
        await worker._agent_loop_postprocess(output, False, **sample)
        for output, sample in zip(outputs, samples, strict=True)
    ]
    batch_fields = {
        key: np.array([s[key] for s in samples], dtype=object) for key in ("uid", "index")
    }
    batch: DataProto = worker._postprocess(padded, input_non_tensor_batch=batch_fields)
    return batch


# -- the tests ---------------------------------------------------------------------------------


def test_a_samples_fields_become_its_agents_task(tmp_path: Path, tokenizer: Any) -> None:
    """What ``run`` hands on from verl: dataset fields (numpy values made plain), the schemas of
    verl's configured tools narrowed by ``tool_selection``, metadata for the session."""
    with agent_loop_yaml(tmp_path, None, turnstream="two_turns"):
        loop = new_loop("turnstream", tokenizer, tools=[tool("search"), tool("calc")])
    [sample] = verl_samples(["Hi."], n=1)
    sample["extra_info"]["tool_selection"] = np.array(["calc"], dtype=object)
    spec = loop._spec(dict(SAMPLING), sample)
    assert spec.messages == [{"role": "user", "content": "Hi."}]
    assert spec.group == sample["uid"]
    assert [t["function"]["name"] for t in spec.tools] == ["calc"]
    assert type(spec.extra_info["seed"]) is int and spec.extra_info["tool_selection"] == ["calc"]
    assert spec.metadata == {"verl": {"uid": sample["uid"], "index": 0, "data_source": "test"}}
    assert spec.sampling_params == SAMPLING
    assert spec.max_response_tokens == RESPONSE_LENGTH

    with (
        agent_loop_yaml(tmp_path, None, {"gateway_ur": "http://x"}, misspelt="two_turns"),
        pytest.raises(InstantiationException, match=r"(?s)IntegrationError.*gateway_ur"),
    ):
        new_loop("misspelt", tokenizer)
    with (
        agent_loop_yaml(tmp_path, None, sync_agent="not_async"),
        pytest.raises(InstantiationException, match="must be an async function"),
    ):
        new_loop("sync_agent", tokenizer)


async def test_samples_are_the_logged_trajectories_and_train_with_verls_grpo(
    stack: Stack, tokenizer: Any, tmp_path: Path, tiny_model_dir: Path
) -> None:
    samples = verl_samples(["Write a word.", "Name a colour."], n=2)
    with agent_loop_yaml(tmp_path, stack, turnstream="two_turns"):
        outputs = await run_samples("turnstream", tokenizer, samples)
    assert TurnstreamAgentLoop.shared.feeds() == 1  # four samples, one subscription

    rows = await shard_rows(stack, {o.extra_fields["turnstream_trajectory_id"] for o in outputs})
    for output, sample in zip(outputs, samples, strict=True):
        row = rows[output.extra_fields["turnstream_trajectory_id"]]
        assert_is_the_shard_row(output, row)
        assert row["group"] == sample["uid"]  # the GRPO group is verl's uid
        verl_fields = {"uid": sample["uid"], "index": sample["index"], "data_source": "test"}
        assert json.loads(row["metadata"])["verl"] == verl_fields
        assert output.num_turns == 2 and output.extra_fields["turnstream_forks"] == 0
        assert output.reward_score == row["reward"] is not None
        assert tuple(output.extra_fields) == EXTRA_FIELDS
        assert output.extra_fields["turnstream_error"] is None
        assert output.extra_fields["turnstream_status"] == "completed"
    assert len({o.extra_fields["turnstream_session_id"] for o in outputs}) == 4

    # verl's own post-processing makes its rollout batch of them ...
    batch = await verl_batch(tokenizer, outputs, samples)
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    assert responses.shape == mask.shape == (4, RESPONSE_LENGTH)
    assert batch.batch["prompts"].shape == (4, PROMPT_LENGTH)
    for i, output in enumerate(outputs):
        n = len(output.response_ids)
        assert responses[i, :n].tolist() == output.response_ids
        assert batch.batch["rm_scores"][i].sum().item() == pytest.approx(output.reward_score)
    assert batch.non_tensor_batch["__num_turns__"].tolist() == [o.num_turns for o in outputs]
    assert list(batch.non_tensor_batch["turnstream_trajectory_id"]) == [
        o.extra_fields["turnstream_trajectory_id"] for o in outputs
    ]

    # ... on which the tiny model, recomputing the log-probs as verl's actor does, agrees with
    # the rollout log-probs the gateway recorded, and GRPO and the vanilla loss run.
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        log_prob = response_log_probs(model, batch.batch, SAMPLING["temperature"])
    rollout = batch.batch["rollout_log_probs"]
    generated = mask.bool()
    assert torch.allclose(log_prob[generated], rollout[generated], atol=1e-4)
    advantages, _ = core_algos.compute_grpo_outcome_advantage(
        token_level_rewards=batch.batch["rm_scores"],
        response_mask=mask,
        index=batch.non_tensor_batch["uid"],
    )
    loss, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=rollout,
        log_prob=log_prob,
        advantages=advantages,
        response_mask=mask,
        loss_agg_mode="token-mean",
        config=ActorConfig(
            strategy="fsdp",
            rollout_n=2,
            ppo_micro_batch_size_per_gpu=1,
            clip_ratio=0.2,
            policy_loss=PolicyLossConfig(loss_mode="vanilla"),
        ),
    )
    assert torch.isfinite(advantages).all() and torch.isfinite(loss)
    for uid in set(batch.non_tensor_batch["uid"]):  # GRPO: zero mean within each uid
        members = batch.non_tensor_batch["uid"] == uid
        assert advantages[members, 0].sum().item() == pytest.approx(0.0, abs=1e-4)


async def test_a_session_of_two_segments_gives_verl_its_final_segment(
    stack: Stack, tokenizer: Any, tmp_path: Path
) -> None:
    samples = verl_samples(["Tell me a story."], n=1, seed=7)
    with agent_loop_yaml(tmp_path, stack, forking="forgetful"):
        [output] = await run_samples("forking", tokenizer, samples)
    session = output.extra_fields["turnstream_session_id"]
    final, first = f"{RUN}/{session}/1", f"{RUN}/{session}/0"
    rows = await shard_rows(stack, {first, final})
    assert output.extra_fields["turnstream_trajectory_id"] == final
    assert output.extra_fields["turnstream_forks"] == 0  # started over: no generated token kept
    assert output.extra_fields["turnstream_dropped_segments"] == [first]
    assert_is_the_shard_row(output, rows[final])
    assert output.reward_score == rows[final]["reward"] == 0.5
    assert output.prompt_ids[-20:] == rows[final]["input_ids"][: rows[final]["prompt_len"]][-20:]


async def test_a_failed_agent_gives_a_sample_that_trains_nothing_or_raises_as_configured(
    stack: Stack, tokenizer: Any, tmp_path: Path
) -> None:
    samples = verl_samples(["Fetch the file.", "Open the door."], n=1, seed=3)
    agents = {"after": "crashes_after_a_turn", "at-once": "crashes_at_once"}
    with agent_loop_yaml(tmp_path, stack, **agents, **{"at-once-raise": "crashes_at_once"}):
        after, at_once = await asyncio.gather(
            new_loop("after", tokenizer).run(dict(SAMPLING), **samples[0]),
            new_loop("at-once", tokenizer).run(dict(SAMPLING), **samples[1]),
        )
        with pytest.raises(AgentFailed, match="no sandbox to be had"):
            await new_loop("at-once-raise", tokenizer).run(dict(SAMPLING), **samples[1])

    # A turn was made: the sample is what the log holds of the aborted session, masked.
    trajectory_id = after.extra_fields["turnstream_trajectory_id"]
    rows = await shard_rows(stack, {trajectory_id})
    row = rows[trajectory_id]
    assert row["status"] == "aborted" and row["reward"] is None
    p = row["prompt_len"]
    assert after.prompt_ids + after.response_ids == row["input_ids"]
    assert row["loss_mask"][p:].count(1) > 0 and set(after.response_mask) == {0}
    assert after.reward_score == 0.0
    assert "the sandbox died" in after.extra_fields["turnstream_error"]
    assert after.extra_fields["turnstream_status"] == "aborted"

    # No turn at all: the prompt as verl renders it, one masked padding token, no trajectory.
    assert at_once.extra_fields["turnstream_trajectory_id"] is None
    assert "no sandbox to be had" in at_once.extra_fields["turnstream_error"]
    assert at_once.response_ids == [tokenizer.pad_token_id] and at_once.response_mask == [0]
    assert tokenizer.decode(at_once.prompt_ids).endswith(
        "Open the door.<|im_end|>\n<|im_start|>assistant\n"
    )

    # verl's post-processing takes both, with the same keys as successful samples.
    batch = await verl_batch(tokenizer, [after, at_once], samples)
    assert batch.batch["response_mask"].sum().item() == 0
    assert batch.batch["rm_scores"].abs().sum().item() == 0.0


async def test_the_weight_version_verl_publishes_after_a_sync_reaches_the_next_turns(
    tmp_path: Path, tiny_model_dir: Path, tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The gateway in front of "verl's vLLM server": it follows versions, it loads no weights.
    monkeypatch.setattr(
        assembly,
        "build_backend",
        lambda settings, model_dir, name: VerlServerStandIn(LocalBackend.load(model_dir)),
    )
    async with running_stack(tmp_path, tiny_model_dir) as stack:
        with agent_loop_yaml(tmp_path, stack, turnstream="two_turns"):
            [before] = await run_samples("turnstream", tokenizer, verl_samples(["Hi."], n=1))

            # verl's trainer syncs weights into its servers, then the version is published.
            class CheckpointManager:  # verl's needs Ray workers; this one records the syncs
                def __init__(self) -> None:
                    self.synced: list[int] = []

                def update_weights(self, global_steps: int | None = None) -> None:
                    self.synced.append(global_steps or 0)

            manager = CheckpointManager()
            publish_weight_syncs(manager, stack.event_log.url, RUN)
            await asyncio.to_thread(manager.update_weights, 5)  # verl's loop is synchronous
            assert manager.synced == [5]

            async with httpx.AsyncClient(base_url=stack.url) as http:

                async def served() -> int:
                    return int((await http.get("/health")).json()["weight_version"])

                for _ in range(500):
                    if await served() == 5:
                        break
                    await asyncio.sleep(0.02)
                assert await served() == 5
            [after] = await run_samples("turnstream", tokenizer, verl_samples(["Hi."], n=1))

        ids = {o.extra_fields["turnstream_trajectory_id"] for o in (before, after)}
        rows = await shard_rows(stack, ids)
    assert before.extra_fields["min_global_steps"] == before.extra_fields["max_global_steps"] == 0
    assert after.extra_fields["min_global_steps"] == after.extra_fields["max_global_steps"] == 5
    row = rows[after.extra_fields["turnstream_trajectory_id"]]
    generated = [v for v, m in zip(row["versions"], row["loss_mask"], strict=True) if m]
    assert generated and set(generated) == {5}

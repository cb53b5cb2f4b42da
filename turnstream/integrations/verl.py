"""verl's agent loop fed through turnstream's log (the only module that imports verl).

``TurnstreamAgentLoop`` (registered as ``"turnstream"``) runs each verl sample as a gateway
session: it opens the session (group = the sample's ``uid``, which verl shares among the ``n``
rollouts of one prompt), runs the user's agent against the session's ``base_url``, closes the
session with the reward the agent returns, and answers verl with an ``AgentLoopOutput`` built from
the **folded trajectory read back from the log**: the tokens, loss mask and log-probs the gateway
recorded, token for token what the shards hold. The rules (the final segment of a forked
session, failed agents, verl's length limits, the extra fields) are ``samples``' module
docstring; docs/verl.md is the walkthrough.

Configured from an agent-loop yaml (verl's
``actor_rollout_ref.rollout.agent.agent_loop_config_path``)::

    - name: turnstream
      _target_: turnstream.integrations.verl.TurnstreamAgentLoop
      gateway_url: http://127.0.0.1:8000
      log_url: nats://127.0.0.1:4222
      run: grpo-1
      agent: my_agents.search:solve    # async def solve(task: AgentTask) -> float

Every key but ``name`` and ``_target_`` is a ``TurnstreamLoopSettings`` field; a misspelt one is
an error, not ignored.

The agent: ``async def solve(task: AgentTask) -> float``, given the session's ``base_url``,
``api_key`` and ``model`` (for any OpenAI client), the sample's ``messages`` (verl's
``raw_prompt``), ``tools`` (the OpenAI schemas of verl's configured tools, narrowed by
``extra_info["tool_selection"]`` as verl's tool agent does), ``tools_kwargs``, ``extra_info`` and
verl's ``sampling_params`` (``task.openai_sampling()`` gives those an OpenAI request takes).

``num_turns`` is turnstream's count of model calls in the returned segment; verl's own loops
count chat messages (user, assistant and tool). The reward is the agent's: verl computes none for
these samples when it is set (a failed agent's ``failure_reward`` included).

After each weight sync the trainer tells the gateway which version its servers now hold:
``publish_weight_version(log_url, run, global_steps)``, or ``publish_weight_syncs`` to do it on
every ``update_weights`` of verl's checkpoint manager.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import numpy as np
from pydantic import Field, ValidationError
from verl.experimental.agent_loop.agent_loop import (
    AgentLoopBase,
    AgentLoopMetrics,
    AgentLoopOutput,
    OmegaConf,  # verl's own import of it: omegaconf comes with verl
    register,
)

from eventlog import LogSettings
from turnstream.integrations.errors import IntegrationError
from turnstream.integrations.policy import publish_weight_version, publish_weight_version_async
from turnstream.integrations.rollouts import (
    Agent,
    AgentTask,
    EpisodeSpec,
    RolloutSettings,
    SharedRollouts,
    load_agent,
)
from turnstream.integrations.samples import failed_sample, rollout_sample

__all__ = [
    "AgentTask",
    "TurnstreamAgentLoop",
    "TurnstreamLoopSettings",
    "publish_weight_syncs",
    "publish_weight_version",
    "publish_weight_version_async",
]

log = logging.getLogger(__name__)


class TurnstreamLoopSettings(RolloutSettings):
    """The agent-loop yaml's keys for ``TurnstreamAgentLoop``."""

    agent: str = Field(
        description="the agent: 'package.module:function', async, an AgentTask to a reward"
    )
    on_agent_error: Literal["mask", "raise"] = Field(
        "mask",
        description="mask: a failed agent's sample trains nothing (response mask 0, "
        "failure_reward); raise: its error fails verl's generation step",
    )
    failure_reward: float = Field(0.0, description="the reward of a failed agent's sample")


@functools.cache
def _agent(path: str) -> Agent:
    return load_agent(path)


@register("turnstream")
class TurnstreamAgentLoop(AgentLoopBase):  # type: ignore[misc]  # verl is untyped
    """Each sample is an episode on a turnstream gateway; its output is the logged trajectory."""

    # verl makes one loop object per sample: what samples share lives with the class.
    shared: ClassVar[SharedRollouts] = SharedRollouts()

    def __init__(
        self,
        trainer_config: Any,
        server_manager: Any,
        tokenizer: Any,
        processor: Any,
        dataset_cls: Any,
        data_config: Any,
        hf_model_type: str | None = None,
        tools: Any = None,
        name: str | None = None,  # the yaml entry's name; hydra passes it along
        **settings: Any,
    ) -> None:
        super().__init__(
            trainer_config,
            server_manager,
            tokenizer,
            processor,
            dataset_cls,
            data_config,
            hf_model_type=hf_model_type,
        )
        try:
            self.settings = TurnstreamLoopSettings.model_validate(_plain(settings))
        except ValidationError as exc:
            raise IntegrationError(
                f"agent loop {name or 'turnstream'}: its settings in the agent-loop yaml "
                f"(actor_rollout_ref.rollout.agent.agent_loop_config_path) do not fit "
                f"TurnstreamLoopSettings (gateway_url, log_url, run, agent required; see "
                f"docs/verl.md): {exc}"
            ) from exc
        try:
            self.agent = _agent(self.settings.agent)
        except ValueError as exc:
            raise IntegrationError(f"agent loop {name or 'turnstream'}: {exc}") from exc
        self.tools = {tool.name: tool for tool in (tools.tools if tools is not None else [])}
        self.prompt_length = int(self.rollout_config.prompt_length)
        self.response_length = int(self.rollout_config.response_length)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        rollouts = await self.shared.get(self.settings)
        spec = self._spec(sampling_params, kwargs)
        episode = await rollouts.episode(self.agent, spec)
        if episode.error is not None:
            if self.settings.on_agent_error == "raise":
                raise episode.error
            log.warning("%s; its sample trains nothing", episode.error)
        sample = rollout_sample(
            episode,
            prompt_length=self.prompt_length,
            response_length=self.response_length,
            failure_reward=self.settings.failure_reward,
        )
        if sample is None:  # no turn at all: the prompt as verl renders it, nothing to train
            prompt_ids = await self.ct_build_initial_tokens(spec.messages, tools=spec.tools or None)
            sample = failed_sample(
                episode,
                prompt_ids,
                pad_token_id=self._pad_token_id(),
                prompt_length=self.prompt_length,
                failure_reward=self.settings.failure_reward,
            )
        return AgentLoopOutput(
            prompt_ids=sample.prompt_ids,
            response_ids=sample.response_ids,
            response_mask=sample.response_mask,
            response_logprobs=sample.response_logprobs,
            reward_score=sample.reward,
            num_turns=sample.num_turns,
            metrics=AgentLoopMetrics(generate_sequences=episode.agent_s),
            extra_fields=dict(sample.extra_fields),
        )

    def _spec(self, sampling_params: dict[str, Any], kwargs: dict[str, Any]) -> EpisodeSpec:
        """The episode verl asks for: its dataset fields arrive as ``run``'s kwargs."""
        if "raw_prompt" not in kwargs:
            raise IntegrationError(
                "verl passed no raw_prompt (the sample's chat messages): set "
                "data.return_raw_chat=True, or make your dataset class return it"
            )
        extra_info = _plain(kwargs.get("extra_info") or {})
        uid = kwargs.get("uid")
        selection = extra_info.get("tool_selection") if isinstance(extra_info, dict) else None
        tools = [
            tool.tool_schema.model_dump(exclude_unset=True, exclude_none=True)
            for name, tool in self.tools.items()
            if not selection or name in selection
        ]
        verl_fields = {
            key: _plain(kwargs[key]) for key in ("uid", "index", "data_source") if key in kwargs
        }
        return EpisodeSpec(
            messages=list(_plain(list(kwargs["raw_prompt"]))),
            group=str(uid) if uid is not None else None,
            tools=tools,
            tools_kwargs=_plain(kwargs.get("tools_kwargs") or {}),
            extra_info=extra_info if isinstance(extra_info, dict) else {},
            sampling_params=_plain(dict(sampling_params)),
            max_response_tokens=self.response_length,
            metadata={"verl": verl_fields},
        )

    def _pad_token_id(self) -> int:
        for token in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id):
            if isinstance(token, int):
                return token
        return 0


def publish_weight_syncs(
    checkpoint_manager: Any,
    log_url: str,
    run: str,
    *,
    log_settings: LogSettings | None = None,
) -> None:
    """Make every ``checkpoint_manager.update_weights(global_steps)`` (verl's
    ``trainer.checkpoint_manager`` once ``trainer.init_workers()`` made it) also publish
    ``global_steps`` as the weight version gateways record, once the sync has returned."""
    sync: Callable[..., Any] = checkpoint_manager.update_weights

    @functools.wraps(sync)
    def update_weights(global_steps: int | None = None, *args: Any, **kwargs: Any) -> Any:
        result = sync(global_steps, *args, **kwargs)
        if global_steps is None:
            log.warning("a weight sync without global_steps: no weight version published")
            return result
        if inspect.isawaitable(result):  # the caller awaits verl's auto_await coroutine

            async def then() -> Any:
                value = await result
                await publish_weight_version_async(
                    log_url, run, int(global_steps), log_settings=log_settings
                )
                return value

            return then()
        publish_weight_version(log_url, run, int(global_steps), log_settings=log_settings)
        return result

    checkpoint_manager.update_weights = update_weights


def _plain(value: Any) -> Any:
    """``value`` as plain JSON-able Python: verl hands numpy scalars and arrays (its
    non-tensor batch), hydra hands OmegaConf containers."""
    if OmegaConf.is_config(value):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return [_plain(v) for v in value.tolist()]
    if isinstance(value, np.generic):
        return value.item()
    return value

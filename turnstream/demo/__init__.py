"""``turnstream demo``: the main job on the embedded default, end to end, learning.

- ``command``: ``DemoCommand``, the embedded stack, the agents and the reference trainer run
  together (``run_demo``);
- ``agents``: the agents, honest ``openai`` SDK clients, and their reward;
- ``model``: the built-in tiny model shown how a tool call ends (imported on use, by
  ``command``: it loads the model classes; not re-exported here);
- ``report``: what the demo made, counted where it lives, and shown.
"""

from __future__ import annotations

from turnstream.demo.agents import (
    CHANCE,
    KEEPALIVE_EXPIRY_S,
    LOOKUP_PROMPTS,
    NO_CALL,
    TOOLS,
    TURN_TIMEOUT_S,
    WORD_TOOL,
    WORD_TOOL_NAME,
    WORDS,
    WRITE_PROMPTS,
    AgentPlan,
    Answer,
    DemoAgentError,
    Episode,
    lowercase_reward,
    run_agents,
)
from turnstream.demo.command import DemoCommand, DemoError, DemoSettings, run_demo
from turnstream.demo.report import (
    DemoSummary,
    ShardCounts,
    StreamCounts,
    count_shards,
    count_streams,
    steps_table,
    summary_table,
    write_reward_png,
)

__all__ = [
    "CHANCE",
    "KEEPALIVE_EXPIRY_S",
    "LOOKUP_PROMPTS",
    "NO_CALL",
    "TOOLS",
    "TURN_TIMEOUT_S",
    "WORDS",
    "WORD_TOOL",
    "WORD_TOOL_NAME",
    "WRITE_PROMPTS",
    "AgentPlan",
    "Answer",
    "DemoAgentError",
    "DemoCommand",
    "DemoError",
    "DemoSettings",
    "DemoSummary",
    "Episode",
    "ShardCounts",
    "StreamCounts",
    "count_shards",
    "count_streams",
    "lowercase_reward",
    "run_agents",
    "run_demo",
    "steps_table",
    "summary_table",
    "write_reward_png",
]

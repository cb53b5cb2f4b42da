"""What the benchmark scripts share; it imports nothing from them (they import it).

* ``reporting``: the progress lines, machine facts and the closing JSON line of every benchmark.
* ``options``: the gateway benchmarks' flags (``gateway_overhead.py``'s and its modes').
* ``cpu``: CPU meters from /proc.
* ``processes``: launching and stopping the backend, the gateway (through
  ``gateway_launcher.py``) and nats-server; health waits, /metrics, EVENTS counts.
* ``stack``: nats-server + fixed-latency backend + gateway as one context manager.
* ``load``, ``surfaces``: the load generators (the direct and gateway paths; Claude-Code-shaped
  sessions on each API surface); ``load_processes``: the load spread over processes;
  ``claude_code_tree``: a Claude Code session with two background sub-agents, request by request;
  ``routed_sessions``: agent sessions whose every request goes to the gateway a routing picks.
* ``continuation``: the turn an answer was recorded as; conversations continued token-exact.
* ``phases``: phases and alternating rounds, percentiles and summaries.
* ``gateway_profile``: the gateway's cProfile output by component.
* ``fixed_latency_backend.py`` and ``gateway_launcher.py`` are scripts run as processes.
"""

from __future__ import annotations

from harness.continuation import check_continued, session_turns, turn_of
from harness.cpu import CpuMeter, cpu_seconds, own_cpu_seconds, thread_cpu_ns, tree_cpu_seconds
from harness.gateway_profile import print_profile, profile_breakdown
from harness.load import (
    REPLY,
    Conversation,
    Direct,
    Gateway,
    LoadPath,
    PhaseCounts,
    build_conversation,
    conversation_messages,
)
from harness.load_processes import LoadProcesses, LoadSpec, http_clients, load_paths
from harness.options import gateway_arguments, plan_of, run_gateway_mode
from harness.phases import Phase, Plan, pct, run_phase, summarize
from harness.processes import (
    REPO,
    RUN,
    STREAM,
    FixedLatencyBackend,
    Procs,
    VllmCpuBackend,
    backend_command,
    count_subjects,
    deploy_vllm_server,
    gateway_command,
    gateway_env,
    parse_metrics,
    spawn,
    stop_process,
    stream_messages,
    wait_http,
)
from harness.reporting import arguments, banner, finish, gateway_machine_info, machine_info, say
from harness.stack import BenchStack, fixed_latency_stack, reply_ids
from harness.surfaces import (
    MAX_TOKENS,
    REPLY_TEXT,
    SURFACES,
    ChatSurface,
    ClaudeCodeShape,
    MessagesSurface,
    Reply,
    ResponsesSurface,
    Surface,
    claude_code_shape,
    dumps,
    tool_output,
)

__all__ = [
    "MAX_TOKENS",
    "REPLY",
    "REPLY_TEXT",
    "REPO",
    "RUN",
    "STREAM",
    "SURFACES",
    "BenchStack",
    "ChatSurface",
    "ClaudeCodeShape",
    "Conversation",
    "CpuMeter",
    "Direct",
    "FixedLatencyBackend",
    "Gateway",
    "LoadPath",
    "LoadProcesses",
    "LoadSpec",
    "MessagesSurface",
    "Phase",
    "PhaseCounts",
    "Plan",
    "Procs",
    "Reply",
    "ResponsesSurface",
    "Surface",
    "VllmCpuBackend",
    "arguments",
    "backend_command",
    "banner",
    "build_conversation",
    "check_continued",
    "claude_code_shape",
    "conversation_messages",
    "count_subjects",
    "cpu_seconds",
    "deploy_vllm_server",
    "dumps",
    "finish",
    "fixed_latency_stack",
    "gateway_arguments",
    "gateway_command",
    "gateway_env",
    "gateway_machine_info",
    "http_clients",
    "load_paths",
    "machine_info",
    "own_cpu_seconds",
    "parse_metrics",
    "pct",
    "plan_of",
    "print_profile",
    "profile_breakdown",
    "reply_ids",
    "run_gateway_mode",
    "run_phase",
    "say",
    "session_turns",
    "spawn",
    "stop_process",
    "stream_messages",
    "summarize",
    "thread_cpu_ns",
    "tool_output",
    "tree_cpu_seconds",
    "turn_of",
    "wait_http",
]

"""Prometheus metrics of one gateway (its own registry, so several apps can live in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["GatewayMetrics", "Labelled"]

# Fine below 50 ms: issue 40's targets are a p99 <= 10 ms and a longest stall <= 50 ms.
_LAG_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5)
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class Labelled:
    """The children of a counter with one label, each made once: prometheus' ``labels()`` takes
    a lock and builds a key on every call, twice per turn on the turn path. For labels of few
    values (an API's kind, how a turn attached); a child is never removed from these metrics."""

    def __init__(self, metric: Counter) -> None:
        self.metric = metric
        self._children: dict[str, Counter] = {}

    def __call__(self, value: str) -> Counter:
        child = self._children.get(value)
        if child is None:
            child = self._children[value] = self.metric.labels(value)
        return child


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.request_latency = Histogram(
            "turnstream_gateway_request_seconds",
            "HTTP request latency",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens_in = Counter(
            "turnstream_gateway_prompt_tokens",
            "prompt tokens sent to the backend",
            registry=self.registry,
        )
        self.tokens_out = Counter(
            "turnstream_gateway_completion_tokens",
            "tokens sampled by the backend",
            registry=self.registry,
        )
        self.publish_latency = Histogram(
            "turnstream_gateway_publish_seconds",
            "time until JetStream acked a turn",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.outbox_depth = Gauge(
            "turnstream_gateway_outbox_bytes", "bytes waiting in the outbox", registry=self.registry
        )
        self.errors = Counter(
            "turnstream_gateway_errors",
            "error responses by status code",
            ["code"],
            registry=self.registry,
        )
        self.turns = Counter(
            "turnstream_gateway_turns",
            "turns completed and published, by the API that carried them",
            ["kind"],
            registry=self.registry,
        )
        self.attached = Counter(
            "turnstream_gateway_turn_attachments",
            "turns by how they joined their session's tree: continued (a conversation's tip, "
            "token for token), branched (off a kept turn: a retry, an edited history), new",
            ["how"],
            registry=self.registry,
        )
        self.kept_bodies = Counter(
            "turnstream_gateway_kept_bodies",
            "request bodies of 64 KiB or more by how they were decoded: reused (only what follows "
            "the items they resend of their client session's previous body), full",
            ["decoded"],
            registry=self.registry,
        )
        self.kept_body_bytes = Gauge(
            "turnstream_gateway_kept_body_bytes",
            "bytes the kept request bodies and their decoded items hold (--kept-body-bytes)",
            multiprocess_mode="livesum",  # --workers: their total
            registry=self.registry,
        )
        # The log decides (DESIGN §4): how often this gateway's copy of a session was stale.
        self.appends_refused = Counter(
            "turnstream_gateway_appends_refused",
            "appends the log refused because another writer had stored events on the session "
            "since this gateway's last known sequence (each followed by a catch-up read)",
            ["event"],
            registry=self.registry,
        )
        self.catch_up_reads = Counter(
            "turnstream_gateway_catch_up_reads",
            "reads of a session's events after this gateway's last known sequence: after a "
            "refused append, before a turn its copy may be stale for, or after it was idle",
            ["reason"],
            registry=self.registry,
        )
        self.caught_up_events = Counter(
            "turnstream_gateway_caught_up_events",
            "events the catch-up reads applied (stored by another writer)",
            registry=self.registry,
        )
        self.prompt_forks = Counter(
            "turnstream_gateway_prompt_forks",
            "turns whose backend expanded the prompt's images otherwise than the gateway (vLLM "
            "with another image processor config): recorded with the backend's ids, marked "
            "sampling.prompt_fork (should stay 0)",
            registry=self.registry,
        )
        self.stale_prompts = Counter(
            "turnstream_gateway_stale_prompts",
            "turns recorded whose prompt was built from a stale copy: they continue a turn "
            "another writer stored, but not token for token (should stay 0)",
            registry=self.registry,
        )
        self.interruptions = Counter(
            "turnstream_gateway_interrupted_generations",
            "generations a backend aborted mid-turn (a weight update), by what became of the "
            "turn: continued (resubmitted with its tokens so far), gave_up (not taken again "
            "within --continue-wait-s: a 503), version_limit (--max-versions-per-turn reached)",
            ["outcome"],
            registry=self.registry,
        )
        self.interrupted_wait = Histogram(
            "turnstream_gateway_interrupted_wait_seconds",
            "from a backend's abort of a generation to the first token of its continuation",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=self.registry,
        )
        self.loop_lag = Histogram(
            "turnstream_gateway_event_loop_lag_seconds",
            "how much later than due the event loop woke a 10 ms sleep (gateway.loop_lag): "
            "what any request's next step waited then",
            buckets=_LAG_BUCKETS,
            registry=self.registry,
        )
        self.loop_lag_max = Gauge(
            "turnstream_gateway_event_loop_lag_max_seconds",
            "the event loop's longest lateness over the last 60 s",
            multiprocess_mode="livemax",  # --workers: the worst of them
            registry=self.registry,
        )
        self.resent = Counter(
            "turnstream_gateway_resent_requests",
            "requests equal to a kept turn's (a conversation's tip), answered with the recorded "
            "turn",
            ["kind"],
            registry=self.registry,
        )
        # The turn path's labelled counters, their children made once (``Labelled``).
        self.turns_of = Labelled(self.turns)
        self.attached_as = Labelled(self.attached)

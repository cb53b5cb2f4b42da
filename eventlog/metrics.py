"""Prometheus metrics of the log's consumers (fold worker, reaper, shard writer, live feed).

One ``ConsumerMetrics`` per process holds the metric families on its own registry (served on
``--metrics-port`` by the service); each pull loop gets a ``LoopMetrics`` bound to its consumer
name. ``LoopMetrics.disabled()`` records nothing (libraries and tests that do not serve metrics).

    turnstream_consumer_messages_total{consumer}           messages handled
    turnstream_consumer_dead_letters_total{consumer,reason}
    turnstream_consumer_handle_seconds{consumer}           time to handle one fetch's messages
                                                           (a fold: one session each)
    turnstream_consumer_pending{consumer}                  messages in the stream not yet
                                                           delivered to the consumer (lag)
    turnstream_shard_commits_total, turnstream_shard_rows_total
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

__all__ = ["ConsumerMetrics", "LoopMetrics"]

_SECONDS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ConsumerMetrics:
    """The metric families of one process."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.messages = Counter(
            "turnstream_consumer_messages", "messages handled", ["consumer"], registry=r
        )
        self.dead_letters = Counter(
            "turnstream_consumer_dead_letters",
            "messages dead-lettered, by reason",
            ["consumer", "reason"],
            registry=r,
        )
        self.handle_seconds = Histogram(
            "turnstream_consumer_handle_seconds",
            "seconds to handle one dispatch (a fold: one session)",
            ["consumer"],
            buckets=_SECONDS,
            registry=r,
        )
        self.pending = Gauge(
            "turnstream_consumer_pending",
            "messages stored but not yet delivered to the consumer (lag)",
            ["consumer"],
            registry=r,
        )
        self.shard_commits = Counter(
            "turnstream_shard_commits", "Parquet shards committed", registry=r
        )
        self.shard_rows = Counter(
            "turnstream_shard_rows", "trajectories written to shards", registry=r
        )

    def serve(self, port: int, host: str = "0.0.0.0") -> None:
        """Serve ``/metrics`` on ``port`` (a daemon thread)."""
        start_http_server(port, addr=host, registry=self.registry)

    def loop(self, consumer: str) -> LoopMetrics:
        return LoopMetrics(self, consumer)


class LoopMetrics:
    """One pull loop's view of ``ConsumerMetrics`` (labels bound once)."""

    def __init__(self, families: ConsumerMetrics | None, consumer: str) -> None:
        self.families = families
        if families is None:
            return
        self._messages = families.messages.labels(consumer)
        self._seconds = families.handle_seconds.labels(consumer)
        self._pending = families.pending.labels(consumer)
        self._dead = families.dead_letters
        self._consumer = consumer

    @classmethod
    def disabled(cls) -> LoopMetrics:
        return cls(None, "")

    def fetched(self, pending: int) -> None:
        """A fetch came back; ``pending``: what the stream still holds for the consumer."""
        if self.families is not None:
            self._pending.set(pending)

    def handled(self, count: int, seconds: float) -> None:
        if self.families is not None:
            self._messages.inc(count)
            self._seconds.observe(seconds)

    def dead_lettered(self, reason: str) -> None:
        if self.families is not None:
            self._dead.labels(self._consumer, reason).inc()

    def shard_committed(self, rows: int) -> None:
        if self.families is not None:
            self.families.shard_commits.inc()
            self.families.shard_rows.inc(rows)

"""The gateways' own counts of what sharing one log cost them (issue 36), summed over a soak.

A gateway's counters live in its process, and a SIGKILL loses them: the controller reads a
gateway's ``/metrics`` just before it kills it, and the soak reads every gateway's once the
pipeline is quiet. The sums are a lower bound (what a gateway counted between that read and
the kill, or before it exited on its own, is not in them). The audit's counts, from the log,
are the verdict; these say what the gateways did to reach it (refused appends, catch-up reads).
"""

from __future__ import annotations

from collections import Counter

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["COUNTERS", "parse_counters", "read_counters"]

PREFIX = "turnstream_gateway_"
COUNTERS = frozenset(
    {
        "turnstream_gateway_appends_refused_total",  # {event}: appends the log refused
        "turnstream_gateway_catch_up_reads_total",  # {reason}: reads of a session's new events
        "turnstream_gateway_caught_up_events_total",  # another writer's events those applied
        "turnstream_gateway_stale_prompts_total",  # prompts built from a stale copy: must be 0
        # {outcome}: generations a weight update aborted mid-turn (issue 37): continued,
        # gave_up (a 503), version_limit
        "turnstream_gateway_interrupted_generations_total",
        "turnstream_gateway_errors_total",  # {status}: error answers (503: log down or full)
    }
)


async def read_counters(client: httpx.AsyncClient, url: str) -> Counter[str]:
    """``parse_counters`` of ``url``'s ``/metrics``; empty when the gateway does not answer."""
    try:
        response = await client.get(f"{url}/metrics", timeout=2.0)
    except httpx.HTTPError:
        return Counter()
    return parse_counters(response.text) if response.status_code == 200 else Counter()


def parse_counters(text: str) -> Counter[str]:
    """The samples of ``COUNTERS`` in a Prometheus page, by name and labels.

    >>> page = 'turnstream_gateway_appends_refused_total{event="turn"} 3.0'
    >>> dict(parse_counters(page))
    {'appends_refused_total{event=turn}': 3}
    """
    counts: Counter[str] = Counter()
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in COUNTERS:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                name = sample.name.removeprefix(PREFIX) + (f"{{{labels}}}" if labels else "")
                counts[name] += int(sample.value)
    return counts

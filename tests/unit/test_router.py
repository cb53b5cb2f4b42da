"""ReplicaRouter: stickiness, least-loaded fallback, failover, cool-down, backpressure.

The replicas are small in-memory Backends standing in for GPU servers: what is tested is the
routing, which only sees ids, in-flight counts and the errors they raise.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Sequence

import pytest

from gateway.backends.interface import Backend, GenerationChunk, Prompt, SamplingParams
from gateway.backends.router import ReplicaRouter, ReplicaStatus
from gateway.errors import BackendError, BackendUnavailable

PARAMS = SamplingParams(max_tokens=2)


class FakeReplica:
    """Streams two chunks; ``fail`` raises before the first, ``fail_midway`` after it."""

    def __init__(self, id: str, max_context: int = 4096) -> None:
        self._id = id
        self._max_context = max_context
        self.fail: BaseException | None = None
        self.fail_midway: BaseException | None = None
        self.prompts: list[list[int]] = []
        self.closed = False
        self.aborted = 0  # generations closed before their last chunk

    @property
    def id(self) -> str:
        return self._id

    @property
    def max_context(self) -> int:
        return self._max_context

    async def generate(
        self, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[GenerationChunk]:
        self.prompts.append(prompt.tolist())
        if self.fail is not None:
            raise self.fail
        finished = False
        try:
            yield GenerationChunk([1], [-0.1])
            if self.fail_midway is not None:
                raise self.fail_midway
            finished = True
            yield GenerationChunk([2], [-0.2], finish_reason="stop")
        finally:
            if not finished:
                self.aborted += 1

    async def admit(self, params: SamplingParams) -> str | None:
        return None

    async def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def unavailable(replica: str) -> BackendUnavailable:
    return BackendUnavailable(f"cannot connect to vLLM at http://{replica}:8000/v1/completions")


@pytest.fixture
def replicas() -> list[FakeReplica]:
    return [FakeReplica("gpu-a"), FakeReplica("gpu-b"), FakeReplica("gpu-c")]


@pytest.fixture
def clock() -> Clock:
    return Clock()


def make_router(replicas: list[FakeReplica], clock: Clock, max_inflight: int = 2) -> ReplicaRouter:
    return ReplicaRouter(
        replicas, max_inflight_per_replica=max_inflight, cooldown_s=10.0, clock=clock
    )


async def turn(router: ReplicaRouter, session: str | None, prompt: Sequence[int] = (7,)) -> str:
    """One whole generation; returns the replica that served it."""
    replica, stream = await router.generate_for(session, Prompt(prompt), PARAMS)
    assert [chunk.token_ids async for chunk in stream] == [[1], [2]]
    return replica


def inflight(router: ReplicaRouter) -> dict[str, int]:
    return {status.id: status.inflight for status in router.status()}


async def test_a_session_keeps_its_replica_and_new_sessions_spread(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas, clock)
    first = {session: await turn(router, session) for session in ["s1", "s2", "s3"]}
    assert sorted(first.values()) == ["gpu-a", "gpu-b", "gpu-c"]
    for _ in range(3):
        for session, replica in first.items():
            assert await turn(router, session) == replica
    assert router.replica_of("s1") == first["s1"]
    assert inflight(router) == {"gpu-a": 0, "gpu-b": 0, "gpu-c": 0}


async def test_stickiness_wins_over_load_below_the_limit(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas, clock, max_inflight=2)
    home = await turn(router, "s1")
    # home now has 1 in flight, others 0
    _, held = await router.generate_for("s1", Prompt([7]), PARAMS)
    assert await turn(router, "s1") == home
    await held.aclose()


async def test_a_saturated_replica_sends_the_session_to_the_least_loaded(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock, max_inflight=1)
    assert await turn(router, "s1") == "gpu-a"
    busy, held = await router.generate_for("s1", Prompt([7]), PARAMS)
    assert busy == "gpu-a"
    assert inflight(router) == {"gpu-a": 1, "gpu-b": 0}
    assert await turn(router, "s1") == "gpu-b"
    # gpu-b served the latest turn, so it now holds the longest cached prefix: the session moves.
    assert router.replica_of("s1") == "gpu-b"
    await held.aclose()
    assert await turn(router, "s1") == "gpu-b"


async def test_when_all_are_saturated_a_request_waits_for_a_slot(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:1], clock, max_inflight=1)
    _, held = await router.generate_for("s1", Prompt([7]), PARAMS)
    waiting = asyncio.create_task(turn(router, "s2"))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    assert [chunk.token_ids async for chunk in held] == [[1], [2]]  # the last chunk frees the slot
    assert await asyncio.wait_for(waiting, 1.0) == "gpu-a"


async def test_an_unreachable_replica_is_skipped_and_marked_down(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock)
    assert await turn(router, "s1") == "gpu-a"
    replicas[0].fail = unavailable("gpu-a")
    assert await turn(router, "s1", [7, 8]) == "gpu-b"  # the same request, retried elsewhere
    assert replicas[1].prompts[-1] == [7, 8]
    assert router.status()[0] == ReplicaStatus(
        "gpu-a", 0, False, 10.0, "cannot connect to vLLM at http://gpu-a:8000/v1/completions"
    )
    # While it cools down nobody is sent there, new sessions included.
    calls = len(replicas[0].prompts)
    assert {await turn(router, f"new-{n}") for n in range(4)} == {"gpu-b"}
    assert len(replicas[0].prompts) == calls


async def test_a_replica_is_retried_after_its_cool_down(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock)
    replicas[0].fail = unavailable("gpu-a")
    assert await turn(router, "s1") == "gpu-b"
    clock.now += 9.9
    assert await turn(router, None) == "gpu-b"
    replicas[0].fail = None  # the server came back
    clock.now += 0.2
    assert {await turn(router, f"new-{n}") for n in range(2)} == {"gpu-a", "gpu-b"}
    assert router.status()[0].up


async def test_a_replica_still_down_after_its_cool_down_is_marked_down_again(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock)
    replicas[0].fail = unavailable("gpu-a")
    await turn(router, None)
    clock.now += 11
    for n in range(2):
        assert await turn(router, f"s{n}") == "gpu-b"
    assert router.status()[0].down_for_s == 10.0  # counted from the second failure


async def test_all_down_is_backend_unavailable_naming_each_replica(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock)
    for replica in replicas[:2]:
        replica.fail = unavailable(replica.id)
    with pytest.raises(BackendUnavailable, match=r"session s1.*gpu-a: down.*gpu-b: down") as caught:
        await router.generate_for("s1", Prompt([7]), PARAMS)
    assert isinstance(caught.value.__cause__, BackendUnavailable)
    # Still down: the next request fails at once, without calling the servers.
    with pytest.raises(BackendUnavailable):
        await router.generate_for("s2", Prompt([7]), PARAMS)
    assert [len(replica.prompts) for replica in replicas[:2]] == [1, 1]
    assert inflight(router) == {"gpu-a": 0, "gpu-b": 0}


async def test_other_backend_errors_are_not_failed_over(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock)
    replicas[0].fail = BackendError("vLLM at http://gpu-a:8000 answered HTTP 400: bad request")
    with pytest.raises(BackendError, match="HTTP 400"):
        await router.generate_for(None, Prompt([7]), PARAMS)
    assert len(replicas[1].prompts) == 0  # a bad request would fail anywhere
    assert all(status.up and status.inflight == 0 for status in router.status())


async def test_a_failure_after_the_first_chunk_reaches_the_caller(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:2], clock)
    replicas[0].fail_midway = unavailable("gpu-a")
    replica, stream = await router.generate_for("s1", Prompt([7]), PARAMS)
    assert replica == "gpu-a"
    with pytest.raises(BackendUnavailable):
        _ = [chunk async for chunk in stream]
    assert len(replicas[1].prompts) == 0  # tokens were already streamed: no silent retry
    assert not router.status()[0].up
    assert inflight(router) == {"gpu-a": 0, "gpu-b": 0}


async def test_slots_are_given_back_on_close_and_on_a_dropped_stream(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = make_router(replicas[:1], clock, max_inflight=3)
    _, closed = await router.generate_for(None, Prompt([7]), PARAMS)
    _, dropped = await router.generate_for(None, Prompt([7]), PARAMS)
    assert inflight(router) == {"gpu-a": 2}
    await closed.aclose()
    assert replicas[0].aborted == 1  # closing reaches the backend (which aborts the request)
    del dropped
    gc.collect()
    assert inflight(router) == {"gpu-a": 0}


async def test_the_router_is_a_backend(replicas: list[FakeReplica], clock: Clock) -> None:
    replicas[1]._max_context = 2048
    router = make_router(replicas, clock)
    assert isinstance(router, Backend)
    assert router.id == "router(gpu-a,gpu-b,gpu-c)"
    assert router.max_context == 2048
    assert [chunk.token_ids async for chunk in router.generate(Prompt([7]), PARAMS)] == [[1], [2]]
    assert inflight(router) == {"gpu-a": 0, "gpu-b": 0, "gpu-c": 0}
    await router.close()
    assert all(replica.closed for replica in replicas)


async def test_least_recently_used_sessions_are_forgotten(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    router = ReplicaRouter(replicas, max_inflight_per_replica=1, max_sessions=2, clock=clock)
    for session in ["s1", "s2", "s1", "s3"]:
        await turn(router, session)
    assert router.replica_of("s2") is None
    assert router.replica_of("s1") is not None


@pytest.mark.parametrize(
    ("backends", "max_inflight", "match"),
    [
        ([], 1, "at least one replica"),
        ([FakeReplica("a"), FakeReplica("a")], 1, "unique"),
        ([FakeReplica("a")], 0, "max_inflight_per_replica"),
    ],
)
def test_configuration_is_checked(
    backends: list[FakeReplica], max_inflight: int, match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        ReplicaRouter(backends, max_inflight_per_replica=max_inflight)


async def test_the_backend_port_routes_by_the_session_hint_and_names_the_replica(
    replicas: list[FakeReplica], clock: Clock
) -> None:
    """Serving code calls ``generate(..., session=...)`` like on any backend; the first chunk
    says which replica served it."""
    router = make_router(replicas, clock)
    first = [chunk async for chunk in router.generate(Prompt([7]), PARAMS, session="run/s1")]
    home = first[0].replica
    assert home in {"gpu-a", "gpu-b", "gpu-c"} and first[1].replica is None
    for _ in range(3):
        again = [chunk async for chunk in router.generate(Prompt([7, 8]), PARAMS, session="run/s1")]
        assert again[0].replica == home  # sticky: its cache holds the conversation
    assert inflight(router) == {"gpu-a": 0, "gpu-b": 0, "gpu-c": 0}

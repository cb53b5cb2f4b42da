"""``eventlog.answered``: which failures of an idempotent log request are asked again;
``map_nats_errors``, how a direct request's nats errors become ours; and
``closed_socket_as_reset``, uvloop's error for a closed socket as the reset it is."""

from __future__ import annotations

import asyncio

import nats.errors
import pytest
import uvloop
from nats.js import errors as js_errors

from eventlog import answered, map_nats_errors
from eventlog.connection import ANSWER_TRIES, closed_socket_as_reset
from schemas.errors import EventLogUnavailable


def failing(*errors: Exception) -> tuple[list[int], object]:
    """A request that raises ``errors`` in turn, then answers with the number of calls."""
    calls: list[int] = []

    async def request() -> int:
        calls.append(1)
        if len(calls) <= len(errors):
            raise errors[len(calls) - 1]
        return len(calls)

    return calls, request


@pytest.mark.parametrize(
    "lost",
    [
        TimeoutError(),
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        js_errors.ServiceUnavailableError(),  # 503: JetStream not serving yet
    ],
    ids=["timeout", "nats-timeout", "no-responders", "503"],
)
async def test_a_lost_answer_is_asked_again_until_one_comes(lost: Exception) -> None:
    calls, request = failing(lost, lost)
    assert await answered(request, "test") == 3  # type: ignore[arg-type]
    assert len(calls) == 3


async def test_the_last_tries_loss_is_raised() -> None:
    calls, request = failing(*[TimeoutError()] * ANSWER_TRIES)
    with pytest.raises(TimeoutError):
        await answered(request, "test")  # type: ignore[arg-type]
    assert len(calls) == ANSWER_TRIES


@pytest.mark.parametrize(
    "answer",
    [js_errors.NotFoundError(), js_errors.BadRequestError(), js_errors.APIError()],
    ids=["not-found", "bad-request", "api-error"],
)
async def test_a_refusal_is_an_answer_and_raised_at_once(answer: Exception) -> None:
    calls, request = failing(answer)
    with pytest.raises(type(answer)):
        await answered(request, "test")  # type: ignore[arg-type]
    assert calls == [1]


@pytest.mark.parametrize(
    "error", [TimeoutError(), nats.errors.NoServersError(), js_errors.ServiceUnavailableError()]
)
def test_map_nats_errors_raises_ours_naming_the_request(error: Exception) -> None:
    with (
        pytest.raises(EventLogUnavailable, match=r"^counting x in S: ") as raised,
        map_nats_errors("counting x in S"),
    ):
        raise error
    assert raised.value.__cause__ is error


def test_map_nats_errors_leaves_other_errors_alone() -> None:
    with pytest.raises(KeyError), map_nats_errors("counting x in S"):
        raise KeyError("not the log's")


def test_a_write_on_a_closed_uvloop_socket_is_a_connection_reset() -> None:
    """uvloop raises RuntimeError where asyncio's loop drops the write; nats-py let it through
    a publish while its connection broke, and the gateway answered 500 (issue 38's soak)."""

    async def write_after_the_close() -> None:
        server = await asyncio.start_server(lambda reader, writer: None, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.transport.abort()
        await asyncio.sleep(0.05)  # the handle closes on a later turn of the loop
        with (
            pytest.raises(ConnectionResetError, match="handler is closed"),
            closed_socket_as_reset(),
        ):
            writer.writelines([b"PUB x 1\r\ny\r\n"])
        server.close()

    uvloop.run(write_after_the_close())

"""A streamed turn owns its session's lock, and gives it back even if never started."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from types import SimpleNamespace
from typing import Any

from gateway.serving import ChatStream
from gateway.sessions import Session


class _Service:
    """Stands in for ChatService: only the generator factory ChatStream calls."""

    def _stream_chat(
        self, turn: Any, req: Any, started: Callable[[], None]
    ) -> AsyncIterator[bytes]:
        async def chunks() -> AsyncIterator[bytes]:
            started()
            yield b"data: x\n\n"

        return chunks()


async def locked_session() -> Session:
    session = Session("run", "s")
    await session.lock.acquire()  # as ChatService.chat_stream does before returning the stream
    return session


async def test_a_stream_the_client_never_pulled_releases_the_session() -> None:
    session = await locked_session()
    stream = ChatStream(_Service(), SimpleNamespace(session=session), None)  # type: ignore[arg-type]

    await stream.release_if_unstarted()

    assert not session.lock.locked(), "the next turn of this session would wait forever"


async def test_a_started_stream_leaves_the_lock_to_its_generator() -> None:
    session = await locked_session()
    stream = ChatStream(_Service(), SimpleNamespace(session=session), None)  # type: ignore[arg-type]
    assert await anext(aiter(stream)) == b"data: x\n\n"

    await stream.release_if_unstarted()

    assert session.lock.locked()  # the generator's own finally releases it when it ends

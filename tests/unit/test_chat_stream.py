"""A streamed turn owns its session's lock and a hold on it, and gives both back even if the
client never pulled a chunk."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from gateway.serving import ChatStream
from gateway.sessions import Session, SessionStore
from gateway.turns import SessionState


def chunks(started: Callable[[], None], release: Callable[[], None]) -> AsyncIterator[bytes]:
    """The generator factory ChatServing hands the stream: it releases in its finally."""

    async def generate() -> AsyncIterator[bytes]:
        started()
        try:
            yield b"data: x\n\n"
        finally:
            release()

    return generate()


async def streamed_session() -> tuple[ChatStream, Session]:
    store = SessionStore()
    session = await store.load(("run", "s"), _create)
    assert session is not None
    release_hold = store.hold(session)
    await session.lock.acquire()  # as ChatServing.stream does before returning the stream
    return ChatStream(chunks, session, release_hold), session


async def _create() -> SessionState:
    return SessionState(run="run", id="s")


async def test_a_stream_the_client_never_pulled_releases_the_session() -> None:
    stream, session = await streamed_session()

    await stream.release_if_unstarted()

    assert not session.lock.locked(), "the next turn of this session would wait forever"
    assert session.users == 0, "the session could never be evicted"


async def test_a_started_stream_leaves_the_lock_to_its_generator() -> None:
    stream, session = await streamed_session()
    iterator = aiter(stream)
    assert await anext(iterator) == b"data: x\n\n"

    await stream.release_if_unstarted()
    assert session.lock.locked()  # the generator's own finally releases it when it ends

    await iterator.aclose()  # type: ignore[attr-defined]
    assert not session.lock.locked() and session.users == 0

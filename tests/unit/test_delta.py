"""schemas.delta: the one rule, in its two shapes (DESIGN §3): the chunked decoders the fold uses
and the one-array decoders the gateway uses rebuild the same context and conversation."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from schemas.delta import (
    EMPTY_CONTEXT,
    Context,
    Linked,
    context_ids,
    conversation_items,
    decode_context,
    decode_conversation,
    encode_delta,
)
from schemas.events import TurnCompleted

tokens = st.lists(st.integers(0, 50), max_size=12)
texts = st.lists(st.sampled_from(["a", "b", "c"]), max_size=5)


@given(tokens, texts, tokens, tokens, texts)
def test_the_gateways_and_the_folds_decoders_agree(
    parent_ids: list[int],
    parent_messages: list[str],
    prompt: list[int],
    completion: list[int],
    messages: list[str],
) -> None:
    parent = np.asarray(parent_ids, dtype=np.int32)
    history = [{"role": "user", "content": m} for m in parent_messages]
    asked = [{"role": "user", "content": m} for m in messages]
    delta = encode_delta(parent, history, prompt, asked)
    turn = TurnCompleted(
        run="r",
        session="s",
        turn=1,
        parent_turn=0,
        prefix_len=delta.prefix_len,
        prompt_ids=delta.prompt_ids,
        completion_ids=completion,
        logprobs=[-0.5] * len(completion),
        message_prefix_len=delta.message_prefix_len,
        new_messages=delta.new_messages,
        text="x",
    )
    ids = context_ids(parent, turn)
    assert ids.dtype == np.int32
    assert ids.tolist() == [*prompt, *completion]
    chunked = decode_context(Context.of(parent) if len(parent) else EMPTY_CONTEXT, turn)
    assert chunked.ids().tolist() == ids.tolist() and chunked.length == len(ids)
    flat = conversation_items(history, turn)
    assert list(flat) == decode_conversation(Linked.of(history), turn).all()
    assert list(flat) == [*asked, turn.assistant_message]

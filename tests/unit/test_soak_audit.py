"""The chaos soak's audit on hand-written journals and sessions: it must see every way a commit
fails, every way gateways sharing one log get a session wrong, and every way a turn's token
versions can be wrong (issue 37)."""

from __future__ import annotations

from pathlib import Path

import msgspec
import numpy as np
import pytest
from transformers import AutoModelForCausalLM

from gateway.backends.interface import Prompt, SamplingParams
from gateway.backends.local import LocalBackend
from gateway.core.aggregate import SessionState, TurnDraft, apply, turn_event
from gateway.model import ensure_tiny_model
from schemas.events import SessionClosed, SessionEvent, SessionOpened, TurnCompleted
from schemas.trust import VettedSession
from tests.chaos.agents import AgentSession, Completion
from tests.chaos.audit import Auditor, Report, SinkAudit, SinkJournal, audit_sink
from tests.chaos.gateway_counters import parse_counters
from tests.chaos.logprobs import TOLERANCE, VersionScorer
from tests.chaos.record import SoakRecord
from tests.chaos.seams import retokenized_continuations, served_after_close
from tests.chaos.trainer import Update
from tests.chaos.versions import VersionAudit, turn_of, turn_versions_wrong

TRAJ = {1: "r/a/0", 2: "r/b/0", 3: "r/c/0"}


def audit(tmp_path: Path, journal: str, acked_all: bool = True) -> SinkAudit:
    path = tmp_path / "journal"
    path.write_text(journal)
    return audit_sink(TRAJ, SinkJournal.read(path), acked_all)


CLEAN = """\
started 10
delivered 1 1 r/a/0
delivered 2 1 r/b/0
committing 10-1 1,2
committed 10-1
delivered 3 1 r/c/0
committing 10-2 3
committed 10-2
"""


@pytest.mark.parametrize(
    ("journal", "acked_all", "after", "before", "never", "unconfirmed"),
    [
        pytest.param(CLEAN, True, 0, 0, [], 0, id="clean"),
        pytest.param(
            CLEAN + "started 11\ndelivered 2 2 r/b/0\ncommitting 11-1 2\ncommitted 11-1\n",
            True,
            1,
            0,
            [],
            0,
            id="delivered again after its commit",
        ),
        pytest.param(
            "delivered 1 1 r/a/0\nstarted 11\ndelivered 1 2 r/a/0\ndelivered 2 1 r/b/0\n"
            "delivered 3 1 r/c/0\ncommitting 11-1 1,2,3\ncommitted 11-1\n",
            True,
            0,
            1,
            [],
            0,
            id="killed before the commit: redelivered, then committed",
        ),
        pytest.param(
            CLEAN.replace("committed 10-2\n", ""),
            True,
            0,
            0,
            [],
            1,
            id="killed after the ack was confirmed, before the journal said so",
        ),
        pytest.param(
            CLEAN.replace("committed 10-2\n", ""),
            False,
            0,
            0,
            [3],
            0,
            id="commit never confirmed and the consumer still holds it",
        ),
        pytest.param(
            CLEAN.replace("delivered 3 1 r/c/0\ncommitting 10-2 3\ncommitted 10-2\n", ""),
            True,
            0,
            0,
            [3],
            0,
            id="never delivered",
        ),
        pytest.param(
            CLEAN.replace("committed 10-2\n", "abandoned 10-2\ndelivered 3 2 r/c/0\n")
            + "committing 10-3 3\ncommitted 10-3\n",
            True,
            0,
            1,
            [],
            0,
            id="ack abandoned, redelivered, committed",
        ),
    ],
)
def test_sink_audit(
    tmp_path: Path,
    journal: str,
    acked_all: bool,
    after: int,
    before: int,
    never: list[int],
    unconfirmed: int,
) -> None:
    result = audit(tmp_path, journal, acked_all)
    assert result.redelivered_after_commit == after
    assert result.redelivered_before_commit == before
    assert result.never_committed == never
    assert result.commit_unconfirmed == unconfirmed
    assert result.traj_messages == 3


def test_a_trajectory_id_at_two_traj_sequences_is_counted() -> None:
    result = audit_sink({**TRAJ, 4: "r/a/0"}, SinkJournal(), consumer_acked_all=True)
    assert result.traj_duplicate_ids == 1
    assert result.never_committed == [1, 2, 3, 4]


REDELIVERED = """\
delivered 1 1 r/a/0 100.000
delivered 2 1 r/b/0 100.000
delivered 3 1 r/c/0 100.000
committing 7-1 1,2,3 100.100
committed 7-1 100.200
started 8 101.000
delivered 3 1 r/c/0 103.000
"""


@pytest.mark.parametrize(
    ("nats_kills", "explained"),
    [
        pytest.param([], 0, id="no nats-server crash"),
        pytest.param([100.25], 1, id="nats-server killed right after the commit"),
        pytest.param([102.5], 0, id="nats-server killed long after the commit"),
        pytest.param([99.0], 0, id="nats-server killed before the batch"),
    ],
)
def test_a_redelivery_after_commit_is_told_apart_when_nats_server_died_just_after(
    tmp_path: Path, nats_kills: list[float], explained: int
) -> None:
    path = tmp_path / "journal"
    path.write_text(REDELIVERED)
    result = audit_sink(TRAJ, SinkJournal.read(path), True, nats_kills)
    assert result.redelivered_after_commit == 1
    assert result.redelivered_after_commit_nats_crash == explained


# -- gateways sharing one log: re-tokenized continuations, turns served after close ----------

RUN, SID = "soak", "a00s00000"
OPENED = SessionOpened(run=RUN, session=SID, group="agent-0")


def user(step: int) -> dict[str, object]:
    return {"role": "user", "content": f"step {step}"}


def reply(text: str) -> dict[str, object]:
    return {"role": "assistant", "content": text}


def turn(
    state: SessionState | None,
    index: int,
    prompt: list[int],
    messages: list[dict[str, object]],
    out: list[int],
    text: str,
    parent: int | None,
) -> TurnCompleted:
    """Turn ``index`` as a gateway whose copy of the session is ``state`` would record it:
    delta-encoded against ``parent`` by ``gateway.core.aggregate.turn_event``."""
    assert state is not None
    draft = TurnDraft(
        prompt_ids=prompt,
        messages=messages,
        tools=None,
        completion_ids=out,
        logprobs=[-0.5] * len(out),
        text=text,
        parent_turn=parent,
        reply_id=f"r{index}",
    )
    return msgspec.structs.replace(turn_event(state, draft), turn=index)


# Turn 0: prompt [1, 2] + completion [3] ("a"); turn 1 continues it: [1, 2, 3] + [4], then [5]
# ("b"). The token 9 is "b" rendered from its text by a gateway that did not know turn 1.
STEP0 = [user(0)]
STEP1 = [user(0), reply("a"), user(1)]
STEP2 = [*STEP1, reply("b"), user(2)]


def first_two_turns() -> tuple[SessionState, SessionState, list[SessionEvent]]:
    """(the state after turn 0, the state after turn 1, the events so far)."""
    opened = apply(None, OPENED)
    t0 = turn(opened, 0, [1, 2], STEP0, [3], "a", None)
    after0 = apply(opened, t0)
    t1 = turn(after0, 1, [1, 2, 3, 4], STEP1, [5], "b", 0)
    after1 = apply(after0, t1)
    assert after0 is not None and after1 is not None
    return after0, after1, [OPENED, t0, t1]


def test_a_continuation_from_a_stale_copy_is_counted_re_tokenized() -> None:
    """A second gateway that knows only turn 0 continues it and renders turn 1's reply from
    text: the log holds turn 2 with parent 0, its prompt without turn 1's sampled tokens."""
    stale, _, events = first_two_turns()
    rendered = turn(stale, 2, [1, 2, 3, 9, 6], STEP2, [7], "c", 0)
    found = retokenized_continuations([*events, rendered])
    assert len(found) == 1
    assert "turn 2: continues turn 1" in found[0] and "against turn 0" in found[0]


def test_a_continuation_against_its_parent_but_not_its_whole_context_is_counted() -> None:
    _, fresh, events = first_two_turns()
    rendered = turn(fresh, 2, [1, 2, 3, 4, 9, 6], STEP2, [7], "c", 1)
    assert rendered.parent == 1 and rendered.prefix_len == 4
    assert len(retokenized_continuations([*events, rendered])) == 1


def test_a_token_exact_continuation_is_not_counted() -> None:
    _, fresh, events = first_two_turns()
    exact = turn(fresh, 2, [1, 2, 3, 4, 5, 6], STEP2, [7], "c", 1)
    assert exact.prefix_len == 5
    assert retokenized_continuations([*events, exact]) == []


def test_a_continuation_of_one_of_two_replies_with_one_text_is_not_counted() -> None:
    """A retried turn answered twice with the same text ("b": [5], then [8]); the client's next
    turn continues the first, which the gateway's tie rule (the most recent) would not pick."""
    _, fresh, events = first_two_turns()
    retried = turn(fresh, 2, [1, 2, 3, 4], STEP1, [8], "b", 0)
    both = apply(fresh, retried)
    exact = turn(both, 3, [1, 2, 3, 4, 5, 6], STEP2, [7], "c", 1)
    assert retokenized_continuations([*events, retried, exact]) == []


def test_a_new_conversation_is_no_continuation() -> None:
    _, fresh, events = first_two_turns()
    other = turn(fresh, 2, [8], [user(9)], [7], "c", None)
    assert retokenized_continuations([*events, other]) == []


def test_a_turn_stored_after_the_close_is_counted_where_its_client_got_200() -> None:
    _, fresh, events = first_two_turns()
    close = SessionClosed(run=RUN, session=SID, status="completed", reward=1.0, num_turns=2)
    late = turn(fresh, 2, [1, 2, 3, 4, 5, 6], STEP2, [7], "c", 1)
    stored = [*events, close, late]
    seqs = [1, 2, 4, 6, 9]
    found = served_after_close(stored, seqs, ["r0", "r1", "r2", "r-lost"])
    assert len(found) == 1 and "turn 2 (seq 9)" in found[0] and "close (seq 6" in found[0]
    # Not served (no 200 received): not counted; not stored at all: the audit's `lost`.
    assert served_after_close(stored, seqs, ["r0", "r1", "r-lost"]) == []
    assert served_after_close([*events, late], [1, 2, 4, 9], ["r2"]) == []  # never closed


class DigitTokenizer:
    """Token id i decodes to str(i): the auditor compares token strings."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return str(ids[0])


def received(event: TurnCompleted) -> Completion:
    return Completion(
        reply=event.reply,
        text=event.text,
        tokens=[str(i) for i in event.completion_ids.tolist()],
        logprobs=event.logprobs.tolist(),
    )


def test_the_auditor_reports_both_from_a_session_s_stored_events() -> None:
    """Turn 2 rendered by a stale gateway, turn 3 served after the close: both received 200."""
    stale, fresh, events = first_two_turns()
    rendered = turn(stale, 2, [1, 2, 3, 9, 6], STEP2, [7], "c", 0)
    close = SessionClosed(run=RUN, session=SID, status="completed", reward=1.0, num_turns=3)
    late = turn(fresh, 3, [1, 2, 3, 4, 5, 6], STEP2, [8], "d", 1)
    vetted = VettedSession(events=[*events, rendered, close, late], seqs=[1, 2, 3, 5, 6, 8])
    agent = AgentSession(SID, 0, 4, created=True, outcome="closed")
    turns = [e for e in (*events, rendered, late) if isinstance(e, TurnCompleted)]
    agent.completions = [received(e) for e in turns]
    report = Report()
    Auditor(None, RUN, DigitTokenizer())._check_session(report, SID, vetted, agent, set())  # type: ignore[arg-type]
    assert not report.lost_completions
    assert len(report.retokenized) == 1 and "turn 2" in report.retokenized[0]
    assert len(report.served_after_close) == 1 and "turn 3" in report.served_after_close[0]
    assert len(report.late_turns) == 1  # the older count, by turn index against num_turns


def test_the_gateways_counters_are_read_by_name_and_label_and_nothing_else() -> None:
    page = """\
# HELP turnstream_gateway_appends_refused_total appends the log refused
# TYPE turnstream_gateway_appends_refused_total counter
turnstream_gateway_appends_refused_total{event="turn"} 4.0
turnstream_gateway_appends_refused_total{event="close"} 1.0
# HELP turnstream_gateway_appends_refused_created appends the log refused
# TYPE turnstream_gateway_appends_refused_created gauge
turnstream_gateway_appends_refused_created{event="turn"} 1.7e9
# TYPE turnstream_gateway_stale_prompts_total counter
turnstream_gateway_stale_prompts_total 0.0
# TYPE turnstream_gateway_turns_total counter
turnstream_gateway_turns_total 12.0
"""
    assert parse_counters(page) == {
        "appends_refused_total{event=turn}": 4,
        "appends_refused_total{event=close}": 1,
        "stale_prompts_total": 0,
    }


# -- each token's version (issue 37): tests.chaos.versions ------------------------------------


@pytest.mark.parametrize(
    ("spans", "continued", "wrong"),
    [
        pytest.param([(0, 3), (1, 2)], [3], None, id="continued: the version flips at the abort"),
        pytest.param([(2, 5)], [], None, id="one version"),
        pytest.param([(1, 2), (2, 3)], [], None, id="switched at a token (keep)"),
        pytest.param([(1, 5)], [0], None, id="aborted before its first token"),
        pytest.param([(1, 2), (0, 3)], [], "version 0 after version 1", id="a version goes down"),
        pytest.param([(0, 2), (5, 3)], [], "version(s) [5] never published", id="not published"),
        pytest.param(
            [(1, 2), (2, 3)],
            [1],
            "continued after 1 tokens on version 1, its tokens before on 1",
            id="continued on the version it was aborted on",
        ),
    ],
)
def test_a_turn_s_token_versions(
    spans: list[tuple[int | None, int]], continued: list[int], wrong: str | None
) -> None:
    assert turn_versions_wrong(turn_of(spans, continued), published={0, 1, 2}) == wrong


def test_spans_that_do_not_cover_the_completion_are_wrong() -> None:
    """TurnCompleted refuses them as it is decoded; the audit does not count on it."""
    bad = turn_of([(0, 3), (1, 2)])
    msgspec.structs.force_setattr(bad, "version_spans", [(0, 3), (1, 3)])
    assert "do not cover its 5 tokens" in (turn_versions_wrong(bad, {0, 1}) or "")


def test_weight_version_must_be_the_oldest_token_s() -> None:
    newest = msgspec.structs.replace(turn_of([(0, 3), (1, 2)]), weight_version=1)
    assert turn_versions_wrong(newest, {0, 1}) == "weight_version 1, its oldest token's is 0"


def test_unknown_tokens_are_counted_not_wrong() -> None:
    audit = VersionAudit()
    audit.add(SID, turn_of([(1, 2), (None, 3)]), published={0, 1})
    audit.add(SID, turn_of([(0, 3), (1, 2)], continued=[3, 3], turn=1), published={0, 1})
    assert (audit.turns, audit.continued, audit.continuations) == (2, 1, 2)
    assert (audit.unknown_tokens, audit.multi_version, audit.bad) == (3, 1, [])


@pytest.mark.parametrize(
    ("tokens", "finish", "bad"),
    [(8, "length", False), (5, "stop", False), (5, "length", True), (9, "stop", True)],
)
def test_a_turn_stops_at_its_max_tokens_continued_or_not(
    tokens: int, finish: str, bad: bool
) -> None:
    """A continuation gets what is left of the turn's max_tokens (8 here): the turn ends at it."""
    audit = VersionAudit()
    continued = turn_of([(0, 3), (1, tokens - 3)], continued=[3])
    sampling = {**continued.sampling, "max_tokens": 8}
    audit.add(
        SID, msgspec.structs.replace(continued, sampling=sampling, finish_reason=finish), {0, 1}
    )
    assert bool(audit.max_tokens_bad) == bad and not audit.bad


def test_a_continued_turn_received_whole_is_not_lost_and_its_versions_are_audited() -> None:
    """The client received the continued turn as one answer: the same tokens and log-probs as
    the stored event, and the event's versions flip where it was continued."""
    opened = apply(None, OPENED)
    stored = turn(opened, 0, [1, 2], STEP0, [3, 4, 5, 6], "abcd", None)
    continued = msgspec.structs.replace(
        stored,
        sampling={"continued": [{"at": 2, "seed": None}]},
        weight_version=3,
        version_spans=[(3, 2), (4, 2)],
    )
    vetted = VettedSession(events=[OPENED, continued], seqs=[1, 2])
    agent = AgentSession(SID, 0, 1, created=True, outcome="left_open")
    agent.completions = [received(continued)]
    report = Report()
    auditor = Auditor(None, RUN, DigitTokenizer(), published_versions={0, 3})  # type: ignore[arg-type]
    auditor._check_session(report, SID, vetted, agent, set())
    assert not report.lost_completions
    assert (report.versions.continued, report.versions.multi_version) == (1, 1)
    assert report.versions.bad == [f"{SID} turn 0: version(s) [4] never published"]


def test_the_record_keeps_the_trainer_s_updates(tmp_path: Path) -> None:
    """``--reaudit`` audits versions against what was published, 0 (the served model) too."""
    updates = [Update(1.0, 1, "/b", "abort", 1, 1.1), Update(7.0, 2, "/a", "keep", 3, None)]
    SoakRecord(1, 60.0, 2, [], [], [], updates=updates).save(tmp_path)
    loaded = SoakRecord.load(tmp_path)
    assert loaded.updates == updates and loaded.published_versions == {0, 1, 2}


async def test_each_version_s_tokens_are_scored_against_that_version_s_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A turn continued as the gateway does it: 6 tokens sampled by the local backend on the
    served weights (version 0), then prompt + those 6 ids sent to the other weights (version 1).
    Recorded right, it agrees with a recomputation under each version's weights; the same
    tokens recorded under the wrong versions do not."""
    other = ensure_tiny_model(tmp_path, seed=1)
    prompt = [257, *b"user\nHello there!", 258, 10, 257, *b"assistant\n"]
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=3)
    ids: list[int] = []
    logprobs: list[float] = []
    for weights in (tiny_model_dir, other):
        backend = LocalBackend(AutoModelForCausalLM.from_pretrained(weights), eos_token_ids=())
        async for chunk in backend.generate(Prompt(prompt + ids), params):
            ids += chunk.token_ids
            logprobs += chunk.logprobs
        await backend.close()
    recorded = TurnCompleted(
        run=RUN,
        session=SID,
        turn=0,
        prompt_ids=prompt,
        completion_ids=ids,
        logprobs=logprobs,
        sampling={"temperature": 1.0, "top_p": 1.0, "continued": [{"at": 6, "seed": None}]},
        version_spans=[(0, 6), (1, 6)],
    )
    scorer = VersionScorer({0: tiny_model_dir, 1: other, 2: tiny_model_dir})
    at = np.asarray(prompt)
    right = scorer.max_delta("right", at, recorded)
    assert right is not None and right <= TOLERANCE
    for spans in ([(0, 12)], [(1, 6), (2, 6)], [(0, 5), (1, 7)]):
        wrong = msgspec.structs.replace(recorded, version_spans=spans, weight_version=spans[0][0])
        assert (scorer.max_delta(f"{spans}", at, wrong) or 0.0) > 100 * TOLERANCE
    unknown = msgspec.structs.replace(recorded, version_spans=[(5, 12)], weight_version=5)
    assert scorer.max_delta("unknown", at, unknown) is None  # weights not known: counted bad

"""What a sample's metadata says beyond its session's (PURE; the fold's helpers): where it sits
in the session's tree (``tree_metadata``), the agent whose conversation it is and its flags
(``agent_metadata``), and its turns' sampling where a trainer must know it (``temperatures``,
``sampling``, ``raw_logprobs``). Each says something only where it applies, so a sample of a
plain linear session has the metadata it always had (but for ``sampling``, from fold v7)."""

from __future__ import annotations

from consumers._segments import Chains, RebuiltTurn, is_side
from schemas.events import JSON
from schemas.sampling import TurnSampling

__all__ = ["agent_metadata", "raw_logprobs", "sampling", "temperatures", "tree_metadata"]

_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p")


def temperatures(sample: list[RebuiltTurn]) -> JSON:
    """The sampling temperatures of the sample's turns, where the gateway recorded them: the
    logprobs are those of the tempered distribution, so a trainer must divide by the same."""
    recorded = {
        turn.event.sampling["temperature"]
        for turn in sample
        if "temperature" in turn.event.sampling
    }
    return {"temperatures": sorted(recorded)} if recorded else {}


def sampling(sample: list[RebuiltTurn]) -> JSON:
    """Each turn's sampling settings, in the sample's turn order (one per ``turn_ends`` entry),
    from fold version 7 (issue 38): ``{"temperature", "top_p", "top_k", "min_p"}`` as the
    gateway recorded them, a setting it did not record at its neutral value (temperature and
    top_p 1, top_k and min_p 0; ``schemas.sampling``). A trainer recomputes each token's
    distribution from its turn's (the sink's ``rollout_temperature`` / ``rollout_top_p``).
    Said only where a turn recorded one of them: a turn's record is all that says how it was
    sampled, and a sample of events without any is left to the trainer's setting, as before.
    """
    if not any(key in turn.event.sampling for turn in sample for key in _SAMPLING_KEYS):
        return {}
    return {"sampling": [TurnSampling.of(turn.event.sampling).to_json() for turn in sample]}


def raw_logprobs(sample: list[RebuiltTurn]) -> JSON:
    """``logprobs_kind: "raw"`` when a turn of the sample recorded the model's raw log-probs
    instead of the sampled distribution's (a vLLM replica in its default --logprobs-mode, let
    through by the gateway's --allow-raw-logprobs), else another kind a turn recorded that is
    not "sampled" (``"imported"``: ``turnstream import-atif``'s, an unknown distribution's): a
    trainer must not take importance ratios against them. Said only then, so every other sample
    folds to the same bytes as before."""
    kinds = {turn.event.logprobs_kind for turn in sample} - {"sampled"}
    if not kinds:
        return {}
    return {"logprobs_kind": "raw" if "raw" in kinds else min(kinds)}


# TurnCompleted.agent key -> trajectory metadata key; "kind" is what the client said, read only
# where the gateway recorded no resolved kind (what the tokens said).
_AGENT_METADATA = {
    "id": "agent_id",
    "parent": "parent_agent",
    "resolved_kind": "agent_kind",
    "kind": "agent_kind",
    "type": "agent_type",
    "request_class": "request_class",
    "source": "agent_source",
    "mismatch": "agent_mismatch",
}


def agent_metadata(sample: list[RebuiltTurn]) -> JSON:
    """The agent whose turns the sample holds, as its client named it and the gateway resolved
    it (a chain's turns are one agent's; a field is the first of its turns' that says it), and
    ``side`` / ``client_gone``. Said only where the turns carry them, so a sample of events
    without agents has the metadata it had before."""
    metadata: JSON = {}
    for turn in sample:
        for key, name in _AGENT_METADATA.items():
            value = turn.event.agent.get(key)
            if name not in metadata and isinstance(value, str) and value:
                metadata[name] = value
    if any(is_side(turn.event) for turn in sample):
        metadata["side"] = True
    if sample[-1].event.client_gone:
        metadata["client_gone"] = True
    return metadata


def tree_metadata(chains: Chains, sample: list[RebuiltTurn]) -> JSON:
    """Where a sample sits in the session's tree, said only where it is not a plain line:
    ``branch_of`` when its first turn starts a chain off a parent turn, ``turns`` when its turns
    are not consecutive (interleaved sub-agents)."""
    metadata: JSON = {}
    first = sample[0]
    parent = first.event.parent
    if parent >= 0 and first.event.turn in chains.chain_starts:
        metadata["branch_of"] = {
            "turn": parent,
            "segment": chains.turn_samples[parent],
            "shared_tokens": first.shared,
        }
    indices = [turn.event.turn for turn in sample]
    if indices != list(range(indices[0], indices[0] + len(indices))):
        metadata["turns"] = indices
    return metadata

"""Recorded rollout log-probs against an fp32 transformers recomputation (issue 19).

A turn's recorded log-probs are those of the distribution its tokens were drawn from; this
recomputes that distribution from the weights on the recorded prefix (one forward pass per turn,
float32) and gives both side by side, so a test can bound the difference or show that a raw
record is not the sampled distribution's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from gateway.backends.sampler import processed_log_probs
from schemas import TurnCompleted

__all__ = ["TurnLogprobs", "recompute", "turn_prompts"]


def turn_prompts(turns: Sequence[TurnCompleted]) -> list[list[int]]:
    """Each turn's full prompt, rebuilt from the events of a linear session (its previous
    turn's context cut at ``prefix_len``, then its own ``prompt_ids``)."""
    prompts: list[list[int]] = []
    context: list[int] = []
    for turn in turns:
        prompt = context[: turn.prefix_len] + turn.prompt_ids.tolist()
        prompts.append(prompt)
        context = prompt + turn.completion_ids.tolist()
    return prompts


@dataclass(frozen=True)
class TurnLogprobs:
    recorded: torch.Tensor  # [n] float32, as the event holds them
    processed: torch.Tensor  # [n] recomputed with the turn's temperature and top_p
    raw: torch.Tensor  # [n] recomputed log_softmax of the untempered, untruncated logits

    def max_delta(self, kind: str = "processed") -> float:
        """max |recorded - recomputed| (0.0 for an empty completion)."""
        other = self.processed if kind == "processed" else self.raw
        return float((self.recorded - other).abs().max()) if len(other) else 0.0


def recompute(model: PreTrainedModel, prompt: Sequence[int], turn: TurnCompleted) -> TurnLogprobs:
    """The turn's completion scored by ``model`` in float32 after ``prompt``, under the
    sampling it recorded (``turn.sampling``: temperature, top_p)."""
    completion = turn.completion_ids.tolist()
    ids = torch.tensor([[*prompt, *completion]], dtype=torch.long)
    with torch.no_grad():
        # Position i's logits predict token i + 1: the completion's are the last len(completion)
        # positions before the final token.
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    chosen = torch.tensor(completion, dtype=torch.long).unsqueeze(-1)
    temperature = float(turn.sampling.get("temperature", 1.0))
    top_p = float(turn.sampling.get("top_p", 1.0))
    processed = processed_log_probs(logits, temperature, top_p).gather(-1, chosen).squeeze(-1)
    raw = torch.log_softmax(logits, dim=-1).gather(-1, chosen).squeeze(-1)
    recorded = torch.tensor(turn.logprobs.tolist(), dtype=torch.float32)
    return TurnLogprobs(recorded, processed, raw)

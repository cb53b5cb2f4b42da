"""Each version's tokens against that version's weights (issue 37): the turns the soak's trainer
interrupted, recomputed.

A version recorded for a token is only as good as the weights it names: a continuation sampled
on the old weights but recorded under the new version (or the reverse) passes every check of
``tests.chaos.versions`` and still trains the trainer on the wrong policy. The soak knows each
version's weights (``tests.chaos.trainer.checkpoint_of``), so for every stored turn that was
continued or spans more than one version, one fp32 forward pass per version over the turn's
full prompt and completion gives each token's log-prob under that version's weights
(``processed_log_probs`` with the turn's recorded temperature and top-p, what the local backend
records); a token whose recorded log-prob is more than ``TOLERANCE`` away from the one under its
own version counts the turn in ``version_logprobs_bad``. Tokens of unknown version are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from gateway.backends.sampler import processed_log_probs
from schemas.events import UNKNOWN_VERSION, TurnCompleted

__all__ = ["TOLERANCE", "VersionScorer"]

# The KV-cached decode of the local backend and this full forward agree to ~1e-6 in fp32 on CPU
# (turnstream.trainer.reference); the other weights are a token's worth away.
TOLERANCE = 1e-4


class VersionScorer:
    """Recorded log-probs against each version's weights; ``weights``: version -> checkpoint
    (a ``from_pretrained`` directory)."""

    def __init__(self, weights: Mapping[int, Path]) -> None:
        self.weights = dict(weights)
        self._models: dict[Path, PreTrainedModel] = {}
        self._done: dict[tuple[str, int], float | None] = {}  # audits repeat while waiting

    def max_delta(self, session: str, prompt_ids: np.ndarray, turn: TurnCompleted) -> float | None:
        """The largest |recorded - recomputed| over the turn's tokens of known version; None
        when a version's weights are not known (not one the soak published)."""
        key = (session, turn.turn)
        if key not in self._done:
            self._done[key] = self._max_delta(prompt_ids, turn)
        return self._done[key]

    def _max_delta(self, prompt_ids: np.ndarray, turn: TurnCompleted) -> float | None:
        versions = turn.token_versions()
        ids = np.concatenate([prompt_ids, turn.completion_ids]).astype(np.int64)
        temperature = float(turn.sampling.get("temperature", 1.0))
        top_p = float(turn.sampling.get("top_p", 1.0))
        worst = 0.0
        for version in sorted(set(versions.tolist()) - {UNKNOWN_VERSION}):
            checkpoint = self.weights.get(version)
            if checkpoint is None:
                return None
            mine = versions == version
            recomputed = self._log_probs(checkpoint, ids, len(prompt_ids), temperature, top_p)
            delta = np.abs(recomputed[mine] - turn.logprobs[mine])
            worst = max(worst, float(delta.max()))
        return worst

    def _log_probs(
        self, checkpoint: Path, ids: np.ndarray, prompt_len: int, temperature: float, top_p: float
    ) -> np.ndarray:
        """Each completion token's log-prob under ``checkpoint``'s weights."""
        model = self._model(checkpoint)
        with torch.inference_mode():
            logits = model(input_ids=torch.from_numpy(ids)[None], use_cache=False).logits[0]
            # The logits at position P-1+j predict completion token j.
            rows = logits[prompt_len - 1 : -1].float()
            log_probs = processed_log_probs(rows, temperature, top_p)
            picked = log_probs.gather(-1, torch.from_numpy(ids[prompt_len:])[:, None])
        return picked[:, 0].numpy().astype(np.float32)

    def _model(self, checkpoint: Path) -> PreTrainedModel:
        if checkpoint not in self._models:
            model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
            model.train(False)
            self._models[checkpoint] = model
        return self._models[checkpoint]

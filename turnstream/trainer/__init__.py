"""The reference GRPO / PPO trainer: a library, small on purpose and meant to be read
(``turnstream train``, ``turnstream.services.train``, runs it as a service; the demo in-process).

- ``reference``: ``ReferenceTrainer``, one step per batch of the sink, each new policy published;
- ``objective``: the math, pure (log-probs, advantages, the clipped objective, batch checks);
- ``checkpoints``: a policy version as a ``from_pretrained`` directory.
"""

from __future__ import annotations

from turnstream.trainer.checkpoints import save_checkpoint
from turnstream.trainer.objective import (
    batch_advantages,
    check_sampled_logprobs,
    check_temperature,
    clipped_objective,
    group_advantages,
    max_logprob_delta,
    response_log_probs,
)
from turnstream.trainer.reference import (
    PolicyStore,
    ReferenceTrainer,
    ReferenceTrainerSettings,
    StepReport,
)

__all__ = [
    "PolicyStore",
    "ReferenceTrainer",
    "ReferenceTrainerSettings",
    "StepReport",
    "batch_advantages",
    "check_sampled_logprobs",
    "check_temperature",
    "clipped_objective",
    "group_advantages",
    "max_logprob_delta",
    "response_log_probs",
    "save_checkpoint",
]

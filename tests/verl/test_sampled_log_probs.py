"""Top-p on verl's side (issue 38): docs/verl.md's block, as written, with verl's own
``logprobs_from_logits``, recomputes the rollout log-probs of samples drawn at top_p < 1.

Sessions sampled by the local backend on the real tiny model (turns at top_p 0.9 and 0.7, a
greedy turn, one at 1 and 1), folded, assembled by the sink and turned into verl's DataProto by
``to_dataproto``; the policy's response logits from one forward pass, as verl's actor takes them.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM
from verl.utils.torch_functional import logprobs_from_logits

from tests.helpers.sampled_sessions import sampled_sessions
from trainer_sink import assemble, to_dataproto
from turnstream.trainer.objective import response_logits

DOC = Path(__file__).resolve().parents[2] / "docs" / "verl.md"
MARK = "<!-- tests/verl/test_sampled_log_probs.py runs this block -->"


def doc_block() -> dict[str, Any]:
    """docs/verl.md's marked block, run in a namespace of its own."""
    [block] = re.findall(re.escape(MARK) + r"\n```python\n(.*?)```", DOC.read_text(), re.S)
    namespace: dict[str, Any] = {}
    exec(compile(block, str(DOC), "exec"), namespace)  # the doc's own code
    return namespace


async def test_the_docs_recipe_recomputes_log_probs_sampled_at_top_p(
    tiny_model_dir: Path,
) -> None:
    trajectories = await sampled_sessions(
        tiny_model_dir, [[(0.8, 0.9)], [(0.8, 0.9), (1.3, 0.7)], [(0.0, 0.5)], [(1.0, 1.0)]]
    )
    data = to_dataproto(assemble(trajectories))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.train(False)
    with torch.no_grad():
        logits = response_logits(model, data.batch)
    rollout = data.batch["rollout_log_probs"]
    generated = data.batch["response_mask"].bool()

    log_probs = doc_block()["sampled_log_probs"](logits, data)

    assert float((log_probs - rollout)[generated].abs().max()) <= 1e-4
    # verl's actor without the nucleus (its per-sample temperature only) is off by log(mass)
    tempered = logits / data.batch["rollout_temperature"].unsqueeze(-1)
    plain = logprobs_from_logits(tempered, data.batch["responses"])
    assert float((plain - rollout)[generated].abs().max()) > 1e-2
    # a row folded before fold v7 (no per-token sampling: NaN) is computed at the given setting
    data.batch["rollout_temperature"][3] = float("nan")
    data.batch["rollout_top_p"][3] = float("nan")
    again = doc_block()["sampled_log_probs"](logits, data, temperature=1.0)
    assert torch.equal(again[3], log_probs[3])

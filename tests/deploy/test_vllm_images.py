"""The real vLLM (its CPU build) on the tiny vision-language model: one image turn through the
gateway's turn core to vLLM's ``/inference/v1/generate`` (``gateway.backends.vllm_generate``),
the prompt vLLM read compared with the gateway's own expansion, token for token.

Today this test SKIPS, and says why: vLLM 0.32's CPU build here cannot serve Qwen2-VL. Its
model module imports transformers' Qwen2-VL image processor, which imports torchvision, and the
deploy venv has none (tests/deploy/vllm_server.py uninstalls the PyPI wheel, built for CUDA:
``operator torchvision::nms does not exist``; the PyTorch CPU index is not reachable here).
vLLM inspects the model's architecture in a subprocess at start, and logs (then exits)::

    Error in inspecting model architecture 'Qwen2VLForConditionalGeneration'
    File ".../vllm/model_executor/models/qwen2_vl.py", line 43, in <module>
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
    File ".../transformers/models/qwen2_vl/image_processing_qwen2_vl.py", line 26, in <module>
        from torchvision.transforms.v2 import functional as tvF
    ModuleNotFoundError: No module named 'torchvision'

It skips on that error only: any other failure to start fails, as every deploy test does (the
rule of tests/deploy is "never skip"; this is the one exception, the issue's item 4: show the
error, test the wire shape with a stand-in, tests/unit/test_vllm_images.py). The day the venv
has a CPU torchvision, it runs for real. No Docker: ``pytest tests/deploy/test_vllm_images.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from gateway.backends.vllm import VLLMBackend
from gateway.images import VisionSpec
from gateway.model.tiny_vl import ensure_tiny_vl_model
from gateway.templates import ChatTemplate, load_tokenizer
from tests.deploy.cache import cache_dir
from tests.deploy.vllm_server import (
    SERVED_NAME,
    VLLM_VERSION,
    VLLMServer,
    VLLMUnavailable,
    vllm_python,
)
from tests.helpers.image_turns import ImageTurns, full_prompts, png, user

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

TORCHVISION_MISSING = "ModuleNotFoundError: No module named 'torchvision'"
MAX_CONTEXT = 2048


def test_vllm_serves_an_image_turn_token_exact(tmp_path: Path) -> None:
    model_dir = ensure_tiny_vl_model(cache_dir("models"))
    server = VLLMServer(vllm_python(), model_dir, tmp_path / "logs", name="vllm-vl").start()
    try:
        try:
            server.wait_ready(within=900)
        except VLLMUnavailable:
            log = server.log_path.read_text(errors="replace")
            if TORCHVISION_MISSING not in log:
                raise
            pytest.skip(
                f"vLLM {VLLM_VERSION}'s CPU build cannot serve Qwen2-VL here: "
                f"{TORCHVISION_MISSING} (vllm/model_executor/models/qwen2_vl.py:43 imports "
                "transformers' image_processing_qwen2_vl, which imports torchvision; the "
                f"deploy venv has none). Log: {server.log_path}"
            )
        asyncio.run(_one_image_turn(server.url, model_dir))
    finally:
        server.stop()


async def _one_image_turn(url: str, model_dir: Path) -> None:
    vision = VisionSpec.load(model_dir)
    assert vision is not None
    template = ChatTemplate(load_tokenizer(model_dir), vision=vision)
    backend = VLLMBackend(url, SERVED_NAME, backend_id="vllm-vl", max_context=MAX_CONTEXT)
    try:
        turns = ImageTurns(template, backend)
        session = await turns.session()
        shot = png(100, 60)
        messages = [user("What is in this picture?", shot)]
        await turns.turn(session, messages, [shot], max_tokens=8)
    finally:
        await backend.close()
    [event] = turns.events
    # vLLM read exactly the gateway's expansion (a difference would be recorded, marked).
    assert "prompt_fork" not in event.sampling, event.sampling
    assert full_prompts([event]) == [template.prompt_ids(messages, None)]
    [ref] = event.images
    assert ref.length == vision.placeholders(100, 60)[0]
    assert len(event.completion_ids) == len(event.logprobs) > 0

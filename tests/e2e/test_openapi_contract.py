"""The OpenAPI schema is the contract (issue 9): schemathesis against a real gateway process.

Every operation of ``/openapi.json`` is called with requests generated from the schema, valid
ones and invalid ones (bounded and derandomized, so the run is reproducible), on the tiny model
with a real nats-server. It fails on a server error, a status, content type or body the schema
does not document, or a valid request refused. (Not on an invalid request accepted: the
gateway accepts extra fields in messages and free-form JSON the schema describes narrowly, as
agents send them.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    positive_data_acceptance,
    response_schema_conformance,
    status_code_conformance,
)

from eventlog.server import NatsServer
from tests.helpers.gateway_process import GatewayProcess

pytestmark = pytest.mark.integration

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    positive_data_acceptance,
]
# Generating on the tiny model costs ~2 ms a token and a turn without a cap may generate the
# whole context: generated bodies get a small cap (a valid value, so the case stays valid).
MAX_TOKENS = 4
# Per operation and mode, seeded (derandomize): 10 keeps both modes near a minute on the 2-core
# VM, where 20 took ~130 s of make test's 15 minutes (2026-11-26).
EXAMPLES = 10


@pytest.fixture(scope="module")
def contract_gateway(
    nats_server: NatsServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    process = GatewayProcess(nats_server.url, tiny_model_dir, tmp_path_factory.mktemp("contract"))
    yield process
    process.stop()


@pytest.fixture(scope="module")
def contract_schema(contract_gateway: GatewayProcess) -> Any:
    schema = schemathesis.openapi.from_url(f"{contract_gateway.url}/openapi.json")
    schema.config.base_url = contract_gateway.url
    # A prompt over the model's context is refused (413) by rule: its length in tokens is not
    # something a JSON schema can state.
    acceptance = schema.config.checks.positive_data_acceptance
    acceptance.expected_statuses = [*acceptance.expected_statuses, "413"]
    return schema


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
def test_every_operation_keeps_the_contract(
    contract_schema: Any, contract_gateway: GatewayProcess, mode: GenerationMode
) -> None:
    # Each operation as a hypothesis test of its own (schemathesis' lazy pytest fixture loader
    # does not run under this pytest); every failure is collected, then reported together.
    failures: dict[str, str] = {}
    for result in contract_schema.get_all_operations():
        operation = result.ok()

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(
            max_examples=EXAMPLES,
            derandomize=True,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],
            suppress_health_check=list(HealthCheck),
            database=None,
        )
        def call(case: Any) -> None:
            cap_generation(case)
            case.call_and_validate(base_url=contract_gateway.url, checks=CHECKS, timeout=60)

        try:
            call()
        except Unsatisfiable:
            assert mode is GenerationMode.NEGATIVE, operation.label  # nothing to make invalid
        except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup
            failures[operation.label] = str(exc)[:3000]
    assert not failures, "\n\n".join(
        [*(f"{label}:\n{error}" for label, error in failures.items()), tracebacks(contract_gateway)]
    )


def tracebacks(gateway: GatewayProcess) -> str:
    """The ends of the tracebacks in the gateway's log (a 500's cause: its body only names the
    type; the line that raised is at the end)."""
    text = gateway.log_path.read_text(errors="replace")
    found = [part[-4000:] for part in text.split("Traceback (most recent call last)")[1:]]
    return "the gateway's tracebacks:\n" + ("\n---\n".join(found[-3:]) or "none")


# The image parts of the three APIs: that a string holds a PNG is no rule a JSON schema states,
# and the contract's model reads text (tests/e2e/test_images_api.py sends images, good and bad).
IMAGE_PARTS = ("image_url", "image", "input_image")


def without_images(value: Any) -> None:
    """Drops every image part from a generated body, wherever it is nested."""
    if isinstance(value, dict):
        for item in value.values():
            without_images(item)
    elif isinstance(value, list):
        value[:] = [
            item
            for item in value
            if not (isinstance(item, dict) and item.get("type") in IMAGE_PARTS)
        ]
        for item in value:
            without_images(item)


def listed(value: Any) -> list[Any]:
    """A generated field that should be a list, or [] (an invalid case may hold anything)."""
    return value if isinstance(value, list) else []


def cap_generation(case: Any) -> None:
    """Keep generated turns short, and make generated chat bodies follow the rules between
    fields that a JSON schema cannot state (each documented on its field and tested in
    tests/unit/test_protocol.py and the Anthropic and Responses protocol tests): a named
    tool_choice names one of the tools, "required" needs tools, top_logprobs needs logprobs."""
    if not isinstance(case.body, dict):
        return
    body = case.body
    without_images(body)
    if case.path.endswith("chat/completions"):
        names = [
            t["function"].get("name")
            for t in listed(body.get("tools"))
            if isinstance(t, dict) and isinstance(t.get("function"), dict)
        ]
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            function = choice.get("function")
            if isinstance(function, dict) and names:
                function["name"] = names[0]
            else:
                body.pop("tool_choice")
        elif choice == "required" and not names:
            body.pop("tool_choice")
        if body.get("top_logprobs"):
            body["logprobs"] = True
    elif case.path.endswith("/messages"):  # Anthropic: tool_choice {"type": "tool", "name"}
        names = [t.get("name") for t in listed(body.get("tools")) if isinstance(t, dict)]
        choice = body.get("tool_choice")
        if isinstance(choice, dict) and choice.get("type") in ("tool", "any"):
            if names and isinstance(names[0], str):
                choice["name"] = names[0]
            else:
                body.pop("tool_choice")
    elif case.path.endswith("/responses"):
        # The Responses API's rules between fields (tests/unit/test_responses_protocol.py):
        # a named tool_choice names a function tool, "required" needs one, the input holds
        # a message, previous_response_id names a response of the session (tested in
        # tests/e2e/test_responses_api.py).
        # A namespace's functions are offered as <namespace>__<name>: each such name once,
        # none a function tool's (tests/unit/test_responses_namespaces.py).
        tools = [t for t in listed(body.get("tools")) if isinstance(t, dict)]
        functions = [t for t in tools if t.get("type") == "function"]
        for tool in functions:
            if isinstance(tool.get("name"), str):
                tool["name"] = re.sub("_+", "_", tool["name"])
        names = [t.get("name") for t in functions]
        namespaces = [t for t in tools if t.get("type") == "namespace"]
        for k, tool in enumerate(namespaces):
            tool["name"] = f"ns{k}"
            for j, function in enumerate(tool.get("tools") or []):
                if isinstance(function, dict):
                    function["name"] = f"f{j}"
        choice = body.get("tool_choice")
        if isinstance(choice, dict):
            choice.pop("namespace", None)
            if names:
                choice["name"] = names[0]
            else:
                body.pop("tool_choice")
        elif choice == "required" and not names:
            body.pop("tool_choice")
        body.pop("previous_response_id", None)
        if isinstance(body.get("input"), list):
            body["input"].append({"role": "user", "content": "hi"})
        body.setdefault("max_output_tokens", MAX_TOKENS)
    for cap in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        if isinstance(body.get(cap), int) and body[cap] > MAX_TOKENS:
            body[cap] = MAX_TOKENS
    if case.path.endswith("completions"):
        body.setdefault("max_tokens", MAX_TOKENS)

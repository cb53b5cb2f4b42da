"""``--model-aliases``: the specs, the order names are matched in, and the setting's sources."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError
from pydantic_settings import CliApp

from gateway.serving.model_names import ModelAlias, ModelNames, parse_model_aliases
from turnstream.services.gateway.settings import GatewaySettings
from turnstream.stack.settings import with_toml

SERVED = "Qwen3-8B"


def names(*specs: str) -> ModelNames:
    return ModelNames.of(SERVED, parse_model_aliases(specs))


@pytest.mark.parametrize(
    ("spec", "fragment"),
    [
        ("claude-*", "is not PATTERN=NAME"),
        ("=Qwen3-8B", "is not PATTERN=NAME"),
        ("claude-*=", "is not PATTERN=NAME"),
        ("a=b=c", "is not PATTERN=NAME"),
        ("claude-* =Qwen3-8B", "holds whitespace"),
        ("claude-*=Qwen 3", "holds whitespace"),
    ],
)
def test_a_spec_that_is_not_pattern_equals_name_is_refused_by_name(
    spec: str, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment) as refused:
        parse_model_aliases([spec])
    assert repr(spec) in str(refused.value)


def test_a_pattern_given_twice_is_refused() -> None:
    with pytest.raises(ValueError, match="'claude-\\*' is given twice"):
        parse_model_aliases(["claude-*=a", "gpt-*=a", "claude-*=a"])


def test_an_alias_to_a_model_not_served_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="serves 'Qwen3-8B': write claude-\\*=Qwen3-8B"):
        names("gpt-*=Qwen3-8B", "claude-*=tiny")


@pytest.mark.parametrize(
    ("asked", "served"),
    [
        ("Qwen3-8B", SERVED),  # the served name, alias or not
        ("claude-sonnet-4-6", SERVED),  # claude-*
        ("claude-haiku-4-5-20251001", SERVED),
        ("gpt-5.2-codex", SERVED),  # gpt-5*
        ("o3", SERVED),  # o?
        ("o33", None),  # ? is one character
        ("Claude-sonnet", None),  # case-sensitive, as model names are
        ("gpt-4o", None),
        ("claude", None),  # claude-* needs the dash
        ("", None),
    ],
)
def test_a_requested_name_leads_to_the_served_model_or_to_nothing(
    asked: str, served: str | None
) -> None:
    assert names("claude-*=Qwen3-8B", "gpt-5*=Qwen3-8B", "o?=Qwen3-8B").resolve(asked) == served


def test_the_first_matching_alias_wins_and_the_served_name_matches_before_any() -> None:
    ordered = names("claude-opus-*=Qwen3-8B", "claude-*=Qwen3-8B", "*=Qwen3-8B")
    assert ordered.alias_for("claude-opus-5-5") == ModelAlias("claude-opus-*", SERVED)
    assert ordered.alias_for("claude-haiku-4-5") == ModelAlias("claude-*", SERVED)
    assert ordered.alias_for("anything") == ModelAlias("*", SERVED)
    reversed_ = names("*=Qwen3-8B", "claude-opus-*=Qwen3-8B")
    assert reversed_.alias_for("claude-opus-5-5") == ModelAlias("*", SERVED)
    assert ordered.resolve(SERVED) == SERVED  # never through an alias, whatever matches it


def test_no_aliases_serve_the_served_name_only() -> None:
    plain = ModelNames.of(SERVED, ())
    assert plain.resolve(SERVED) == SERVED and plain.resolve("claude-sonnet-4-6") is None


# -- the setting: flag, env var, TOML ---------------------------------------------------------


def flags(*argv: str) -> list[str]:
    return CliApp.run(GatewaySettings, cli_args=list(argv)).model_aliases


def test_the_flag_takes_comma_separated_specs_repeated_flags_and_json() -> None:
    both = ["claude-*=tiny", "gpt-*=tiny"]
    assert flags("--model-aliases", "claude-*=tiny,gpt-*=tiny") == both
    assert flags("--model-aliases", "claude-*=tiny", "--model-aliases", "gpt-*=tiny") == both
    assert flags("--model-aliases", '["claude-*=tiny", "gpt-*=tiny"]') == both
    assert flags() == []


def test_the_env_var_reads_as_the_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTREAM_MODEL_ALIASES", "claude-*=tiny, gpt-*=tiny")
    assert GatewaySettings().model_aliases == ["claude-*=tiny", "gpt-*=tiny"]


def test_a_bad_spec_is_a_settings_error_before_anything_starts() -> None:
    with pytest.raises(ValidationError, match="'claude-\\*' is not PATTERN=NAME"):
        GatewaySettings(model_aliases=["gpt-*=tiny", "claude-*"])


def test_a_config_file_lists_them(tmp_path: Path) -> None:
    config = tmp_path / "gateway.toml"
    config.write_text('model_aliases = ["claude-*=tiny", "gpt-*=tiny,o?=tiny"]\n')
    read = with_toml(GatewaySettings, config)()
    assert read.model_aliases == ["claude-*=tiny", "gpt-*=tiny", "o?=tiny"]

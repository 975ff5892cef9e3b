"""Real packaged models, imported once per test session.

``smollm2_path`` and ``gemma3_path`` are float32 MLX model folders imported from the GGUF files
that ship in PyPI packages. Imports go to a session temporary directory, or to
``$SEMANTIC_TEST_MODEL_CACHE`` when set, which keeps them across runs (the Gemma 3 import takes
~13 s). A missing package fails the test with the exact install command.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import pytest

from engine.errors import ModelLoadError
from engine.models.gguf_import import import_gguf
from engine.models.packaged import GEMMA3_270M, SMOLLM2_135M, PackagedModel, locate_packaged_gguf

# float32 everywhere: the fastest matmul on CPU and exact enough for tight logits comparisons.
TEST_MODEL_DTYPE = "float32"


@pytest.fixture(scope="session")
def model_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    persistent = os.environ.get("SEMANTIC_TEST_MODEL_CACHE")
    return Path(persistent) if persistent else tmp_path_factory.mktemp("semantic-cache")


def _packaged_gguf(model: PackagedModel, cache_dir: Path) -> Path:
    try:
        return locate_packaged_gguf(model.alias, cache_dir)
    except ModelLoadError as exc:
        # A missing model package is a broken set-up, not a reason to pass: fail with the fix.
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture(scope="session")
def smollm2_gguf_path(model_cache_dir: Path) -> Path:
    return _packaged_gguf(SMOLLM2_135M, model_cache_dir)


@pytest.fixture(scope="session")
def gemma3_gguf_path(model_cache_dir: Path) -> Path:
    return _packaged_gguf(GEMMA3_270M, model_cache_dir)


@pytest.fixture(scope="session")
def smollm2_path(smollm2_gguf_path: Path, model_cache_dir: Path) -> Path:
    return import_gguf(smollm2_gguf_path, model_cache_dir / "models", dtype=TEST_MODEL_DTYPE)


@pytest.fixture(scope="session")
def gemma3_path(gemma3_gguf_path: Path, model_cache_dir: Path) -> Path:
    return import_gguf(gemma3_gguf_path, model_cache_dir / "models", dtype=TEST_MODEL_DTYPE)


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path, model_cache_dir: Path):
    from tests.model.engine_fixtures import load_folder

    return load_folder(smollm2_path, model_cache_dir)


@pytest.fixture(scope="session")
def gemma3(gemma3_path: Path, model_cache_dir: Path):
    from tests.model.engine_fixtures import load_folder

    return load_folder(gemma3_path, model_cache_dir)


# Tiny random-weight thinking models saved as model folders: a family's mlx-lm class, SmolLM2's tokenizer with the
# family's markers added, and a real chat template (bench/templates/thinking). Built once per session. "qwen3" is the
# attention model under Qwen3.5's template (which opens the reasoning in the generation prompt, as Qwen3-Next's and
# the 2507 thinking models' do): a random model never opens it itself.
THINKING_FAMILIES = {"qwen3_5": ("qwen3_5", "qwen3_5"), "qwen3": ("qwen3", "qwen3_5"), "gpt_oss": ("gpt_oss", "gpt_oss")}


@pytest.fixture(scope="session")
def thinking_folder(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory):
    from tests.support.tiny_models import recurrent_family_config

    from bench import random_model

    built: dict[str, Path] = {}

    def folder(kind: str) -> Path:
        if kind not in built:
            family, template = THINKING_FAMILIES[kind]
            vocab = random_model.thinking_vocab_size(smollm2_path, template)
            out = tmp_path_factory.mktemp(f"thinking-{kind}") / kind
            # A context long enough for a coding CLI's request (Codex's is ~10K tokens); the test configs' is 1K.
            config = dict(recurrent_family_config(family, vocab), max_position_embeddings=32768)
            random_model.write_model_folder(config, out, smollm2_path, "float32", seed=0, transform=random_model.vary)
            random_model.use_thinking_template(out, template)
            built[kind] = out
        return built[kind]

    return folder


@pytest.fixture(scope="session")
def vlm_folders(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Tiny random-weight vision-language model folders by family (bench/vision_model.py), each built once:
    Gemma 3, and Qwen2-VL and Qwen2.5-VL (multi-axis rotary positions, M-RoPE)."""
    pytest.importorskip("mlx_vlm", reason="the vision extra (pip install 'semantic[vision]') is not installed")
    from bench.vision_model import gemma3_vlm, qwen_vl_vlm

    built: dict[str, Path] = {}

    def folder(family: str) -> Path:
        if family not in built:
            where = tmp_path_factory.mktemp(family) / family.replace("_", "-")
            built[family] = (gemma3_vlm(where, smollm2_path) if family == "gemma3"
                             else qwen_vl_vlm(where, smollm2_path, family))
        return built[family]

    return folder


@pytest.fixture(scope="session")
def gemma3_vlm_path(vlm_folders: Callable[[str], Path]) -> Path:
    return vlm_folders("gemma3")

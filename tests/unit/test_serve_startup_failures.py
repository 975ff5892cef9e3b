"""`semantic --serve` with a model that cannot load: a missing path, a folder
whose config or weights are corrupt. The process must exit non-zero within
seconds with one clear error line and no Python traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from engine.api.serve import HeadlessRun
from engine.settings import Settings

REPO = Path(__file__).resolve().parents[2]
TINY_LLAMA_CONFIG = {
    "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 258,
    "max_position_embeddings": 2048, "tie_word_embeddings": True,
}


def corrupt_config(folder: Path) -> str:
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama", ')
    return "JSONDecodeError"


def garbage_weights(folder: Path) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}" + os.urandom(512))
    return "could not load model folder"


def truncated_weights(folder: Path) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [258, 64],
                                                       "data_offsets": [0, 258 * 64 * 4]}}).encode()
    (folder / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00" * 100)
    return "could not load model folder"


def no_weights(folder: Path) -> str:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_CONFIG))
    return "could not load model folder"


@pytest.mark.parametrize("make_model", [None, corrupt_config, garbage_weights, truncated_weights, no_weights],
                         ids=["missing", "corrupt-config", "garbage-weights", "truncated-weights", "no-weights"])
def test_serve_with_a_model_that_cannot_load_exits_non_zero_with_one_clear_line(
    tmp_path: Path, make_model: Any
) -> None:
    model = tmp_path / "model"
    expected = make_model(model) if make_model else "not found"
    cache = tmp_path / "cache"
    argv = [sys.executable, "-m", "semantic_cli", "--serve", "--port", "0", "--model", str(model),
            "--cache-dir", str(cache), "--no-preload-openblas"]
    began = time.monotonic()
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60)
    elapsed = time.monotonic() - began

    assert done.returncode != 0
    assert elapsed < 30, f"took {elapsed:.1f} s"
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    # stderr is not a terminal, so every line is a JSON log record.
    records = [json.loads(line) for line in done.stderr.splitlines() if line.strip()]
    errors = [r for r in records if r["level"] == "error"]
    assert len(errors) == 1, done.stderr
    message = errors[0]["msg"]
    assert message.startswith("model failed to load: ") and str(model) in message and expected in message
    assert "\n" not in message and "exc" not in errors[0]
    # The cache directory it made on the way is private.
    assert (cache.stat().st_mode & 0o777) == 0o700


async def test_an_unexpected_exception_while_loading_is_one_line_too(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def buggy_loader(settings: Settings, progress: Any) -> Any:
        raise IndexError("list index out of range")

    caplog.set_level("DEBUG", logger="semantic.serve")
    run = HeadlessRun(Settings(cache_dir=tmp_path, port=0), buggy_loader)
    assert await run.run() == 1
    (error,) = [r for r in caplog.records if r.levelname == "ERROR"]
    assert error.getMessage() == "model failed to load: IndexError: list index out of range"
    assert error.exc_info is None
    assert any(r.levelname == "DEBUG" and r.exc_info for r in caplog.records)  # the traceback, for --log-level debug
    assert run.service.status_detail == "model failed to load: IndexError: list index out of range"

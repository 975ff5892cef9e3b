"""Settings precedence (CLI > env > .env > TOML > defaults), validation, and the generated CLI flags."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from engine.settings import Settings, load_settings
from semantic_cli.main import build_parser
from semantic_cli.args import overrides_from


@pytest.fixture(autouse=True)
def isolated(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in list(__import__("os").environ):
        if name.startswith("SEMANTIC_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.chdir(tmp_path)


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults() -> None:
    settings = load_settings()
    assert settings.block_tokens == 256 and settings.host == "127.0.0.1" and settings.model == "smollm2-135m"


def test_every_layer_in_order_of_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    toml = write(tmp_path / "semantic.toml", "port = 1001\nmax_batch_size = 3\npool_budget_mb = 100\nblock_tokens = 64\n")
    write(tmp_path / ".env", "SEMANTIC_PORT=1002\nSEMANTIC_MAX_BATCH_SIZE=4\nSEMANTIC_POOL_BUDGET_MB=200\n")
    monkeypatch.setenv("SEMANTIC_PORT", "1003")
    monkeypatch.setenv("SEMANTIC_MAX_BATCH_SIZE", "5")
    settings = load_settings(config_file=toml, port=1004)
    assert settings.port == 1004  # CLI beats everything
    assert settings.max_batch_size == 5  # env beats .env and TOML
    assert settings.pool_budget_mb == 200  # .env beats TOML
    assert settings.block_tokens == 64  # TOML beats the default


def test_config_file_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SEMANTIC_CONFIG", str(write(tmp_path / "c.toml", 'model = "gemma3-270m"\n')))
    assert load_settings().model == "gemma3-270m"


def test_default_config_file_is_read_when_present(tmp_path: Path) -> None:
    (tmp_path / "config" / "semantic").mkdir(parents=True)
    write(tmp_path / "config" / "semantic" / "config.toml", "disk_budget_mb = 12\n")
    assert load_settings().disk_budget_mb == 12


def test_missing_config_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_settings(config_file=tmp_path / "nope.toml")


def test_invalid_values_name_the_field(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMANTIC_BLOCK_TOKENS", "7")
    with pytest.raises(ValidationError, match="block_tokens"):
        load_settings()


def test_a_remote_address_needs_an_explicit_opt_in() -> None:
    with pytest.raises(ValidationError, match="allow-remote"):
        load_settings(host="0.0.0.0")
    assert load_settings(host="0.0.0.0", allow_remote=True).host == "0.0.0.0"


def test_settings_are_frozen() -> None:
    with pytest.raises(ValidationError):
        load_settings().port = 1  # type: ignore[misc]


def test_every_setting_has_a_documented_flag() -> None:
    parser = build_parser()
    help_text = parser.format_help()
    for name, field in Settings.model_fields.items():
        assert f"--{name.replace('_', '-')}" in help_text, name
        assert f"SEMANTIC_{name.upper()}" in help_text, name
        assert field.description, name


def test_help_stays_short_and_each_setting_is_explained_in_the_docs() -> None:
    """``--help`` says what a setting does in a sentence or two; docs/configuration.md says why and with what."""
    docs = (Path(__file__).resolve().parents[2] / "docs" / "configuration.md").read_text(encoding="utf-8")
    for name, field in Settings.model_fields.items():
        assert len(field.description or "") <= 220, name
        assert f"`{name}`" in docs, name


def test_flags_override_only_what_was_passed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SEMANTIC_PORT", "9000")
    args = build_parser().parse_args(["--pool-budget-mb", "64", "--no-prefix-sharing", "generate", "hi", "--model", "x"])
    overrides = overrides_from(args)
    assert overrides == {"pool_budget_mb": 64.0, "prefix_sharing": False, "model": "x"}
    settings = load_settings(**overrides)
    assert settings.port == 9000 and settings.pool_budget_mb == 64 and settings.prefix_sharing is False


def test_a_list_setting_is_a_repeated_flag() -> None:
    args = build_parser().parse_args(["--extra-model", "small=smollm2-135m,side", "--extra-model", "g=gemma3-270m",
                                      "--model-route", "gpt-5*=g", "models"])
    settings = load_settings(**overrides_from(args))
    assert settings.extra_models == ("small=smollm2-135m,side", "g=gemma3-270m")
    assert settings.model_routes == ("gpt-5*=g",)
    with pytest.raises(ValueError, match="option 'fast'"):
        load_settings(extra_models=("a=b,fast",))
    with pytest.raises(ValueError, match="ALIAS one of"):
        load_settings(extra_models=("a=b",), model_routes=("x*=nobody",))


def test_cli_reports_invalid_settings_with_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    from semantic_cli.main import main

    assert main(["--block-tokens", "7", "models"]) == 2
    assert "block_tokens" in capsys.readouterr().err


def test_cli_lists_models(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from semantic_cli.main import main

    assert main(["--cache-dir", str(tmp_path), "models"]) == 0
    out = capsys.readouterr().out
    assert "smollm2-135m" in out and "gemma3-270m" in out


def test_cli_models_says_how_a_folders_layers_are_cached_or_why_it_cannot_be_served(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """From config.json alone (no weights): Gemma 4's groups of two widths and its KV-shared layers; a
    recurrent model's state; a family of two caches per layer (each member a cache layer of its own); a family
    whose layers run twice refused, saying why; a folder without a config."""
    import json

    from semantic_cli.main import main
    from tests.support.tiny_models import family_config

    gemma4, mamba, falcon, loop = tmp_path / "gemma4", tmp_path / "mamba", tmp_path / "falcon", tmp_path / "loop"
    for folder, config in ((gemma4, dict(family_config("gemma4_text"), torch_dtype="bfloat16")),
                           (mamba, dict(model_type="mamba2", num_heads=8, head_dim=16, vocab_size=300,
                                        hidden_size=128, intermediate_size=128, state_size=32, num_hidden_layers=4,
                                        layer_norm_epsilon=1e-4, conv_kernel=3, n_groups=4, use_bias=False,
                                        use_conv_bias=False, tie_word_embeddings=True, time_step_limit=[0.01, 10],
                                        time_step_rank="auto")),
                           (falcon, dict(model_type="falcon_h1", num_hidden_layers=2, vocab_size=300, hidden_size=256,
                                         intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                                         head_dim=32, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                                         mamba_d_state=32)),
                           (loop, dict(model_type="iquestloopcoder", hidden_size=64, num_hidden_layers=2,
                                       intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                       rms_norm_eps=1e-5, head_dim=16, vocab_size=300, rope_theta=500000.0,
                                       tie_word_embeddings=False, loop_num=2, loop_window_size=32))):
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
    assert main(["--cache-dir", str(tmp_path / "cache"), "models", str(gemma4), str(mamba), str(falcon),
                 str(loop)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("layer groups: global: 1 layer of 1x64/64 bfloat16 (256 B a token); sliding-24: 5 layers of 1x32/32 "
            "bfloat16 (640 B a token); 4 more layers read earlier layers' K/V") in out
    # Mamba2: a convolution window (kernel - 1 rows of heads x head_dim + 2 x groups x state) and a state matrix.
    assert "layer groups: recurrent: 4 layers of 2x384 float32 + 8x16x32 float32 (76 KiB a sequence)" in out
    assert "2 model layers keep two caches each" in out  # Falcon-H1: a Mamba state beside each layer's K/V
    assert "not servable: model type 'iquestloopcoder': 4 caches for 2 layers" in out
    assert main(["--cache-dir", str(tmp_path / "cache"), "models", str(tmp_path)]) == 2

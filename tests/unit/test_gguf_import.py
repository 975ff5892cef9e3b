"""GGUF import on tiny synthetic files written with gguf.GGUFWriter: no real model weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from tokenizers import Tokenizer

from engine.errors import ModelLoadError, UnsupportedModelError
from engine.models import gguf_import
from engine.models.gguf_import import (
    MARKER_FILE,
    ImportProgress,
    default_import_dtype,
    import_gguf,
    is_complete_import,
)

pytestmark = pytest.mark.unit

Q = gguf.GGMLQuantizationType
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's printable spelling of the 256 byte values, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelling, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            spelling[byte] = chr(byte)
        else:
            spelling[byte] = chr(256 + extra)
            extra += 1
    return [spelling[b] for b in range(256)]


def tiny_vocab() -> list[str]:
    return [*SPECIALS, *byte_alphabet(), "Ġt", "he", "Ġthe"]


@dataclass
class TinyModel:
    """A 2-layer model small enough to write in milliseconds; fields are the knobs tests turn."""

    architecture: str = "llama"
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 96
    layers: int = 2
    quantized: dict[str, gguf.GGMLQuantizationType] = field(
        default_factory=lambda: {"blk.0.attn_q.weight": Q.Q8_0}
    )
    extra_metadata: dict[str, object] = field(default_factory=dict)
    extra_tensors: dict[str, np.ndarray] = field(default_factory=dict)
    tokenizer_model: str = "gpt2"
    tokenizer_pre: str = "smollm"
    seed: int = 0

    @property
    def vocab_size(self) -> int:
        return len(tiny_vocab())

    def tensors(self) -> dict[str, np.ndarray]:
        """Numpy-order (out, in) float32 tensors by GGUF name."""
        rng = np.random.default_rng(self.seed)
        head_dim = self.hidden // self.heads
        block = {
            "attn_q.weight": (self.heads * head_dim, self.hidden),
            "attn_k.weight": (self.kv_heads * head_dim, self.hidden),
            "attn_v.weight": (self.kv_heads * head_dim, self.hidden),
            "attn_output.weight": (self.hidden, self.heads * head_dim),
            "ffn_gate.weight": (self.ffn, self.hidden),
            "ffn_up.weight": (self.ffn, self.hidden),
            "ffn_down.weight": (self.hidden, self.ffn),
            "attn_norm.weight": (self.hidden,),
            "ffn_norm.weight": (self.hidden,),
        }
        if self.architecture == "gemma3":
            block |= {
                "attn_q_norm.weight": (head_dim,),
                "attn_k_norm.weight": (head_dim,),
                "post_attention_norm.weight": (self.hidden,),
                "post_ffw_norm.weight": (self.hidden,),
            }
        shapes = {
            "token_embd.weight": (self.vocab_size, self.hidden),
            "output_norm.weight": (self.hidden,),
        }
        for layer in range(self.layers):
            shapes |= {f"blk.{layer}.{name}": shape for name, shape in block.items()}
        tensors = {
            name: (rng.standard_normal(shape) * 0.1).astype(np.float32)
            for name, shape in shapes.items()
        }
        return tensors | self.extra_tensors

    def expected_values(self) -> dict[str, np.ndarray]:
        """What the importer should read back: quantized tensors carry their quantization error."""
        tensors = self.tensors()
        for name, qtype in self.quantized.items():
            tensors[name] = gguf.quants.dequantize(
                gguf.quants.quantize(tensors[name], qtype), qtype
            )
        return tensors

    def write(self, path: Path) -> Path:
        writer = gguf.GGUFWriter(str(path), self.architecture)
        self._write_hyperparameters(writer)
        self._write_tokenizer(writer)
        for key, value in self.extra_metadata.items():
            _add_metadata(writer, key, value)
        for name, values in self.tensors().items():
            if name in self.quantized:
                qtype = self.quantized[name]
                writer.add_tensor(name, gguf.quants.quantize(values, qtype), raw_dtype=qtype)
            else:
                writer.add_tensor(name, values)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    def _write_hyperparameters(self, writer: gguf.GGUFWriter) -> None:
        writer.add_name(f"Tiny {self.architecture}")
        writer.add_block_count(self.layers)
        writer.add_context_length(128)
        writer.add_embedding_length(self.hidden)
        writer.add_feed_forward_length(self.ffn)
        writer.add_head_count(self.heads)
        writer.add_head_count_kv(self.kv_heads)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(self.hidden // self.heads)
        if self.architecture == "gemma3":
            writer.add_key_length(self.hidden // self.heads)
            writer.add_value_length(self.hidden // self.heads)
            writer.add_sliding_window(32)

    def _write_tokenizer(self, writer: gguf.GGUFWriter) -> None:
        vocab = tiny_vocab()
        writer.add_tokenizer_model(self.tokenizer_model)
        writer.add_tokenizer_pre(self.tokenizer_pre)
        writer.add_token_list(vocab)
        writer.add_token_types([3 if t in SPECIALS else 1 for t in vocab])
        if self.tokenizer_model == "gpt2":
            writer.add_token_merges(MERGES)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        writer.add_chat_template(CHATML)


def _add_metadata(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    else:
        writer.add_uint32(key, int(value))


@pytest.fixture
def models_dir(tmp_path: Path) -> Path:
    return tmp_path / "models"


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return TinyModel().write(tmp_path / "Tiny-Llama.Q8_0.gguf")


def llama_name(gguf_name: str) -> str:
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
    }
    if gguf_name in names:
        return names[gguf_name]
    _, layer, part, kind = gguf_name.split(".")
    parts = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
        "ffn_norm": "post_attention_layernorm",
    }  # fmt: skip
    return f"model.layers.{layer}.{parts[part]}.{kind}"


# -- config and weights ----------------------------------------------------------------------


def test_config_carries_llama_hyperparameters(tiny_gguf: Path, models_dir: Path) -> None:
    folder = import_gguf(tiny_gguf, models_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config == config | {
        "model_type": "llama",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": len(tiny_vocab()),
        "max_position_embeddings": 128,
        "rope_theta": 10000.0,
        "rope_traditional": True,
        "tie_word_embeddings": True,
        "rope_scaling": None,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert config["rms_norm_eps"] == pytest.approx(1e-5)


def test_weights_have_mlx_names_shapes_and_values(tiny_gguf: Path, models_dir: Path) -> None:
    folder = import_gguf(tiny_gguf, models_dir)
    weights = mx.load(str(folder / "model.safetensors"))
    expected = {llama_name(name): values for name, values in TinyModel().expected_values().items()}
    assert set(weights) == set(expected)
    for name, values in expected.items():
        assert weights[name].dtype == mx.float32
        assert weights[name].shape == values.shape, name
        np.testing.assert_array_equal(np.array(weights[name]), values, err_msg=name)


def test_quantized_tensor_is_dequantized_not_copied(tiny_gguf: Path, models_dir: Path) -> None:
    folder = import_gguf(tiny_gguf, models_dir)
    q_proj = np.array(
        mx.load(str(folder / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
    )
    original = TinyModel().tensors()["blk.0.attn_q.weight"]
    assert not np.array_equal(q_proj, original)
    np.testing.assert_allclose(q_proj, original, atol=0.01)


def test_bfloat16_import_stores_bfloat16(tiny_gguf: Path, models_dir: Path) -> None:
    folder = import_gguf(tiny_gguf, models_dir, dtype="bfloat16")
    assert "bfloat16" in folder.name
    embed = mx.load(str(folder / "model.safetensors"))["model.embed_tokens.weight"]
    assert embed.dtype == mx.bfloat16
    original = TinyModel().tensors()["token_embd.weight"]
    np.testing.assert_allclose(np.array(embed.astype(mx.float32)), original, rtol=1e-2, atol=1e-3)


def test_default_dtype_follows_backend() -> None:
    expected = "float32" if mx.default_device().type == mx.cpu else "bfloat16"
    assert default_import_dtype() == expected


def test_imported_folder_loads_and_runs_in_mlx_lm(tiny_gguf: Path, models_dir: Path) -> None:
    from mlx_lm import load

    model, tokenizer = load(str(import_gguf(tiny_gguf, models_dir)))
    ids = tokenizer.encode("the theme")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), len(tiny_vocab()))
    assert bool(mx.all(mx.isfinite(logits)))


def test_gemma3_norms_are_shifted_and_config_is_gemma3_text(
    tmp_path: Path, models_dir: Path
) -> None:
    tiny = TinyModel(architecture="gemma3", heads=2, kv_heads=1, quantized={})
    folder = import_gguf(tiny.write(tmp_path / "tiny-gemma3.gguf"), models_dir)
    config = json.loads((folder / "config.json").read_text())
    assert config == config | {
        "model_type": "gemma3_text",
        "head_dim": 32,
        "sliding_window": 32,
        "sliding_window_pattern": 6,
        "query_pre_attn_scalar": 32,
        "rope_local_base_freq": 10000.0,
    }
    weights = mx.load(str(folder / "model.safetensors"))
    written = tiny.tensors()
    for gguf_name, mlx_name in [
        ("blk.1.attn_q_norm.weight", "model.layers.1.self_attn.q_norm.weight"),
        ("blk.0.ffn_norm.weight", "model.layers.0.pre_feedforward_layernorm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        np.testing.assert_allclose(np.array(weights[mlx_name]), written[gguf_name] - 1.0, rtol=1e-6)
    np.testing.assert_array_equal(
        np.array(weights["model.layers.0.self_attn.q_proj.weight"]), written["blk.0.attn_q.weight"]
    )


def test_linear_rope_scaling_is_carried_over(tmp_path: Path, models_dir: Path) -> None:
    scaled = TinyModel(
        extra_metadata={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0}
    )
    folder = import_gguf(scaled.write(tmp_path / "scaled.gguf"), models_dir)
    assert json.loads((folder / "config.json").read_text())["rope_scaling"] == {
        "type": "linear",
        "factor": 4.0,
    }


# -- tokenizer ---------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_keeps_specials_whole(tiny_gguf: Path, models_dir: Path) -> None:
    folder = import_gguf(tiny_gguf, models_dir)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "<|im_start|>user\nthe theme, 42 ünï 🤖<|im_end|>"
    encoding = tokenizer.encode(text)
    assert encoding.ids[0] == 1 and encoding.ids[-1] == 2
    assert tokenizer.token_to_id("Ġthe") in encoding.ids
    assert tokenizer.decode(encoding.ids, skip_special_tokens=False) == text


def test_tokenizer_config_has_chat_template_and_special_tokens(
    tiny_gguf: Path, models_dir: Path
) -> None:
    folder = import_gguf(tiny_gguf, models_dir)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHATML
    assert (config["bos_token"], config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    assert config["add_bos_token"] is False


def test_unsupported_pre_tokenizer_is_named(tmp_path: Path, models_dir: Path) -> None:
    path = TinyModel(tokenizer_pre="llama-bpe").write(tmp_path / "llama3ish.gguf")
    with pytest.raises(UnsupportedModelError, match=r"'llama-bpe'.*supported: .*smollm"):
        import_gguf(path, models_dir)


def test_sentencepiece_converter_failure_is_an_unsupported_model_error(
    tmp_path: Path, models_dir: Path
) -> None:
    # A SentencePiece-style vocabulary with neither merges nor scores cannot be rebuilt.
    path = TinyModel(tokenizer_model="llama").write(tmp_path / "no-scores.gguf")
    with pytest.raises(UnsupportedModelError, match="transformers' GGUF converter"):
        import_gguf(path, models_dir)


# -- caching and atomicity ---------------------------------------------------------------------


def test_marker_records_provenance(tiny_gguf: Path, models_dir: Path) -> None:
    import hashlib

    folder = import_gguf(tiny_gguf, models_dir, dtype="float16")
    marker = json.loads((folder / MARKER_FILE).read_text())
    assert marker["source_path"] == str(tiny_gguf.resolve())
    assert marker["source_sha256"] == hashlib.sha256(tiny_gguf.read_bytes()).hexdigest()
    assert marker["importer_version"] == gguf_import.IMPORTER_VERSION
    assert marker["dtype"] == "float16"
    assert folder.name.startswith("tiny-llama-q8-0-float16-")


def test_second_import_is_served_from_cache(
    tiny_gguf: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = import_gguf(tiny_gguf, models_dir)

    def must_not_build(*args: object) -> None:
        raise AssertionError("a cached import was rebuilt")

    monkeypatch.setattr(gguf_import, "_build_model_folder", must_not_build)
    reports: list[ImportProgress] = []
    assert import_gguf(tiny_gguf, models_dir, progress=reports.append) == first
    assert reports == []


def test_changed_source_is_imported_again(tiny_gguf: Path, models_dir: Path) -> None:
    first = import_gguf(tiny_gguf, models_dir)
    TinyModel(seed=1).write(tiny_gguf)
    os.utime(tiny_gguf, ns=(1, 1))
    second = import_gguf(tiny_gguf, models_dir)
    assert second != first and is_complete_import(second)


def test_progress_reports_every_stage_in_order(tiny_gguf: Path, models_dir: Path) -> None:
    reports: list[ImportProgress] = []
    import_gguf(tiny_gguf, models_dir, progress=reports.append)
    stages = list(dict.fromkeys(r.stage for r in reports))
    assert stages == ["hashing", "reading", "tensors", "tokenizer", "writing"]
    tensor_reports = [r for r in reports if r.stage == "tensors"]
    total = len(TinyModel().tensors())
    assert [r.done for r in tensor_reports] == list(range(total + 1))
    assert {r.total for r in tensor_reports} == {total}
    assert reports[-1] == ImportProgress("writing", 1, 1)


def test_crash_mid_import_leaves_no_folder(
    tiny_gguf: Path, models_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(folder: Path, *args: object) -> list[str]:
        (folder / "config.json").write_text("{}")
        raise OSError("disk full")

    monkeypatch.setattr(gguf_import, "_write_model_files", crash)
    with pytest.raises(OSError, match="disk full"):
        import_gguf(tiny_gguf, models_dir)
    assert list(models_dir.iterdir()) == []


def test_leftover_temp_dir_of_dead_process_is_removed(tiny_gguf: Path, models_dir: Path) -> None:
    dead_pid = 2**30  # above Linux's pid_max, so no process has it
    leftover = models_dir / f".importing-{dead_pid}-abc"
    leftover.mkdir(parents=True)
    (leftover / "config.json").write_text("{}")
    live = models_dir / f".importing-{os.getpid()}-xyz"
    live.mkdir()
    folder = import_gguf(tiny_gguf, models_dir)
    assert is_complete_import(folder)
    assert not leftover.exists()
    assert live.exists()


def test_incomplete_folder_under_final_name_is_replaced(tiny_gguf: Path, models_dir: Path) -> None:
    folder = import_gguf(tiny_gguf, models_dir)
    (folder / MARKER_FILE).unlink()
    assert not is_complete_import(folder)
    assert import_gguf(tiny_gguf, models_dir) == folder
    assert is_complete_import(folder)


# -- unsupported input -------------------------------------------------------------------------


def test_unsupported_architecture_names_it_and_the_supported_ones(
    tmp_path: Path, models_dir: Path
) -> None:
    path = TinyModel(architecture="falcon").write(tmp_path / "falcon.gguf")
    with pytest.raises(
        UnsupportedModelError, match=r"'falcon'.*supported architectures: gemma3, llama"
    ):
        import_gguf(path, models_dir)
    assert not any(models_dir.iterdir())


def test_unsupported_tensor_type_names_tensor_type_and_supported_types(
    tmp_path: Path, models_dir: Path
) -> None:
    integers = {"blk.0.attn_q.weight": np.zeros((64, 64), dtype=np.int32)}
    path = TinyModel(quantized={}, extra_tensors=integers).write(tmp_path / "ints.gguf")
    with pytest.raises(UnsupportedModelError) as error:
        import_gguf(path, models_dir)
    message = str(error.value)
    assert "'blk.0.attn_q.weight'" in message and "I32" in message
    assert "Q4_K" in message and "Q8_0" in message and "F16" in message


def test_unknown_tensor_name_is_rejected(tmp_path: Path, models_dir: Path) -> None:
    fused = {"blk.0.attn_qkv.weight": np.zeros((192, 64), dtype=np.float32)}
    path = TinyModel(extra_tensors=fused).write(tmp_path / "fused.gguf")
    with pytest.raises(UnsupportedModelError, match=r"'blk.0.attn_qkv.weight'.*'llama'"):
        import_gguf(path, models_dir)


def test_unsupported_rope_scaling_is_rejected(tmp_path: Path, models_dir: Path) -> None:
    yarn = TinyModel(
        extra_metadata={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0}
    )
    with pytest.raises(UnsupportedModelError, match=r"rope scaling 'yarn'"):
        import_gguf(yarn.write(tmp_path / "yarn.gguf"), models_dir)


def test_missing_or_corrupt_file_is_a_model_load_error(tmp_path: Path, models_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        import_gguf(tmp_path / "absent.gguf", models_dir)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"this is not a GGUF file" * 8)
    with pytest.raises(ModelLoadError, match="not a readable GGUF file"):
        import_gguf(corrupt, models_dir)
    assert list(models_dir.iterdir()) == []

"""Write an MLX model folder with random weights and the layer shapes of a real model.

For benchmarking on machines with no model hub (the lent GPU machines reach
nothing outside): speed depends on the shapes, not on the weights. The
vocabulary and chat template come from a tokenizer folder you have (default:
the packaged SmolLM2, imported on first use), so every sampled token id
detokenizes; only the embedding and output matrices differ in size from the
real model, and the report names the shape used.

    python -m bench.random_model --shape llama-3.2-1b --out rand-llama-1b
    python -m bench.random_model --shape llama-3.1-8b --dtype bfloat16 --out rand-llama-8b
    python -m bench.random_model --family qwen3_5 --tool-chat-template --out rand-qwen35
    python -m bench.random_model --family qwen3_5 --thinking-template qwen3_5 --out rand-qwen35-thinking

``--family`` writes one of the small real shapes in FAMILY_SHAPES (any
mlx-lm family there: hybrids, latent attention, ...). ``--tool-chat-template``
replaces SmolLM2's chat template, which has no tools, with Qwen2.5's ChatML
template that renders tool definitions, calls and results: then both
semantic and ``mlx_lm.server`` render a coding agent's tools the same way
(through the template), and a replayed Claude Code trace is like for like.
``--thinking-template NAME`` makes it a thinking model: the family's markers
added to the tokenizer (``<think>``/``</think>``, harmony's specials) and a
thinking family's upstream template (templates/thinking/NAME.jinja: qwen3,
qwen3_5, glm47, gpt_oss), so both servers split its reasoning as they would
a real one's.

The folder loads with ``mlx_lm.load`` and with ``semantic --model FOLDER``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Layer shapes of released models (their config.json), minus the vocabulary.
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
                         head_dim=128, intermediate_size=8192, rope_theta=500000.0, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, rope_theta=500000.0, tie_word_embeddings=False),
    # Qwen3-0.6B's attention and MLP widths (its config.json), 8 of its 28 layers: a thinking attention model a
    # 2-core CPU can prefill a full Claude Code request into (bench_thinking_loop.py) in about a minute.
    "qwen3-0.6b-8l": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=8,
                          head_dim=128, intermediate_size=3072, rope_theta=1000000.0, tie_word_embeddings=True),
    # Not a released model: so small that a decode step is almost all host work (Python, graph
    # building, the engine's machinery), which makes the CPU a stand-in for a GPU's host-bound step.
    "llama-tiny": dict(hidden_size=64, num_hidden_layers=16, num_attention_heads=4, num_key_value_heads=2,
                       head_dim=16, intermediate_size=128, rope_theta=10000.0, tie_word_embeddings=True),
}
# Small real shapes of model families (``--family``; bench_model_families.py serves them against the peer).
# Mixture-of-experts blocks keep their routing (shared expert, top-k) with 8 experts of 256.
_MLA_MOE = dict(hidden_size=512, intermediate_size=1024, moe_intermediate_size=256, num_hidden_layers=4,
                num_attention_heads=8, num_key_value_heads=8, n_routed_experts=8, num_experts_per_tok=2,
                n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, q_lora_rank=384,
                max_position_embeddings=16384)
# DeepSeek V3's and Kimi K2.5's released rotary scaling.
_YARN = dict(type="yarn", factor=40, beta_fast=32, beta_slow=1, mscale=1.0, mscale_all_dim=1.0,
             original_max_position_embeddings=4096)
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    # DeepSeek V3 / R1: a 512-wide latent and 64 rotary dims per token and layer.
    "deepseek_v3": dict(model_type="deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                        v_head_dim=128, rope_scaling=_YARN, **_MLA_MOE),
    # GLM-4.7-Flash: the same latent, wider no-rope and value heads.
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=192,
                          v_head_dim=256, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
                          routed_scaling_factor=1.8, moe_layer_freq=1, rms_norm_eps=1e-5, rope_theta=1e6,
                          rope_scaling=None, **_MLA_MOE),
    # Gemma 4: sliding layers of 256-dim heads, global layers of 512, one KV head, the last layers reading
    # earlier layers' K/V.
    "gemma4_text": dict(model_type="gemma4_text", hidden_size=512, num_hidden_layers=10, intermediate_size=1024,
                        num_attention_heads=4, head_dim=256, global_head_dim=512, num_key_value_heads=1,
                        num_kv_shared_layers=4, hidden_size_per_layer_input=64, sliding_window=512,
                        sliding_window_pattern=5, max_position_embeddings=16384),
    # Llama 4 Scout: 8 KV heads of 128, three chunked layers to a global one.
    "llama4": dict(model_type="llama4", text_config=dict(
        model_type="llama4", attention_bias=False, attention_chunk_size=1024, head_dim=128, hidden_size=512,
        interleave_moe_layer_step=2, intermediate_size=1024, intermediate_size_mlp=1024,
        max_position_embeddings=16384, num_attention_heads=8, num_experts_per_tok=1, num_hidden_layers=4,
        num_key_value_heads=8, num_local_experts=4, rms_norm_eps=1e-5, rope_scaling=None, rope_theta=500000.0,
        use_qk_norm=True)),
}
# Kimi K2.5: DeepSeek V3's text model under a vision-language wrapper.
FAMILY_SHAPES["kimi_k25"] = dict(model_type="kimi_k25", text_config=dict(FAMILY_SHAPES["deepseek_v3"]))
# Qwen3.5-0.8B's layers (gated delta net layers of 16 value and 16 key heads of 128, a 4-wide convolution;
# every fourth layer attention with 2 KV heads of 256), at 8 of its 24 layers and a narrower residual stream:
# the same recurrent state per layer (1.04 MiB, float32 matrix) and the same K/V per token per layer; its released
# context length, so a Claude Code prompt (20K tokens with tools) fits.
FAMILY_SHAPES["qwen3_5"] = dict(model_type="qwen3_5", hidden_size=512, num_hidden_layers=8, intermediate_size=1024,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_value_heads=16,
                         linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                         linear_conv_kernel_dim=4, full_attention_interval=4, partial_rotary_factor=0.25,
                         rope_theta=10_000_000.0, rms_norm_eps=1e-6, max_position_embeddings=262144,
                         tie_word_embeddings=True)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

# Qwen2.5-Instruct's chat template (its tokenizer_config.json), which SmolLM2's ChatML tokens also fit: tool
# definitions in the system turn, calls as <tool_call> JSON, results as <tool_response> user turns.
TOOL_CHAT_TEMPLATE = Path(__file__).with_name("templates") / "qwen2_5_tool_chat_template.jinja"


def tokenizer_folder(ref: str, cache_dir: Path) -> Path:
    """A folder holding tokenizer files: ``ref`` itself, or the model folder an alias resolves to."""
    path = Path(ref)
    if (path / "tokenizer.json").is_file():
        return path
    from engine.models.loader import resolve_model

    resolved = resolve_model(ref, cache_dir)
    if not resolved.is_local:
        raise SystemExit(f"--tokenizer-from {ref!r}: needs a local folder or a packaged model alias")
    return Path(resolved.location)


def write_random_model(shape: str, out: Path, tokenizer_dir: Path, dtype: str, seed: int,
                       vocab_size: int | None = None) -> Path:
    vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
    config = {
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size or len(vocab),
        "rms_norm_eps": 1e-5, "max_position_embeddings": 131072, "torch_dtype": dtype,
        "semantic_random_weights": f"shape of {shape}, seed {seed}", **SHAPES[shape],
    }
    return write_model_folder(config, out, tokenizer_dir, dtype, seed)


def write_model_folder(config: dict, out: Path, tokenizer_dir: Path, dtype: str, seed: int,
                       transform: Callable[[Any], None] | None = None) -> Path:
    """A folder of mlx-lm's model class for ``config`` (any family), random weights (``transform`` may change
    them), and ``tokenizer_dir``'s tokenizer files."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    config = {**config, "torch_dtype": dtype}
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    if transform is not None:
        transform(model)
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    mx.save_safetensors(str(partial / "model.safetensors"), dict(tree_flatten(model.parameters())),
                        metadata={"format": "mlx"})
    (partial / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, partial / name)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)  # a folder that exists is a complete one
    return out


def use_tool_chat_template(folder: Path) -> None:
    """Give ``folder``'s tokenizer TOOL_CHAT_TEMPLATE (written whole to a temporary file, then renamed)."""
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["chat_template"] = TOOL_CHAT_TEMPLATE.read_text()
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(config, indent=2))
    partial.replace(path)


THINKING_TEMPLATES = Path(__file__).with_name("templates") / "thinking"
# Tokens a thinking family's template writes, added to the donor tokenizer (SmolLM2's) as its own tokenizer has
# them: Qwen's and GLM's think markers as ordinary added tokens (kept in decoded text); harmony's as special ones.
THINKING_TOKENS: dict[str, tuple[tuple[str, ...], bool]] = {
    "qwen3": (("<think>", "</think>"), False),
    "qwen3_5": (("<think>", "</think>"), False),
    "glm47": (("<think>", "</think>", "<|assistant|>", "<|user|>", "<|system|>", "<|observation|>"), False),
    "gpt_oss": (("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|call|>", "<|return|>", "<|constrain|>"),
                True),
}
# A harmony model ends its turn with <|return|> (an answer) or <|call|> (a tool call).
THINKING_STOPS = {"gpt_oss": ("<|return|>", "<|call|>")}


def thinking_vocab_size(tokenizer_dir: Path, template: str) -> int:
    """The vocabulary a folder with ``template``'s added tokens will have (the model's embedding rows)."""
    data = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    ids = [*data["model"]["vocab"].values(), *(t["id"] for t in data.get("added_tokens", []))]
    known = {t["content"] for t in data.get("added_tokens", [])} | set(data["model"]["vocab"])
    return max(ids) + 1 + sum(1 for t in THINKING_TOKENS[template][0] if t not in known)


def use_thinking_template(folder: Path, template: str) -> dict[str, int]:
    """Give ``folder``'s tokenizer a thinking family's tokens and chat template (``THINKING_TEMPLATES/NAME.jinja``,
    copied from upstream); returns the added tokens' ids. Files are written whole, then renamed."""
    tokens, special = THINKING_TOKENS[template]
    path = folder / "tokenizer.json"
    data = json.loads(path.read_text())
    known = {t["content"]: t["id"] for t in data.get("added_tokens", [])}
    next_id = max([*data["model"]["vocab"].values(), *known.values()]) + 1
    for token in tokens:
        if token not in known and token not in data["model"]["vocab"]:
            data.setdefault("added_tokens", []).append({"id": next_id, "content": token, "single_word": False,
                                                        "lstrip": False, "rstrip": False, "normalized": False,
                                                        "special": special})
            known[token], next_id = next_id, next_id + 1
    _write_whole(path, json.dumps(data, ensure_ascii=False))
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (THINKING_TEMPLATES / f"{template}.jinja").read_text()
    config.setdefault("added_tokens_decoder", {}).update(
        {str(known[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                         "special": special} for t in tokens})
    _write_whole(config_path, json.dumps(config, indent=2))
    stops = THINKING_STOPS.get(template)
    if stops:
        model_config = json.loads((folder / "config.json").read_text())
        model_config["eos_token_id"] = [known[t] for t in stops]
        _write_whole(folder / "config.json", json.dumps(model_config, indent=2))
    return {t: known[t] for t in tokens}


def _write_whole(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    partial.replace(path)


def vary(model, seed: int = 0, weight_scale: float = 2.0, vector_sd: float = 1.0) -> None:
    """Weights that make a random model's greedy tokens vary: at mlx-lm's initialization its outputs are
    one token repeated (the norms are ones, the logits nearly flat), which no cache bug could change and
    which ends replies at once when that token is a stop token. Matrices are scaled up and every vector
    (norm weights, biases) gets normal noise."""
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    changed = []
    for key, (name, value) in zip(keys, tree_flatten(model.parameters())):
        if value.ndim == 1:
            value = value + vector_sd * mx.random.normal(value.shape, key=key).astype(value.dtype)
        elif value.ndim >= 2:
            value = value * weight_scale
        changed.append((name, value))
    model.update(tree_unflatten(changed))
    mx.eval(model.parameters())


def family_config(kind: str, vocab: int) -> dict[str, Any]:
    config = dict(FAMILY_SHAPES[kind], vocab_size=vocab, semantic_random_weights=f"small real shape of {kind}")
    if "text_config" in config:
        config["text_config"] = dict(config["text_config"], vocab_size=vocab)
    if kind == "gemma4_text":
        config["vocab_size_per_layer_input"] = vocab
    return config


def write_family_folder(kind: str, out: Path, tokenizer_dir: Path, dtype: str, seed: int = 0, vocab: int | None = None) -> Path:
    """``vocab``: the embedding's rows when the tokenizer will have more tokens than its file has now (a thinking
    template's markers, random_model.use_thinking_template)."""
    vocab = vocab or len(json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"])
    return write_model_folder(family_config(kind, vocab), out, tokenizer_dir, dtype, seed=seed,
                              transform=lambda model: vary(model, seed))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    kind = parser.add_mutually_exclusive_group()
    kind.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b",
                      help="a released Llama's layer shapes to copy (default: llama-3.2-1b)")
    kind.add_argument("--family", help="instead: one of the small real shapes in FAMILY_SHAPES (qwen3_5, "
                                       "deepseek_v3, glm4_moe_lite, kimi_k25, gemma4_text, llama4), weights varied "
                                       "so greedy tokens vary")
    parser.add_argument("--tool-chat-template", action="store_true",
                        help="give the folder Qwen2.5's tool-aware ChatML template instead of the tokenizer's own")
    parser.add_argument("--thinking-template", choices=sorted(THINKING_TOKENS),
                        help="make it a thinking model: that family's markers and upstream chat template")
    parser.add_argument("--out", type=Path, required=True, help="the model folder to write (replaced if present)")
    parser.add_argument("--tokenizer-from", default="smollm2-135m",
                        help="folder with tokenizer.json, or a packaged model alias (default: smollm2-135m)")
    parser.add_argument("--cache-dir", type=Path, default=None, help="where packaged models are imported")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weight dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    args = parser.parse_args()
    import mlx.core as mx

    from engine.settings import default_cache_dir

    dtype = args.dtype or ("bfloat16" if mx.default_device().type == mx.DeviceType.gpu else "float32")
    tokenizer_dir = tokenizer_folder(args.tokenizer_from, args.cache_dir or default_cache_dir())
    t0 = time.perf_counter()
    vocab = thinking_vocab_size(tokenizer_dir, args.thinking_template) if args.thinking_template else None
    if args.family:
        if args.family not in FAMILY_SHAPES:
            raise SystemExit(f"--family {args.family!r}: one of {', '.join(sorted(FAMILY_SHAPES))}")
        out = write_family_folder(args.family, args.out, tokenizer_dir, dtype, args.seed, vocab=vocab)
    else:
        out = write_random_model(args.shape, args.out, tokenizer_dir, dtype, args.seed, vocab_size=vocab)
    if args.tool_chat_template:
        use_tool_chat_template(out)
    if args.thinking_template:
        use_thinking_template(out, args.thinking_template)
    size = sum(f.stat().st_size for f in out.iterdir()) / 2**30
    print(f"wrote {out}: random {args.family or args.shape} shapes, {dtype}, {size:.2f} GiB, "
          f"{'tool-aware chat template, ' if args.tool_chat_template else ''}"
          f"{f'{args.thinking_template} thinking template, ' if args.thinking_template else ''}"
          f"in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()

"""Tiny random-weight mlx-lm models built in-process (no files, no hub)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama

from engine.models.cache_spec import derive_cache_spec
from engine.models.materialize import evaluate_all_arrays
from engine.models.loaded import LoadedModel, ModelIdentity

from .byte_tokenizer import VOCAB_SIZE, ByteTokenizer
from bench.random_model import vary  # (re-exported: the tests vary tiny models as the bench does)


def tiny_llama(seed: int = 0, layers: int = 2, head_dim: int | None = None):
    """Heads of 16 dims; ``head_dim`` widens them (64: wide enough for mx.quantize's groups)."""
    mx.random.seed(seed)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=layers,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=head_dim,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB_SIZE,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    mx.eval(model.parameters())
    return model


def tiny_gemma3(seed: int = 0, window: int = 24, head_dim: int = 16):
    """Heads of 16 dims; ``head_dim`` widens them (32: wide enough for mx.quantize's smallest groups)."""
    mx.random.seed(seed)
    args = gemma3_text.ModelArgs(
        model_type="gemma3_text",
        hidden_size=64,
        num_hidden_layers=6,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=head_dim,
        rms_norm_eps=1e-6,
        vocab_size=VOCAB_SIZE,
        sliding_window=window,
        sliding_window_pattern=3,
        max_position_embeddings=4096,
    )
    model = gemma3_text.Model(args)
    mx.eval(model.parameters())
    return model


# Families whose caches are not one plain K/V per layer of one width: latent attention (one latent head;
# GLM's latent and rotary widths split into mx.quantize's groups of 32, DeepSeek's rotary 16 does not),
# Gemma 4 (global layers twice as wide as sliding ones, and layers that read another layer's K/V), Llama 4
# (chunked windows). Configs after mlx-lm's tests/test_models.py, at a vocabulary of the byte tokenizer.
FAMILY_CONFIGS: dict[str, dict] = {
    "deepseek_v3": dict(model_type="deepseek_v3", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
                        n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                        kv_lora_rank=32, q_lora_rank=16, qk_rope_head_dim=16, v_head_dim=16, qk_nope_head_dim=16,
                        max_position_embeddings=4096, rope_scaling=None),
    "glm4_moe_lite": dict(model_type="glm4_moe_lite", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                          num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                          n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=64, q_lora_rank=16,
                          qk_rope_head_dim=32, qk_nope_head_dim=16, v_head_dim=16, topk_method="noaux_tc",
                          scoring_func="sigmoid", norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2,
                          moe_layer_freq=1, first_k_dense_replace=1, max_position_embeddings=4096, rms_norm_eps=1e-5,
                          rope_theta=1000, rope_scaling=None),
    "gemma4_text": dict(model_type="gemma4_text", hidden_size=64, num_hidden_layers=10, intermediate_size=128,
                        num_attention_heads=4, head_dim=32, global_head_dim=64, rms_norm_eps=1e-6,
                        vocab_size_per_layer_input=VOCAB_SIZE, num_key_value_heads=1, num_kv_shared_layers=4,
                        hidden_size_per_layer_input=16, sliding_window=24, sliding_window_pattern=5,
                        final_logit_softcapping=30.0,
                        layer_types=(["sliding_attention"] * 4 + ["full_attention"]) * 2,
                        rope_parameters={"full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
                                         "sliding_attention": {"rope_theta": 10000.0}}),
    "llama4": dict(model_type="llama4", text_config=dict(
        model_type="llama4", attention_bias=False, attention_chunk_size=24, head_dim=16, hidden_size=64,
        interleave_moe_layer_step=2, intermediate_size=128, intermediate_size_mlp=128, max_position_embeddings=4096,
        num_attention_heads=4, num_experts_per_tok=1, num_hidden_layers=4, num_key_value_heads=2, num_local_experts=2,
        rms_norm_eps=1e-4, rope_scaling=None, rope_theta=1000, use_qk_norm=True, vocab_size=VOCAB_SIZE)),
}
# DeepSeek V2's latent attention decompresses the latents and caches per-head K (no-rope + rotary) and V.
FAMILY_CONFIGS["deepseek_v2"] = dict(model_type="deepseek_v2", hidden_size=64, intermediate_size=128,
                                     moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=16,
                                     v_head_dim=16, qk_nope_head_dim=16, n_routed_experts=4, num_experts_per_tok=2,
                                     n_shared_experts=1, first_k_dense_replace=1,
                                     rope_scaling={"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                                                   "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                                                   "type": "yarn"})
# Kimi K2.5: DeepSeek V3's text model under a vision-language wrapper.
FAMILY_CONFIGS["kimi_k25"] = dict(model_type="kimi_k25", text_config=dict(FAMILY_CONFIGS["deepseek_v3"]))
# Kimi-VL's language model: DeepSeek V3's again, under mlx-lm's own Kimi-VL class.
FAMILY_CONFIGS["kimi_vl"] = dict(model_type="kimi_vl", text_config=dict(FAMILY_CONFIGS["deepseek_v3"]))
# Mistral 4: latent attention whose prompt chunks attend over joined rotary and latent keys.
FAMILY_CONFIGS["mistral4"] = dict(model_type="mistral4", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                                  n_routed_experts=4, routed_scaling_factor=1.0, kv_lora_rank=32, q_lora_rank=16,
                                  norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-5, topk_group=1,
                                  num_experts_per_tok=2, first_k_dense_replace=1, n_group=1, qk_rope_head_dim=16,
                                  qk_nope_head_dim=16, v_head_dim=16,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                   "llama_4_scaling_beta": 0.1, "original_max_position_embeddings": 64})


# Families with recurrent layers (linear attention, Mamba, RWKV), from mlx-lm's own test configs as
# bench/family_survey.py builds them (bench/family_configs.json; slow or big ones shrunk, same layer kinds).
RECURRENT_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "nemotron_h", "granitemoehybrid", "lfm2",
                      "mamba2", "kimi_linear", "rwkv7", "jamba", "mamba", "falcon_h1", "baichuan_m1")
# Families whose layers keep two caches each (mlx-lm's CacheList): a Mamba state or a convolution window beside
# the K/V (Falcon-H1, Baichuan M1), two attention passes (LongCat Flash), a sparse-attention indexer's keys beside
# the latent K/V (DeepSeek V3.2). Built as bench/family_survey.py builds them.
CACHE_LIST_FAMILIES = ("falcon_h1", "baichuan_m1", "longcat_flash", "deepseek_v32")


def tiny_family(kind: str, seed: int = 0, vocab_size: int = VOCAB_SIZE):
    """A tiny random-weight model of one of ``FAMILY_CONFIGS``' families, or of ``RECURRENT_FAMILIES`` or
    ``CACHE_LIST_FAMILIES`` (mlx-lm's own classes)."""
    from mlx_lm.utils import _get_classes

    if kind in RECURRENT_FAMILIES or kind in CACHE_LIST_FAMILIES:
        from bench import family_survey

        assert vocab_size == family_survey.VOCAB
        model, _ = family_survey.build(family_survey.entry(kind))
    else:
        config = family_config(kind, vocab_size)
        model_class, args_class = _get_classes(config)
        mx.random.seed(seed)
        model = model_class(args_class.from_dict(config))
    vary(model, seed)
    evaluate_all_arrays(model)  # as the loader does: the engine runs the model on its own thread
    return model


def recurrent_family_config(kind: str, vocab_size: int) -> dict:
    """A ``RECURRENT_FAMILIES`` member's config (a ``config.json``) at ``vocab_size`` tokens: mlx-lm's test
    config as bench/family_survey.py builds it (not one it shrinks for size)."""
    from bench import family_survey

    entry = family_survey.entry(kind)
    # (A test config too big for a CPU run, Falcon-H1's, takes the survey's smaller shape of the same layer kinds.)
    config = dict(entry["config"], model_type=entry["model_type"], **family_survey.SLOW.get(kind, {}),
                  **family_survey.SHRINK.get(kind, {}))
    # Loading the folder's tokenizer builds transformers' config class, which checks what mlx-lm does not read.
    if "time_step_limit" in config:  # floats
        config["time_step_limit"] = [float(x) for x in config["time_step_limit"]]
    if kind == "mamba2":  # hidden_size * expand == num_heads * head_dim (mlx-lm takes the heads' width)
        config["expand"] = config["num_heads"] * config["head_dim"] // config["hidden_size"]
    if kind == "granitemoehybrid":  # the same check under Granite's names (transformers' default expand is 2)
        config["mamba_expand"] = config["mamba_n_heads"] * config["mamba_d_head"] // config["hidden_size"]
    return at_vocab(config, vocab_size)


def family_config(kind: str, vocab_size: int = VOCAB_SIZE) -> dict:
    """``kind``'s config (a ``config.json``) at ``vocab_size`` tokens.

    Every vocabulary size moves: Gemma 4's per-layer input embedding has its
    own (``vocab_size_per_layer_input``), and a token id past it reads outside
    the table (garbage that changes from run to run, NaN at times)."""
    config = at_vocab(FAMILY_CONFIGS[kind], vocab_size)
    if "text_config" in config:
        config["text_config"] = at_vocab(config["text_config"], vocab_size)
    return config


def at_vocab(config: dict, vocab_size: int) -> dict:
    """``config`` with every vocabulary size it has at ``vocab_size`` (Gemma 4's per-layer one too)."""
    per_layer = {"vocab_size_per_layer_input": vocab_size} if "vocab_size_per_layer_input" in config else {}
    return dict(config, vocab_size=vocab_size, **per_layer)


def loaded_tiny(kind: str = "llama", block_tokens: int = 16, context: int = 2048, seed: int = 0) -> LoadedModel:
    # "llama-hd64", "gemma-hd32": wider heads, for K/V quantized (mx.quantize's groups are of 32 or more).
    builders = {"llama": lambda: tiny_llama(seed), "llama-hd64": lambda: tiny_llama(seed, head_dim=64),
                "gemma": lambda: tiny_gemma3(seed), "gemma-hd32": lambda: tiny_gemma3(seed, head_dim=32)}
    model = builders[kind]() if kind in builders else tiny_family(kind, seed)
    spec = derive_cache_spec(model, block_tokens)
    return LoadedModel(
        model_id=f"tiny-{kind}",
        identity=ModelIdentity(f"tiny-{kind}", f"seed{seed:04d}" * 4),
        path=Path("/nonexistent") / f"tiny-{kind}",
        architecture=kind,
        model=model,
        tokenizer=ByteTokenizer(),
        spec=spec,
        context_length=context,
    )

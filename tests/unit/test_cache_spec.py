"""derive_cache_spec on tiny random-weight mlx-lm models, checked against real caches.

Every spec is asserted exactly (byte sizes worked out by hand in the comments)
and then confronted with the K/V arrays a real forward pass writes into
``make_prompt_cache(model)``: the spec must predict their shapes, dtype and bytes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import deepseek_v3, gemma3_text, llama, mamba, mixtral, qwen2, qwen3, qwen3_moe
from mlx_lm.models.cache import (
    CacheList,
    ChunkedKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)
from mlx_lm.utils import _get_classes

from engine.domain.cache_spec import KVGeometry, LayerGroup, ModelCacheSpec
from engine.errors import UnsupportedModelError
from engine.models.cache_spec import derive_cache_spec

pytestmark = pytest.mark.unit

BLOCK = 16
N_TOKENS = 5
VOCAB = 128
DTYPE_NAMES = {mx.float32: "float32", mx.float16: "float16", mx.bfloat16: "bfloat16"}


@pytest.fixture(autouse=True)
def _seeded() -> None:
    mx.random.seed(0)


# -- tiny models -------------------------------------------------------------------


def tiny_llama(**overrides: Any) -> llama.Model:
    args = dict(
        model_type="llama",
        hidden_size=64,
        num_hidden_layers=2,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=VOCAB,
    )
    return llama.Model(llama.ModelArgs(**(args | overrides)))


def tiny_gemma3() -> gemma3_text.Model:
    return gemma3_text.Model(
        gemma3_text.ModelArgs(
            model_type="gemma3_text",
            hidden_size=64,
            num_hidden_layers=6,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=32,
            vocab_size=VOCAB,
            sliding_window=32,
            sliding_window_pattern=3,
        )
    )


# -- reality check -----------------------------------------------------------------


def assert_cache_matches_spec(model: nn.Module, spec: ModelCacheSpec) -> None:
    """Run a forward pass and hold every layer's real K/V against the spec."""
    cache = make_prompt_cache(model)
    model(mx.array([list(range(1, N_TOKENS + 1))]), cache=cache)
    assert len(cache) == spec.n_layers
    for layer, layer_cache in enumerate(cache):
        assert_cache_kind(layer_cache, spec.layer_windows[layer])
        # KVCache preallocates 256-token steps: only the first offset rows are data.
        keys = layer_cache.keys[..., :N_TOKENS, :]
        values = layer_cache.values[..., :N_TOKENS, :]
        mx.eval(keys, values)
        assert keys.shape == (1, spec.n_kv_heads, N_TOKENS, spec.head_dim)
        assert values.shape == (1, spec.n_kv_heads, N_TOKENS, spec.value_head_dim)
        assert DTYPE_NAMES[keys.dtype] == DTYPE_NAMES[values.dtype] == spec.dtype
        assert keys.nbytes + values.nbytes == spec.bytes_per_token_per_layer * N_TOKENS


def assert_cache_kind(layer_cache: Any, window: int | None) -> None:
    if window is None:
        assert type(layer_cache) is KVCache
    else:
        assert type(layer_cache) is RotatingKVCache
        assert layer_cache.max_size == window


def single_group(n_layers: int) -> tuple[LayerGroup, ...]:
    return (LayerGroup(0, tuple(range(n_layers)), None),)


# -- uniform full-attention families -----------------------------------------------


def test_llama_gqa_float32() -> None:
    model = tiny_llama()
    spec = derive_cache_spec(model, BLOCK)
    assert spec == ModelCacheSpec(
        n_layers=2,
        n_kv_heads=2,
        head_dim=16,  # 64 hidden / 4 heads
        dtype="float32",
        block_tokens=BLOCK,
        groups=single_group(2),
        layer_windows=(None, None),
    )
    assert spec.bytes_per_token_per_layer == 2 * (16 + 16) * 4  # 256
    assert spec.block_bytes == 256 * 2 * BLOCK  # 8192
    assert_cache_matches_spec(model, spec)


def test_qwen3_explicit_head_dim_wider_than_hidden_split() -> None:
    model = qwen3.Model(
        qwen3.ModelArgs(
            model_type="qwen3",
            hidden_size=64,
            num_hidden_layers=3,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            max_position_embeddings=512,
            rope_theta=10000.0,
            tie_word_embeddings=True,
        )
    )
    spec = derive_cache_spec(model, BLOCK)
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.dtype) == (3, 2, 32, "float32")
    assert spec.groups == single_group(3)
    assert spec.bytes_per_token_per_layer == 2 * (32 + 32) * 4  # 512
    assert spec.block_bytes == 512 * 3 * BLOCK  # 24576
    assert_cache_matches_spec(model, spec)


def test_qwen2_bfloat16_weights() -> None:
    model = qwen2.Model(
        qwen2.ModelArgs(
            model_type="qwen2",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=8,
            num_key_value_heads=2,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
        )
    )
    model.set_dtype(mx.bfloat16)
    spec = derive_cache_spec(model, BLOCK)
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.dtype) == (2, 2, 8, "bfloat16")
    assert spec.bytes_per_token_per_layer == 2 * (8 + 8) * 2  # 64
    assert spec.block_bytes == 64 * 2 * BLOCK  # 2048
    assert_cache_matches_spec(model, spec)


def test_llama_float16_weights() -> None:
    model = tiny_llama()
    model.set_dtype(mx.float16)
    spec = derive_cache_spec(model, BLOCK)
    assert spec.dtype == "float16"
    assert spec.block_bytes == 2 * (16 + 16) * 2 * 2 * BLOCK  # 4096
    assert_cache_matches_spec(model, spec)


def test_quantized_model_takes_the_scales_dtype() -> None:
    model = tiny_llama()
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    assert isinstance(model.layers[0].self_attn.k_proj, nn.QuantizedLinear)
    spec = derive_cache_spec(model, BLOCK)
    # The packed uint32 weight must not leak into the KV dtype or the head width.
    assert (spec.n_kv_heads, spec.head_dim, spec.dtype) == (2, 16, "float16")
    assert_cache_matches_spec(model, spec)


def test_kv_dtype_override_changes_only_the_dtype() -> None:
    model = tiny_llama()
    native = derive_cache_spec(model, BLOCK)
    halved = derive_cache_spec(model, BLOCK, kv_dtype="bfloat16")
    assert halved.dtype == "bfloat16"
    assert (halved.n_kv_heads, halved.head_dim, halved.groups) == (
        native.n_kv_heads,
        native.head_dim,
        native.groups,
    )
    assert halved.block_bytes * 2 == native.block_bytes


def test_kv_dtype_override_rejects_non_float() -> None:
    with pytest.raises(ValueError, match="int8"):
        derive_cache_spec(tiny_llama(), BLOCK, kv_dtype="int8")


# -- mistral: mlx-lm serves it with the llama code ----------------------------------


def test_mistral_maps_to_llama_and_plain_sliding_window_is_full_attention() -> None:
    model_class, args_class = _get_classes({"model_type": "mistral"})
    assert (model_class, args_class) == (llama.Model, llama.ModelArgs)
    # A Mistral config's sliding_window without layer_types is ignored by
    # mlx-lm's llama: every layer keeps a full KVCache, so the spec says global.
    model = tiny_llama(model_type="mistral", sliding_window=32)
    spec = derive_cache_spec(model, BLOCK)
    assert spec.groups == single_group(2)
    assert not spec.sliding_groups
    assert_cache_matches_spec(model, spec)


def test_llama_layer_types_make_a_hybrid_model() -> None:
    layer_types = ["sliding_attention", "full_attention"] * 2
    model = tiny_llama(num_hidden_layers=4, layer_types=layer_types, sliding_window=32)
    spec = derive_cache_spec(model, BLOCK)
    assert spec.layer_windows == (32, None, 32, None)
    assert spec.groups == (LayerGroup(0, (1, 3), None), LayerGroup(1, (0, 2), 32))
    assert spec.block_bytes == 256 * 2 * BLOCK  # 2 layers per group
    assert_cache_matches_spec(model, spec)


# -- gemma 3: hybrid sliding/global ----------------------------------------------------


def test_gemma3_text_hybrid_groups() -> None:
    model = tiny_gemma3()
    spec = derive_cache_spec(model, BLOCK)
    # Pattern 3: every third layer (2, 5) is global, the other four slide over 32 tokens.
    assert spec == ModelCacheSpec(
        n_layers=6,
        n_kv_heads=1,
        head_dim=32,
        dtype="float32",
        block_tokens=BLOCK,
        groups=(
            LayerGroup(0, (2, 5), None),
            LayerGroup(1, (0, 1), 32),
            LayerGroup(2, (3, 4), 32),
        ),
        layer_windows=(32, 32, None, 32, 32, None),
    )
    assert spec.is_hybrid
    assert spec.bytes_per_token_per_layer == 1 * (32 + 32) * 4  # 256
    assert spec.block_bytes == 256 * 2 * BLOCK  # 8192: gcd(2 global, 4 sliding) = 2 layers
    assert_cache_matches_spec(model, spec)


# -- mixture of experts --------------------------------------------------------------


def test_mixtral_moe() -> None:
    model = mixtral.Model(
        mixtral.ModelArgs(
            model_type="mixtral",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    spec = derive_cache_spec(model, BLOCK)
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.dtype) == (2, 2, 16, "float32")
    assert spec.groups == single_group(2)
    assert spec.block_bytes == 2 * (16 + 16) * 4 * 2 * BLOCK  # 8192
    assert_cache_matches_spec(model, spec)


def test_qwen3_moe_with_a_dense_layer() -> None:
    model = qwen3_moe.Model(
        qwen3_moe.ModelArgs(
            model_type="qwen3_moe",
            hidden_size=64,
            num_hidden_layers=2,
            intermediate_size=128,
            num_attention_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            moe_intermediate_size=32,
            rms_norm_eps=1e-6,
            vocab_size=VOCAB,
            num_key_value_heads=1,
            head_dim=16,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            max_position_embeddings=512,
            norm_topk_prob=True,
        )
    )
    spec = derive_cache_spec(model, BLOCK)
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.dtype) == (2, 1, 16, "float32")
    assert spec.block_bytes == 1 * (16 + 16) * 4 * 2 * BLOCK  # 4096
    assert_cache_matches_spec(model, spec)


# -- a model without make_cache, K and V of different widths ----------------------------


class SplitWidthAttention(nn.Module):
    """Attention whose values are narrower than its keys."""

    def __init__(self, n_kv_heads: int = 2, k_dim: int = 16, v_dim: int = 8) -> None:
        super().__init__()
        self.n_kv_heads = n_kv_heads
        self.k_proj = nn.Linear(64, n_kv_heads * k_dim, bias=False)
        self.v_proj = nn.Linear(64, n_kv_heads * v_dim, bias=False)

    def __call__(self, x: mx.array, cache: KVCache) -> None:
        batch, length, _ = x.shape
        keys = self.k_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        values = self.v_proj(x).reshape(batch, length, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        cache.update_and_fetch(keys, values)


class SplitWidthBlock(nn.Module):
    def __init__(self, **attention: int) -> None:
        super().__init__()
        self.self_attn = SplitWidthAttention(**attention)


class SplitWidthModel(nn.Module):
    """No make_cache: mlx-lm gives it one KVCache per layer."""

    def __init__(self, blocks: list[dict[str, int]]) -> None:
        super().__init__()
        self.model_type = "split_width"
        self.embed_tokens = nn.Embedding(VOCAB, 64)
        self.layers = [SplitWidthBlock(**block) for block in blocks]

    def __call__(self, tokens: mx.array, cache: list[KVCache]) -> mx.array:
        hidden = self.embed_tokens(tokens)
        for layer, layer_cache in zip(self.layers, cache):
            layer.self_attn(hidden, layer_cache)
        return hidden


def test_value_head_dim_differs_from_key_head_dim() -> None:
    model = SplitWidthModel([{}, {}])
    spec = derive_cache_spec(model, BLOCK)
    assert (spec.n_layers, spec.n_kv_heads, spec.head_dim, spec.v_head_dim) == (2, 2, 16, 8)
    assert spec.bytes_per_token_per_layer == 2 * (16 + 8) * 4  # 192
    assert_cache_matches_spec(model, spec)


def test_layers_of_different_geometry_make_groups_of_their_own_with_exact_block_bytes() -> None:
    model = SplitWidthModel([{"n_kv_heads": 2}, {"n_kv_heads": 4}, {"n_kv_heads": 2}])
    spec = derive_cache_spec(model, BLOCK)
    wide = KVGeometry(4, 16, 8, "float32")
    # The most common geometry is the model's own (2 heads); the 4-head layer is a group of its own.
    assert (spec.n_kv_heads, spec.head_dim, spec.v_head_dim) == (2, 16, 8)
    assert spec.groups == (LayerGroup(0, (0, 2), None), LayerGroup(1, (1,), None, wide))
    assert spec.group_block_bytes(spec.groups[0]) == 2 * 2 * (16 + 8) * 4 * BLOCK  # 6144
    assert spec.group_block_bytes(spec.groups[1]) == 4 * (16 + 8) * 4 * BLOCK  # 6144 too
    assert spec.block_bytes == 6144 and [spec.group_units(g) for g in spec.groups] == [1, 1]
    assert spec.layer_geometry(1) == wide and spec.layer_geometry(2) == spec.geometry
    cache = make_prompt_cache(model)
    model(mx.array([list(range(1, N_TOKENS + 1))]), cache=cache)
    for layer, layer_cache in enumerate(cache):
        geometry = spec.layer_geometry(layer)
        keys = layer_cache.keys[..., :N_TOKENS, :]
        assert keys.shape == (1, geometry.n_kv_heads, N_TOKENS, geometry.head_dim)


def test_groups_whose_blocks_differ_in_size_count_in_the_gcd_of_them() -> None:
    model = SplitWidthModel([{"n_kv_heads": 2}, {"n_kv_heads": 2}, {"n_kv_heads": 3}])
    spec = derive_cache_spec(model, BLOCK)
    sizes = [spec.group_block_bytes(g) for g in spec.groups]
    assert sizes == [2 * 2 * 24 * 4 * BLOCK, 3 * 24 * 4 * BLOCK]  # 6144 and 4608
    assert spec.block_bytes == 1536 and [spec.group_units(g) for g in spec.groups] == [4, 3]
    assert spec.blocks_per_group_for_tokens(BLOCK + 1) == {0: 8, 1: 6}  # two blocks of each, in pool units
    assert spec.bytes_for_tokens(BLOCK + 1) == 2 * (6144 + 4608)


# -- caches the block pool cannot hold ---------------------------------------------------


class FakeCacheModel(nn.Module):
    """A llama whose make_cache hands out a cache class the pool does not know."""

    def __init__(self, odd_cache: Any) -> None:
        super().__init__()
        self.inner = tiny_llama(model_type="fake_hybrid")
        self.model_type = "fake_hybrid"
        self._odd_cache = odd_cache

    @property
    def layers(self) -> list[nn.Module]:
        return self.inner.layers

    def make_cache(self) -> list[Any]:
        return [KVCache(), self._odd_cache]

    def __call__(self, inputs: mx.array, cache: list[Any] | None = None) -> mx.array:
        return self.inner(inputs, cache=cache)


@pytest.mark.parametrize(
    ("odd_cache", "class_name"),
    [
        (QuantizedKVCache(), "QuantizedKVCache"),
    ],
)
def test_unknown_cache_classes_are_unsupported(odd_cache: Any, class_name: str) -> None:
    with pytest.raises(UnsupportedModelError, match=f"'fake_hybrid': layer 1 uses {class_name}"):
        derive_cache_spec(FakeCacheModel(odd_cache), BLOCK)


def test_a_cache_list_is_taken_apart_and_an_unsupported_member_named() -> None:
    """A CacheList's members are cache layers of their own (counted after the layers before them)."""
    with pytest.raises(UnsupportedModelError, match="'fake_hybrid': layer 2 uses QuantizedKVCache"):
        derive_cache_spec(FakeCacheModel(CacheList(KVCache(), QuantizedKVCache())), BLOCK)


def test_rotating_cache_with_attention_sinks_is_unsupported() -> None:
    with pytest.raises(UnsupportedModelError, match="keep=4"):
        derive_cache_spec(FakeCacheModel(RotatingKVCache(max_size=32, keep=4)), BLOCK)


def test_mamba_keeps_a_recurrent_state_of_the_shapes_its_layers_write() -> None:
    model = mamba.Model(
        mamba.ModelArgs(
            model_type="mamba",
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            state_size=16,
            num_hidden_layers=2,
            conv_kernel=4,
            use_bias=False,
            use_conv_bias=True,
            time_step_rank=8,
        )
    )
    spec = derive_cache_spec(model, BLOCK)
    (group,) = spec.groups
    assert group.is_recurrent and group.layers == (0, 1) and not group.holds_every_position
    # A convolution window of kernel - 1 rows of the inner width, and the selective scan's state.
    assert group.state.arrays == (((3, 128), "float32"), ((128, 16), "float32"))
    assert spec.state_bytes == 2 * (3 * 128 + 128 * 16) * 4
    assert spec.total_blocks_for_tokens(1) == spec.total_blocks_for_tokens(10_000)  # no block grows


def test_a_chunked_layer_is_a_chunked_group() -> None:
    spec = derive_cache_spec(FakeCacheModel(ChunkedKVCache(chunk_size=64)), BLOCK)
    assert [g.kind for g in spec.groups] == ["global", "chunked-64"]
    assert spec.layer_chunks == (None, 64) and spec.batchable  # each row its own chunk mask (llama4_rows.py)
    assert spec.sliding_groups == (spec.groups[1],)


def test_deepseek_v3_latent_attention_is_one_head_of_the_latent_and_the_rotary_key() -> None:
    model = deepseek_v3.Model(
        deepseek_v3.ModelArgs(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=16,
            qk_nope_head_dim=16,
        )
    )
    # Its make_prompt_cache is a plain KVCache per layer holding the latent:
    # only the attention module gives the compression away.
    assert all(type(c) is KVCache for c in make_prompt_cache(model))
    spec = derive_cache_spec(model, BLOCK)
    assert (spec.n_kv_heads, spec.head_dim, spec.v_head_dim) == (1, 32, 8)  # kv_lora_rank, qk_rope_head_dim
    assert spec.latent and spec.batchable and spec.describe()["latent"] is True  # batched through padded views
    assert spec.bytes_per_token_per_layer == (32 + 8) * 4
    assert_cache_matches_spec(model, spec)

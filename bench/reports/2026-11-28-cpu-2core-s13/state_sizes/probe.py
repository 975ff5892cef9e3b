import json, sys, importlib
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, CacheList
mx.set_default_device(mx.cpu)

def mk(module, cfg):
    m = importlib.import_module(f"mlx_lm.models.{module}")
    args = m.ModelArgs.from_dict(cfg)
    model = m.Model(args)
    return model

CFGS = {}
# Qwen3.5-27B geometry, 4 layers (3 GDN + 1 attn)
CFGS["qwen3_5 (27B dims)"] = ("qwen3_5", {"model_type":"qwen3_5","hidden_size":5120,"num_hidden_layers":4,"intermediate_size":64,
  "num_attention_heads":24,"num_key_value_heads":4,"vocab_size":256,"linear_num_value_heads":48,"linear_num_key_heads":16,
  "linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,"rms_norm_eps":1e-6,"head_dim":256,
  "rope_theta":1e7,"partial_rotary_factor":0.25,"max_position_embeddings":4096,"full_attention_interval":4})
CFGS["qwen3_5 (0.8B dims)"] = ("qwen3_5", {"model_type":"qwen3_5","hidden_size":1024,"num_hidden_layers":4,"intermediate_size":64,
  "num_attention_heads":8,"num_key_value_heads":2,"vocab_size":256,"linear_num_value_heads":16,"linear_num_key_heads":16,
  "linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,"rms_norm_eps":1e-6,"head_dim":256,
  "rope_theta":1e7,"partial_rotary_factor":0.25,"max_position_embeddings":4096,"tie_word_embeddings":True})
CFGS["qwen3_next (80B dims)"] = ("qwen3_next", {"model_type":"qwen3_next","hidden_size":2048,"num_hidden_layers":4,"intermediate_size":64,
  "num_attention_heads":16,"num_key_value_heads":2,"vocab_size":256,"linear_num_value_heads":32,"linear_num_key_heads":16,
  "linear_key_head_dim":128,"linear_value_head_dim":128,"linear_conv_kernel_dim":4,"num_experts":4,"num_experts_per_tok":2,
  "decoder_sparse_step":1,"shared_expert_intermediate_size":64,"mlp_only_layers":[0,1,2,3],"moe_intermediate_size":64,"rms_norm_eps":1e-6,
  "head_dim":256,"rope_theta":1e7,"partial_rotary_factor":0.25,"max_position_embeddings":4096})
CFGS["nemotron_h (Nano-9B-v2 dims)"] = ("nemotron_h", {"model_type":"nemotron_h","vocab_size":256,"hidden_size":4480,"intermediate_size":64,
  "max_position_embeddings":4096,"num_attention_heads":40,"num_key_value_heads":8,"head_dim":128,"attention_bias":False,
  "mamba_num_heads":128,"mamba_head_dim":80,"mamba_proj_bias":False,"ssm_state_size":128,"conv_kernel":4,"n_groups":8,
  "mlp_bias":False,"layer_norm_epsilon":1e-5,"use_bias":False,"use_conv_bias":True,"hybrid_override_pattern":["M","-","*","-"]})
CFGS["granitemoehybrid (4.0-H-Small dims)"] = ("granitemoehybrid", {"model_type":"granitemoehybrid","vocab_size":256,"hidden_size":4096,
  "intermediate_size":64,"num_hidden_layers":2,"max_position_embeddings":4096,"num_attention_heads":32,"num_key_value_heads":8,
  "attention_bias":False,"embedding_multiplier":12.0,"attention_multiplier":0.0078125,"logits_scaling":16.0,"residual_multiplier":0.22,
  "shared_intermediate_size":64,"mamba_n_heads":128,"mamba_d_head":64,
  "mamba_proj_bias":False,"mamba_d_state":128,"mamba_d_conv":4,"mamba_n_groups":1,"mamba_conv_bias":True,
  "layer_types":["mamba","attention"],"rms_norm_eps":1e-5,"position_embedding_type":"nope"})
CFGS["lfm2 (1.2B dims)"] = ("lfm2", {"model_type":"lfm2","hidden_size":2048,"num_hidden_layers":3,"num_attention_heads":32,
  "num_key_value_heads":8,"norm_eps":1e-5,"vocab_size":256,"full_attn_idxs":[2],"block_dim":2048,"block_ffn_dim_multiplier":1.0,
  "block_auto_adjust_ff_dim":False,"block_ff_dim":64,"block_multiple_of":8,"max_position_embeddings":4096,"conv_bias":False,"conv_L_cache":3})
CFGS["mamba2 (mamba2-2.7b dims)"] = ("mamba2", {"model_type":"mamba2","num_heads":80,"head_dim":64,"vocab_size":256,"hidden_size":2560,
  "intermediate_size":5120,"state_size":128,"num_hidden_layers":1,"layer_norm_epsilon":1e-5,"conv_kernel":4,"n_groups":1,
  "use_bias":False,"use_conv_bias":True,"tie_word_embeddings":True,"time_step_limit":[0.0, 1e9],"time_step_rank":"auto"})
CFGS["rwkv7 (1.5B dims)"] = ("rwkv7", {"model_type":"rwkv7","vocab_size":256,"hidden_size":2048,"intermediate_size":64,"norm_eps":1e-5,
  "head_dim":64,"num_hidden_layers":2,"a_low_rank_dim":96,"v_low_rank_dim":64,"gate_low_rank_dim":256,"decay_low_rank_dim":96})
CFGS["kimi_linear (48B dims)"] = ("kimi_linear", {"model_type":"kimi_linear","vocab_size":256,"hidden_size":2304,"num_hidden_layers":2,
  "num_attention_heads":32,"num_key_value_heads":32,"intermediate_size":64,"head_dim":72,"rope_theta":1e4,"rms_norm_eps":1e-5,
  "linear_attn_config":{"num_heads":32,"head_dim":128,"short_conv_kernel_size":4,"kda_layers":[1],"full_attn_layers":[2]},
  "model_max_length":4096,"num_experts":0,"moe_intermediate_size":64,"kv_lora_rank":512,"qk_nope_head_dim":128,"qk_rope_head_dim":64,
  "v_head_dim":128,"mla_use_nope":True})
CFGS["falcon_h1 (7B dims)"] = ("falcon_h1", {"model_type":"falcon_h1","num_hidden_layers":1,"vocab_size":256,"hidden_size":3072,
  "intermediate_size":64,"num_attention_heads":12,"num_key_value_heads":2,"head_dim":128,"mamba_d_state":256,"mamba_n_groups":1,
  "mamba_n_heads":24,"mamba_d_head":128,"mamba_d_ssm":3072,"mamba_d_conv":4})
CFGS["jamba (v0.1 dims)"] = ("jamba", {"model_type":"jamba","hidden_size":4096,"intermediate_size":64,"num_hidden_layers":2,
  "num_attention_heads":32,"num_key_value_heads":8,"attn_layer_offset":1,"attn_layer_period":2,"expert_layer_offset":1,
  "expert_layer_period":2,"mamba_d_conv":4,"mamba_d_state":16,"mamba_expand":2,"mamba_dt_rank":256,"num_experts":1,
  "num_experts_per_tok":1,"rms_norm_eps":1e-6,"max_position_embeddings":4096,"vocab_size":256})

def desc(c):
    out = []
    if isinstance(c, CacheList):
        for s in c.caches: out += desc(s)
    elif isinstance(c, ArraysCache):
        arrs = [a for a in c.cache if a is not None]
        out.append(("arrays", [(tuple(a.shape), str(a.dtype), a.nbytes) for a in arrs]))
    elif isinstance(c, KVCache):
        k, v = c.keys, c.values
        out.append(("kv", (tuple(k.shape), str(k.dtype)), (tuple(v.shape), str(v.dtype)), c.offset))
    else:
        out.append((type(c).__name__,))
    return out

only = sys.argv[1:] 
for name, (module, cfg) in CFGS.items():
    if only and not any(o in name for o in only): continue
    for variant in ("all-bf16", "A_log-fp32"):
        mx.random.seed(0)
        model = mk(module, cfg)
        model.set_dtype(mx.bfloat16)
        if variant == "A_log-fp32":
            from mlx.utils import tree_flatten
            upd = [(k, v.astype(mx.float32)) for k, v in tree_flatten(model.parameters()) if k.endswith("A_log")]
            if not upd: continue
            model.load_weights(upd, strict=False)
        cache = model.make_cache()
        x = mx.array([[1, 2, 3, 4, 5]])
        out = model(x, cache=cache); mx.eval(out)
        out = model(mx.array([[6]]), cache=cache); mx.eval(out)
        for c in cache: 
            for a in (c.cache if isinstance(c, ArraysCache) else []): 
                if a is not None: mx.eval(a)
        print(f"## {name} [{variant}] logits dtype={out.dtype}")
        seen = set()
        for i, c in enumerate(cache):
            d = repr(desc(c))
            if d in seen: continue
            seen.add(d)
            print(f"  layer{i}: {d}")
        sys.stdout.flush()

"""A tiny Qwen2-VL folder whose language model is written by hand to call Claude Code's Read tool.

A random-weight model never writes a tool call, so the real CLI's Read tool (which sends a picture back as an
``image`` block inside a ``tool_result``) cannot be driven by one. This model's one layer is set, not trained:

- attention head 0 copies the previous token into the residual stream (a constant query and key whose rotary
  phases meet only at a distance of one position);
- attention head 1 looks for ``<|vision_start|>`` anywhere in the context (a key only that token has, on the
  slowest rotary pair, so distance does not matter) and raises a flag when it finds one;
- the MLP is a table of rules ``(previous token, current token[, picture seen or not]) -> next token``, one
  hidden unit a rule (a SwiGLU unit that fires only when both tokens match).

With no picture in the context, the reply to any prompt ending in ChatML's ``assistant\\n`` is a Hermes call
``<tool_call>{"name":"Read", "arguments": {"file_path": "shot.png"}}</tool_call>``; once the tool's result has
put a picture in the context, the reply is "It is a picture." Whether the picture reached the model is then
visible in what it says. The vision tower stays random (mlx-vlm's classes), so the picture really goes
through it. Tokens are SmolLM2's; each rule's pair is unique (checked when the folder is built).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from bench.vision_model import QWEN_VL_TINY, QwenVlSize, qwen_vl_vlm

# The reply's tokens as SmolLM2's vocabulary spells them (not always its own split: the closing tag is spelt
# differently from the opening one so that no two rules share a pair).
READ_CALL = ["<", "tool", "_", "call", ">", "Ċ", '{"', "name", '":"', "Read", '",', 'Ġ"', "arguments", '":',
             'Ġ{"', "file", "_", "path", '":', 'Ġ"', "shot", ".", "png", '"', "}}", "Ċ", "</", "to", "ol", "_",
             "ca", "ll", ">"]
ANSWER = ["It", "Ġis", "Ġa", "Ġpicture", "."]
ANSWER_TEXT = "It is a picture."
READ_PATH = "shot.png"
PROMPT_END = ["istant", "Ċ"]  # ChatML's generation prompt, "<|im_start|>assistant\n", ends in these
EOS = "<|im_end|>"

HIDDEN, HEADS, HEAD_DIM = 256, 4, 64
ROPE_THETA = 1_000_000.0
PREVIOUS_PAIRS = 12  # the fastest rotary pairs, summed, peak at one position back only (margin checked below)
PREVIOUS_WEIGHT = 400.0  # per pair: the previous token outscores any other by >= 40 logits
FLAG_WEIGHT = 6.0  # <|vision_start|>'s key on the slowest pair
RULE_GAIN = 3.0
OUT_SCALE = 0.01
HEAD_GAIN = 5.0

SCRIPTED_SIZE = QwenVlSize(
    text={"qwen2_vl": {"hidden_size": HIDDEN, "num_hidden_layers": 1, "intermediate_size": 64,
                       "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                       "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}},
    vision={"qwen2_vl": QWEN_VL_TINY.vision["qwen2_vl"]},
    max_pixels=QWEN_VL_TINY.max_pixels)


def _rules() -> list[tuple[str, str, bool | None, str]]:
    """(previous, current, picture seen: True, False or None for either, next) for both replies."""
    rules: list[tuple[str, str, bool | None, str]] = []
    for reply, seen in ((READ_CALL, False), (ANSWER, True)):
        tokens = [*PROMPT_END, *reply, EOS]
        for index in range(2, len(tokens)):
            rules.append((tokens[index - 2], tokens[index - 1], seen if index == 2 else None, tokens[index]))
    for first in range(len(rules)):
        for second in range(first):
            (p1, c1, s1, n1), (p2, c2, s2, n2) = rules[first], rules[second]
            overlapping = s1 is None or s2 is None or s1 == s2
            if (p1, c1) == (p2, c2) and overlapping and n1 != n2:
                raise ValueError(f"two rules for ({p1!r}, {c1!r}): {n1!r} and {n2!r}")
    return list({(p, c, s, n) for p, c, s, n in rules})


def scripted_read_vlm(folder: Path, tokenizer_source: Path) -> Path:
    """Build the folder (a random Qwen2-VL tower, the scripted language model) and return it."""
    qwen_vl_vlm(folder, tokenizer_source, "qwen2_vl", size=SCRIPTED_SIZE)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
    special = {token["content"]: token["id"] for token in json.loads(
        (folder / "tokenizer.json").read_text())["added_tokens"]}
    ids = {**vocab, **special}
    weights = dict(mx.load(str(folder / "model.safetensors")))
    weights.update(_language_model(ids, config["vocab_size"], config["vision_start_token_id"]))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder


def _language_model(ids: dict[str, int], vocab_size: int, vision_start: int) -> dict[str, mx.array]:
    rules = _rules()
    known = sorted({ids[token] for rule in rules for token in (rule[0], rule[1], rule[3])} | {vision_start})
    slot = {token_id: index for index, token_id in enumerate(known)}
    other = len(known)  # every token without a slot of its own shares this one
    slots = other + 1
    targets = sorted({ids[rule[3]] for rule in rules})
    target_dim = {token_id: index for index, token_id in enumerate(targets)}
    # The residual stream: current token's slot | previous token's slot | constant | picture flag | outputs.
    previous_at, constant, flag, outputs_at = slots, 2 * slots, 2 * slots + 1, 2 * slots + 2
    if outputs_at + len(targets) > HIDDEN or slots > HEAD_DIM:
        raise ValueError("the script does not fit the model's width")

    embed = np.zeros((vocab_size, HIDDEN), np.float32)
    embed[:, other] = 1.0
    for token_id, index in slot.items():
        embed[token_id, other] = 0.0
        embed[token_id, index] = 1.0
    embed[:, constant] = 1.0

    # Attention biases carry the constant queries and keys; mlx's rotary pairs are (i, i + HEAD_DIM / 2).
    theta = ROPE_THETA ** (-2 * np.arange(HEAD_DIM // 2) / HEAD_DIM)
    q_bias = np.zeros(HEADS * HEAD_DIM, np.float32)
    k_bias = np.zeros(HEADS * HEAD_DIM, np.float32)
    q_proj = np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32)
    k_proj = np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32)
    v_proj = np.zeros((HEADS * HEAD_DIM, HIDDEN), np.float32)
    o_proj = np.zeros((HIDDEN, HEADS * HEAD_DIM), np.float32)
    half = HEAD_DIM // 2
    radius = np.sqrt(PREVIOUS_WEIGHT)
    for pair in range(PREVIOUS_PAIRS):  # head 0: query rotated back by one position's angle
        q_bias[pair], q_bias[pair + half] = radius * np.cos(theta[pair]), -radius * np.sin(theta[pair])
        k_bias[pair] = radius
    normalized = np.sqrt(HIDDEN / 2)  # a slot's value after the input norm (two components on)
    for index in range(slots):
        v_proj[index, index] = 1.0
        o_proj[previous_at + index, index] = 1.0 / normalized
    slowest = half - 1  # head 1: distance-blind search for <|vision_start|>
    q_bias[HEAD_DIM + slowest] = FLAG_WEIGHT
    k_proj[HEAD_DIM + slowest, slot[vision_start]] = FLAG_WEIGHT
    v_proj[HEAD_DIM, slot[vision_start]] = 1.0
    o_proj[flag, HEAD_DIM] = 1.0 / normalized

    units = len(rules)
    gate = np.zeros((64, HIDDEN), np.float32)
    up = np.zeros((64, HIDDEN), np.float32)
    down = np.zeros((HIDDEN, 64), np.float32)
    if units > 64:
        raise ValueError("more rules than hidden units")
    for unit, (previous, current, seen, following) in enumerate(rules):
        gate[unit, :slots] = -RULE_GAIN
        gate[unit, previous_at:previous_at + slots] = -RULE_GAIN
        gate[unit, slot[ids[current]]] = RULE_GAIN
        gate[unit, previous_at + slot[ids[previous]]] = RULE_GAIN
        gate[unit, constant] = -0.5 * RULE_GAIN
        if seen is False:
            gate[unit, flag] = -3 * RULE_GAIN
        elif seen is True:
            gate[unit, flag] = 2 * RULE_GAIN
            gate[unit, constant] -= 2 * RULE_GAIN
        up[unit, constant] = 1.0
        down[outputs_at + target_dim[ids[following]], unit] = OUT_SCALE

    head = np.zeros((vocab_size, HIDDEN), np.float32)
    for token_id, index in target_dim.items():
        head[token_id, outputs_at + index] = HEAD_GAIN
    head[ids[EOS], constant] += 1.0  # with no rule firing, the reply ends

    prefix = "language_model.model.layers.0."
    arrays = {
        "language_model.model.embed_tokens.weight": embed, "language_model.lm_head.weight": head,
        "language_model.model.norm.weight": np.ones(HIDDEN, np.float32),
        prefix + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
        prefix + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        prefix + "self_attn.q_proj.weight": q_proj, prefix + "self_attn.q_proj.bias": q_bias,
        prefix + "self_attn.k_proj.weight": k_proj, prefix + "self_attn.k_proj.bias": k_bias,
        prefix + "self_attn.v_proj.weight": v_proj,
        prefix + "self_attn.v_proj.bias": np.zeros(HEADS * HEAD_DIM, np.float32),
        prefix + "self_attn.o_proj.weight": o_proj,
        prefix + "mlp.gate_proj.weight": gate, prefix + "mlp.up_proj.weight": up,
        prefix + "mlp.down_proj.weight": down,
    }
    return {name: mx.array(value) for name, value in arrays.items()}

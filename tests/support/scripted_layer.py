"""One transformer layer written by hand, not trained, to reply by rules: how a test drives a real client's tools.

A random-weight model never writes a tool call, so a real client's tools (Claude Code's Read, its Agent) cannot be
driven by one. This layer's weights are set so that the model follows a table of rules:

- attention head 0 copies the previous token into the residual stream (a constant query and key whose rotary
  phases meet only at a distance of one position);
- attention heads 1 to 3 each look for one *flag* token anywhere in the context (a key only that token has, on
  the slowest rotary pair, so distance does not matter) and raise their flag when they find it;
- the MLP is a table of rules ``(previous token, current token, flags) -> next token``, one hidden unit a rule (a
  SwiGLU unit that fires only when both tokens match and each flag the rule names is raised or not).

The layer is Qwen2's (biases on the query, key and value projections, non-traditional rotary pairs ``(i, i +
head_dim / 2)``), the text model of Qwen2-VL as well. Tokens are SmolLM2's; each rule's pair is unique among rules
whose flags can hold together (checked when the weights are built).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

HIDDEN, HEADS, HEAD_DIM, UNITS = 256, 4, 64, 128
ROPE_THETA = 1_000_000.0
PREVIOUS_PAIRS = 12  # the fastest rotary pairs, summed, peak at one position back only
PREVIOUS_WEIGHT = 400.0  # per pair: the previous token outscores any other by >= 40 logits
FLAG_WEIGHT = 6.0  # a flag token's key on the slowest pair
RULE_GAIN = 3.0
OUT_SCALE = 0.01
HEAD_GAIN = 5.0
MAX_FLAGS = HEADS - 1

# ChatML's generation prompt, "<|im_start|>assistant\n", ends in these two of SmolLM2's tokens.
PROMPT_END = ("istant", "Ċ")
EOS = "<|im_end|>"


@dataclass(frozen=True, slots=True)
class Rule:
    previous: str
    current: str
    following: str
    # Per flag: True (the flag's token is in the context), False (it is not), None (either).
    flags: tuple[bool | None, ...] = ()


def reply_rules(reply: list[str], flags: tuple[bool | None, ...]) -> list[Rule]:
    """The rules that write ``reply`` after the generation prompt, then end the turn; ``flags`` choose the reply
    (its first token; the rest follow from the tokens before them)."""
    tokens = [*PROMPT_END, *reply, EOS]
    return [Rule(tokens[i - 2], tokens[i - 1], tokens[i], flags if i == 2 else ())
            for i in range(2, len(tokens))]


def checked(rules: list[Rule]) -> list[Rule]:
    """The rules without repeats; two rules that can fire together must agree on the next token."""
    unique = list(dict.fromkeys(rules))
    for first in range(len(unique)):
        for second in range(first):
            a, b = unique[first], unique[second]
            if (a.previous, a.current) == (b.previous, b.current) and _together(a, b) and a.following != b.following:
                raise ValueError(f"two rules for ({a.previous!r}, {a.current!r}): {a.following!r} and "
                                 f"{b.following!r}")
    return unique


def _together(a: Rule, b: Rule) -> bool:
    width = max(len(a.flags), len(b.flags))
    fa, fb = (*a.flags, *(None,) * (width - len(a.flags))), (*b.flags, *(None,) * (width - len(b.flags)))
    return all(x is None or y is None or x == y for x, y in zip(fa, fb))


def scripted_weights(rules: list[Rule], ids: dict[str, int], vocab_size: int, flags: list[int],
                     prefix: str = "") -> dict[str, mx.array]:
    """The layer's weights (names under ``prefix``: "" for a text model, "language_model." for a VLM's), for
    ``rules`` over the tokens ``ids`` names, the flags raised by the token ids ``flags``."""
    rules = checked(rules)
    if len(flags) > MAX_FLAGS or any(len(rule.flags) > len(flags) for rule in rules):
        raise ValueError(f"at most {MAX_FLAGS} flags, and a rule names only the flags given")
    known = sorted({ids[token] for rule in rules for token in (rule.previous, rule.current, rule.following)}
                   | set(flags))
    slot = {token_id: index for index, token_id in enumerate(known)}
    other = len(known)  # every token without a slot of its own shares this one
    slots = other + 1
    targets = sorted({ids[rule.following] for rule in rules})
    target_dim = {token_id: index for index, token_id in enumerate(targets)}
    # The residual stream: current token's slot | previous token's slot | constant | flags | outputs.
    previous_at, constant, flag_at = slots, 2 * slots, 2 * slots + 1
    outputs_at = flag_at + len(flags)
    if outputs_at + len(targets) > HIDDEN or slots > HEAD_DIM or len(rules) > UNITS:
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
    slowest = half - 1  # heads 1..: distance-blind searches for the flag tokens
    for number, token_id in enumerate(flags, start=1):
        head = number * HEAD_DIM
        q_bias[head + slowest] = FLAG_WEIGHT
        k_proj[head + slowest, slot[token_id]] = FLAG_WEIGHT
        v_proj[head, slot[token_id]] = 1.0
        o_proj[flag_at + number - 1, head] = 1.0 / normalized

    gate = np.zeros((UNITS, HIDDEN), np.float32)
    up = np.zeros((UNITS, HIDDEN), np.float32)
    down = np.zeros((HIDDEN, UNITS), np.float32)
    for unit, rule in enumerate(rules):
        gate[unit, :slots] = -RULE_GAIN
        gate[unit, previous_at:previous_at + slots] = -RULE_GAIN
        gate[unit, slot[ids[rule.current]]] = RULE_GAIN
        gate[unit, previous_at + slot[ids[rule.previous]]] = RULE_GAIN
        gate[unit, constant] = -0.5 * RULE_GAIN
        for number, seen in enumerate(rule.flags):
            if seen is False:
                gate[unit, flag_at + number] = -3 * RULE_GAIN
            elif seen is True:
                gate[unit, flag_at + number] = 2 * RULE_GAIN
                gate[unit, constant] -= 2 * RULE_GAIN
        up[unit, constant] = 1.0
        down[outputs_at + target_dim[ids[rule.following]], unit] = OUT_SCALE

    head_weights = np.zeros((vocab_size, HIDDEN), np.float32)
    for token_id, index in target_dim.items():
        head_weights[token_id, outputs_at + index] = HEAD_GAIN
    head_weights[ids[EOS], constant] += 1.0  # with no rule firing, the reply ends

    layer = prefix + "model.layers.0."
    arrays = {
        prefix + "model.embed_tokens.weight": embed, prefix + "lm_head.weight": head_weights,
        prefix + "model.norm.weight": np.ones(HIDDEN, np.float32),
        layer + "input_layernorm.weight": np.ones(HIDDEN, np.float32),
        layer + "post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
        layer + "self_attn.q_proj.weight": q_proj, layer + "self_attn.q_proj.bias": q_bias,
        layer + "self_attn.k_proj.weight": k_proj, layer + "self_attn.k_proj.bias": k_bias,
        layer + "self_attn.v_proj.weight": v_proj,
        layer + "self_attn.v_proj.bias": np.zeros(HEADS * HEAD_DIM, np.float32),
        layer + "self_attn.o_proj.weight": o_proj,
        layer + "mlp.gate_proj.weight": gate, layer + "mlp.up_proj.weight": up,
        layer + "mlp.down_proj.weight": down,
    }
    return {name: mx.array(value) for name, value in arrays.items()}


def token_ids(tokenizer_json: dict) -> dict[str, int]:
    """Every token of a ``tokenizer.json`` by its spelling, added (special) tokens included."""
    return {**tokenizer_json["model"]["vocab"], **{t["content"]: t["id"] for t in tokenizer_json["added_tokens"]}}

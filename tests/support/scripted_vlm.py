"""A tiny Qwen2-VL folder whose language model is written by hand to call Claude Code's Read tool.

Its one layer is scripted (tests/support/scripted_layer.py) with one flag, raised by ``<|vision_start|>``: with
no picture in the context, the reply to any prompt ending in ChatML's ``assistant\\n`` is a Hermes call
``<tool_call>{"name":"Read", "arguments": {"file_path": "shot.png"}}</tool_call>``; once the tool's result has
put a picture in the context, the reply is "It is a picture." Whether the picture reached the model is then
visible in what it says. The vision tower stays random (mlx-vlm's classes), so the picture really goes
through it.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx

from bench.vision_model import QWEN_VL_TINY, QwenVlSize, qwen_vl_vlm
from tests.support.scripted_layer import (HEADS, HIDDEN, UNITS, reply_rules, scripted_weights,
                                          token_ids)

# The reply's tokens as SmolLM2's vocabulary spells them (not always its own split: the closing tag is spelt
# differently from the opening one so that no two rules share a pair).
READ_CALL = ["<", "tool", "_", "call", ">", "Ċ", '{"', "name", '":"', "Read", '",', 'Ġ"', "arguments", '":',
             'Ġ{"', "file", "_", "path", '":', 'Ġ"', "shot", ".", "png", '"', "}}", "Ċ", "</", "to", "ol", "_",
             "ca", "ll", ">"]
ANSWER = ["It", "Ġis", "Ġa", "Ġpicture", "."]
ANSWER_TEXT = "It is a picture."
READ_PATH = "shot.png"

SCRIPTED_SIZE = QwenVlSize(
    text={"qwen2_vl": {"hidden_size": HIDDEN, "num_hidden_layers": 1, "intermediate_size": UNITS,
                       "num_attention_heads": HEADS, "num_key_value_heads": HEADS,
                       "rope_scaling": {"type": "mrope", "mrope_section": [8, 12, 12]}}},
    vision={"qwen2_vl": QWEN_VL_TINY.vision["qwen2_vl"]},
    max_pixels=QWEN_VL_TINY.max_pixels)


def scripted_read_vlm(folder: Path, tokenizer_source: Path) -> Path:
    """Build the folder (a random Qwen2-VL tower, the scripted language model) and return it."""
    qwen_vl_vlm(folder, tokenizer_source, "qwen2_vl", size=SCRIPTED_SIZE)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 131072
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    ids = token_ids(json.loads((folder / "tokenizer.json").read_text()))
    rules = reply_rules(READ_CALL, (False,)) + reply_rules(ANSWER, (True,))
    weights = dict(mx.load(str(folder / "model.safetensors")))
    weights.update(scripted_weights(rules, ids, config["vocab_size"], [config["vision_start_token_id"]],
                                    prefix="language_model."))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    return folder

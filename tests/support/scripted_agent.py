"""A tiny Qwen2 folder whose one layer is scripted (scripted_layer.py) to hand a task to Claude Code's Agent tool.

Two flags: ``quat`` (in the task's prompt, "Kumquat") and ``zzy`` (in the subagent's answer, "Zyzzyva.").

- Neither in the context (the main agent's first turn): the reply is the Hermes call
  ``<tool_call>{"name":"Agent", "arguments": {"description": "Fetch","prompt":"Kumquat"}}</tool_call>``;
- the task's prompt but no answer (the subagent Claude Code starts with that prompt): "Zyzzyva.";
- the subagent's answer in the context (the main agent's turn with the tool's result): "It is finished."

Neither token is in Claude Code's own prompts and tools (bench/traces' recordings hold neither), so each reply
says where the request came from. The folder carries Qwen2.5's tool chat template (bench/random_model.py), whose
ChatML SmolLM2's tokens fit.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.random_model import use_tool_chat_template, write_model_folder
from tests.support.scripted_layer import (HEADS, HIDDEN, ROPE_THETA, UNITS, reply_rules, scripted_weights,
                                          token_ids)

AGENT_CALL = ["<", "tool", "_", "call", ">", "Ċ", '{"', "name", '":"', "Agent", '",', 'Ġ"', "arguments", '":',
              'Ġ{"', "description", '":', 'Ġ"', "F", "etch", '","', "prompt", '":"', "K", "um", "quat", '"', "}}",
              "Ċ", "</", "to", "ol", "_", "ca", "ll", ">"]
SUBAGENT_ANSWER = ["Z", "y", "zzy", "va", "."]
SUBAGENT_TEXT = "Zyzzyva."
FINAL_ANSWER = ["It", "Ġis", "Ġfinished", "."]
FINAL_TEXT = "It is finished."
TASK_FLAG, ANSWER_FLAG = "quat", "zzy"


def scripted_agent_model(folder: Path, tokenizer_source: Path) -> Path:
    """Build the folder (SmolLM2's tokenizer, the scripted layer) and return it."""
    ids = token_ids(json.loads((tokenizer_source / "tokenizer.json").read_text()))
    vocab_size = max(ids.values()) + 1
    config = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": HIDDEN,
              "num_hidden_layers": 1, "intermediate_size": UNITS, "num_attention_heads": HEADS,
              "num_key_value_heads": HEADS, "rms_norm_eps": 1e-6, "rope_theta": ROPE_THETA,
              "vocab_size": vocab_size, "tie_word_embeddings": False, "max_position_embeddings": 131072}
    # Flags in order: the task's prompt, the subagent's answer.
    rules = (reply_rules(AGENT_CALL, (False, False)) + reply_rules(SUBAGENT_ANSWER, (True, False))
             + reply_rules(FINAL_ANSWER, (None, True)))
    weights = scripted_weights(rules, ids, vocab_size, [ids[TASK_FLAG], ids[ANSWER_FLAG]])

    def script(model: Any) -> None:
        model.load_weights(list(weights.items()))

    write_model_folder(config, folder, tokenizer_source, "float32", seed=0, transform=script)
    use_tool_chat_template(folder)
    return folder

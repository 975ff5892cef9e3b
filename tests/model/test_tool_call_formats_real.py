"""GLM's, MiniMax-M2's, Gemma 4's, Kimi K2's and Mistral's tool calls on a real tokenizer: mlx-lm picks the format's parser from the chat
template, the server's tool format streams it, and a call cut where the real tokenizer cuts it streams its
arguments token by token to the JSON the parser reads.

SmolLM2's tokenizer with its chat template marked as each format's (mlx-lm infers the parser from a marker in the
template, tokenizer_utils._infer_tool_parser): no model runs, so this is about the tokens' cuts and the wiring from
a model folder's tokenizer to the stream; the formats themselves are tested in
tests/unit/test_tool_argument_formats.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.formats.tools.calls import ToolArgumentsPiece, ToolCallStream, ToolPiece, ToolStartPiece, tool_format_for

pytestmark = pytest.mark.model

ARGUMENTS = {"file_path": "src/app.py", "content": 'print("hi")\nx = {"a": [1, 2]}'}  # (GLM and MiniMax strip a value)
TOOLS = [{"type": "function", "function": {"name": "Write", "parameters": {"type": "object", "properties": {
    "file_path": {"type": "string"}, "content": {"type": "string"}}}}}]
CALLS = {
    "glm47": ("<arg_key>", "<tool_call>Write\n<arg_key>file_path</arg_key>\n<arg_value>src/app.py</arg_value>\n"
              "<arg_key>content</arg_key>\n<arg_value>" + ARGUMENTS["content"] + "</arg_value>\n</tool_call>"),
    "minimax_m2": ("<minimax:tool_call>", '<minimax:tool_call><invoke name="Write">\n<parameter name="file_path">'
                   "src/app.py</parameter>\n<parameter name=\"content\">" + ARGUMENTS["content"]
                   + "</parameter>\n</invoke></minimax:tool_call>"),
    "gemma4": ("<|tool_call> and <tool_call|>", '<|tool_call>call:Write{file_path:<|"|>src/app.py<|"|>,content:<|"|>'
               + ARGUMENTS["content"] + '<|"|>}<tool_call|>'),
    "kimi": ("<|tool_calls_section_begin|>",
             "<|tool_calls_section_begin|><|tool_call_begin|>functions.Write:0<|tool_call_argument_begin|>"
             + json.dumps(ARGUMENTS) + "<|tool_call_end|><|tool_calls_section_end|>"),
    "mistral": ("[TOOL_CALLS]", "[TOOL_CALLS]Write[ARGS]" + json.dumps(ARGUMENTS)),
}


def marked_tokenizer(smollm2_path: Path, folder: Path, marker: str):
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(smollm2_path / name, folder / name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["chat_template"] = config["chat_template"] + "{# tools are called with " + marker + " #}"
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return load_tokenizer(folder)


@pytest.mark.parametrize("kind", sorted(CALLS))
def test_a_call_streams_token_by_token_on_a_real_tokenizer(kind: str, smollm2_path: Path, tmp_path: Path) -> None:
    marker, text = CALLS[kind]
    tokenizer = marked_tokenizer(smollm2_path, tmp_path / kind, marker)
    fmt = tool_format_for(tokenizer)
    assert fmt.streams == kind, (fmt, tokenizer.tool_parser)
    stream, pieces = ToolCallStream(fmt, TOOLS), []
    detokenizer = tokenizer.detokenizer
    detokenizer.reset()
    for token in tokenizer.encode("Writing it. " + text, add_special_tokens=False):
        detokenizer.add_token(token)
        pieces += stream.feed(detokenizer.last_segment)
    detokenizer.finalize()
    pieces += stream.feed(detokenizer.last_segment) + stream.finish()
    started = next(i for i, p in enumerate(pieces) if isinstance(p, ToolStartPiece))
    deltas = [p.text for p in pieces if isinstance(p, ToolArgumentsPiece)]
    assert pieces[started].name == "Write" and len(deltas) > 10  # many tokens, many pieces
    assert isinstance(pieces[-1], ToolPiece) and pieces[-1].complete
    assert json.loads("".join(deltas)) == pieces[-1].call.arguments == ARGUMENTS

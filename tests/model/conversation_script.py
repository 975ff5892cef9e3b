"""A multi-turn conversation in its own process, for restart tests.

    python -m tests.model.conversation_script --cache-dir D --model M --first 0 --last 2

runs turns ``first..last`` of a fixed script for one agent through the real
engine (warm store included) and prints one JSON line per turn. Earlier
turns' replies are regenerated deterministically (greedy), so the history a
later process sends is exactly what an uninterrupted process would send.
"""

from __future__ import annotations

import argparse
import json
import sys

from engine.bootstrap import build_engine, load_configured_model
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.settings import load_settings

USER_TURNS = [
    "What is the capital of France?",
    "What language do people speak there?",
    "Name one famous museum in that city.",
]
AGENT = "restart-agent"
MAX_TOKENS = 16


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--first", type=int, required=True, help="first turn to run in this process")
    parser.add_argument("--last", type=int, required=True)
    parser.add_argument("--replies", default="[]", help="JSON list of earlier assistant replies")
    args = parser.parse_args()
    settings = load_settings(cache_dir=args.cache_dir, model=args.model, pool_budget_mb=512, preload_openblas=False)
    engine = build_engine(settings, load_configured_model(settings))
    engine.start()
    history = _history(json.loads(args.replies))
    try:
        for turn in range(args.first, args.last + 1):
            history.append({"role": "user", "content": USER_TURNS[turn]})
            prompt = engine.loaded.tokenizer.apply_chat_template(history, add_generation_prompt=True)
            result = run_turn(engine, GenerationRequest(AGENT, tuple(prompt), MAX_TOKENS), timeout_s=600)
            history.append({"role": "assistant", "content": result.text})
            usage = result.finish.usage
            print(json.dumps({"turn": turn, "text": result.text, "tokens": result.tokens,
                              "prompt": usage.prompt_tokens, "reused": usage.reused_tokens}), flush=True)
    finally:
        engine.stop()
    return 0


def _history(replies: list[str]) -> list[dict[str, str]]:
    history: list[dict[str, str]] = []
    for user, reply in zip(USER_TURNS, replies):
        history += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return history


if __name__ == "__main__":
    sys.exit(main())

"""One turn of one agent in a fresh process, on a cache directory another process filled.

    python -m tests.model.resume_script --cache-dir D --model M --agent A --prompt '[1, 2, 3]'

starts an engine the way the server does (a warm store on ``D/agents``,
indexed at start) and prints one JSON line: the agent's tier before the turn,
the turn's tokens and its usage. For tests of caches that cross processes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from engine.domain.event_log import EventLog
from engine.domain.requests import GenerationRequest
from engine.runtime.engine_thread.sync_client import run_turn
from engine.store.warm_store import WarmStore
from engine.store.stored_model import stored_model
from tests.model.engine_fixtures import load_folder, start_engine


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache-dir", type=Path, required=True)
    parser.add_argument("--model", type=Path, required=True, help="MLX model folder")
    parser.add_argument("--model-cache-dir", type=Path, required=True, help="where the model was imported")
    parser.add_argument("--agent", required=True)
    parser.add_argument("--prompt", required=True, help="JSON list of token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    loaded = load_folder(args.model, args.model_cache_dir)
    engine = start_engine(loaded, store=WarmStore(args.cache_dir / "agents", stored_model(loaded), 1 << 30, EventLog()))
    try:
        found = engine.fresh_snapshot().agent(args.agent)
        tier = found.tier if found is not None else None
        prompt = tuple(json.loads(args.prompt))
        result = run_turn(engine, GenerationRequest(args.agent, prompt, args.max_tokens), timeout_s=600)
        usage = result.finish.usage
        print(json.dumps({"tier": tier, "tokens": result.tokens, "prompt_tokens": usage.prompt_tokens,
                          "reused_tokens": usage.reused_tokens, "reuse_source": usage.reuse_source}), flush=True)
    finally:
        engine.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())

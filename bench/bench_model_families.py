"""Families with latent attention, layer groups of different geometry and chunked windows: semantic vs mlx_lm.server.

For each family a model folder of mlx-lm's own class with random weights
(``random_model.vary``: greedy replies that are not one repeated token) is
written at a small real shape: every layer keeps the per-token cache geometry
of the released model (latent width and rotary width for DeepSeek V3, Kimi
K2.5 and GLM-4.7-Flash; Gemma 4's 256-dim sliding and 512-dim global heads,
its window of 512 and its KV-shared layers; Llama 4's 8 KV heads of 128), with
fewer layers, fewer experts and a narrower residual stream so that a 2-core CPU
prefills a few thousand tokens in seconds. Llama 4's chunk is 1,024 tokens
instead of 8,192, so that the conversation crosses chunk boundaries.

One agent per family: a ~1,500-token system prompt and a question, then
``--turns`` warm turns adding a ~64-token tool result each, replies up to 32
tokens, greedy. Both servers load the same folder, one at a time, alternating
which goes first per repeat.

Reported per family: the warm-turn TTFT (median per run, paired by repeat),
the share of prompt tokens each server read from its cache, and the KV bytes a
token costs in each layer group: in semantic's pool (blocks held over tokens
held, from ``/v1/stats``; for window groups also the part its checkpoints
hold, the positions a later turn, fork or rewind resumes from) against
mlx-lm's own cache for the model (``make_prompt_cache`` filled with the same
number of tokens, ``nbytes``; mlx_lm.server's prompt cache keeps copies of
such caches too, not counted here).

Run: ``LD_PRELOAD=... python -m bench.bench_model_families [--families gemma4_text,llama4] [--system-tokens N]
[--peer defaults] [--quick] [--json PATH]``.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from bench.chat_stream import ChatClient, Turn
from bench.common import base_parser, print_table
from bench.comparison import cached_percent, paired, print_comparisons
from bench.peer_runs import Conversation, on_both, served_once
from bench.random_model import FAMILY_SHAPES as SHAPES
from bench.random_model import tokenizer_folder, write_family_folder
from bench.results import BenchResult
from bench.served import Batching, peer_defaults_launch, peer_launch, semantic_launch
from bench.workload_text import shared_system_prompt, tool_result

REPLY_TOKENS = 32
SYSTEM_TOKENS = 1500
TURN_TOKENS = 64
FAMILIES = ("deepseek_v3", "glm4_moe_lite", "kimi_k25", "gemma4_text", "llama4")
# Families with recurrent layers: on request (--families qwen3_5), not in the default set.
RECURRENT = ("qwen3_5",)


@dataclass(slots=True)
class Run:
    turns: list[Turn] = field(default_factory=list)
    # semantic only: /v1/stats's pool groups after the last turn, and the tokens the agent's cache then held.
    groups: list[dict[str, Any]] = field(default_factory=list)
    held_tokens: int = 0
    checkpoint_bytes: int = 0  # of the agent's bytes, its window layers' checkpoints

    @property
    def warm(self) -> list[Turn]:
        return self.turns[1:]


async def converse(client: ChatClient, tokenizer: Tokenizer, turns: int, stats: bool,
                   system_tokens: int = SYSTEM_TOKENS) -> Run:
    conversation = Conversation("family", [{"role": "system",
                                            "content": shared_system_prompt(tokenizer, system_tokens)}])
    run = Run()
    for index in range(turns + 1):
        turn = await conversation.take_turn(client, index, tool_result(tokenizer, 0, index, TURN_TOKENS),
                                            REPLY_TOKENS)
        run.turns.append(turn)
        print(f"#   turn {index} ctx {turn.prompt_tokens:5d}  TTFT {turn.ttft_s:6.3f} s  cached {turn.cached_tokens}",
              flush=True)
    if stats:
        # Only this conversation's cache: the launcher's warm-up request left an agent of its own.
        ours = f"oa-{conversation.agent}"
        for agent in (await client.get_json("/v1/stats"))["agents"]:
            if agent["agent_id"] != ours:
                await client.delete(f"/v1/agents/{agent['agent_id']}")
        for _ in range(50):  # the engine republishes its snapshot a few times a second
            snapshot = await client.get_json("/v1/stats")
            if [a["agent_id"] for a in snapshot["agents"]] == [ours]:
                break
            await asyncio.sleep(0.1)
        else:
            raise RuntimeError(f"other agents still in the pool: {[a['agent_id'] for a in snapshot['agents']]}")
        run.groups = snapshot["pool"]["groups"]
        run.checkpoint_bytes = sum(a["checkpoint_bytes"] for a in snapshot["agents"])
        last = run.turns[-1]
        run.held_tokens = last.prompt_tokens + last.completion_tokens
    return run


def mlx_lm_bytes_per_token(folder: Path, tokens: int, groups: list[dict[str, Any]]) -> dict[int, float]:
    """Per group of semantic's layers: the bytes mlx-lm's own cache for the model holds per token once
    ``tokens`` tokens went through it (prefilled in chunks of 512, as its server does)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    model, _ = load(str(folder))
    cache = make_prompt_cache(model)
    ids = mx.random.randint(0, 1000, (1, tokens))
    for start in range(0, tokens, 512):
        model(ids[:, start:start + 512], cache=cache)
        mx.eval([c.state for c in cache])
    per_layer = {i: c.nbytes for i, c in enumerate(cache)}
    return {g["index"]: sum(per_layer.get(layer, 0) for layer in g["layers"]) / tokens for g in groups}


def family_rows(result: BenchResult, kind: str, folder: Path, ours: list[Run], theirs: list[Run]) -> list[list[object]]:
    paired(result, kind, "warm-turn TTFT, median", "s", lambda r: statistics.median(t.ttft_s for t in r.warm),
           ours, theirs)
    for name, runs in (("semantic", ours), ("mlx_lm.server", theirs)):
        share = statistics.median(cached_percent(r.warm) for r in runs)
        result.metric(kind, f"{name}: prompt tokens read from cache on warm turns", share, "%")
    run = ours[0]
    theirs_bytes = mlx_lm_bytes_per_token(folder, run.held_tokens, run.groups)
    # Checkpoints are taken of every window layer at the same positions, so the window groups (here all of
    # one window and width per family) hold them in proportion to their block sizes.
    windows = [g for g in run.groups if g["kind"] != "global"]
    window_units = sum(g["block_bytes"] for g in windows) or 1
    rows = []
    for group in run.groups:
        if group["kind"] == "recurrent":
            rows.append(recurrent_row(result, kind, group, run, theirs_bytes[group["index"]] * run.held_tokens))
            continue
        ours_per_token = group["used_bytes"] / run.held_tokens
        checkpoints = run.checkpoint_bytes * group["block_bytes"] / window_units if group in windows else 0.0
        peer_per_token = theirs_bytes[group["index"]]
        result.metric(kind, f"{group['kind']} group: semantic pool bytes per token", ours_per_token, "B",
                      better="lower")
        result.metric(kind, f"{group['kind']} group: of which checkpoints", checkpoints / run.held_tokens, "B",
                      better="lower")
        result.metric(kind, f"{group['kind']} group: mlx-lm cache bytes per token", peer_per_token, "B",
                      better="lower")
        geometry = group["geometry"]
        rows.append([kind, group["kind"], len(group["layers"]),
                     f"{geometry['n_kv_heads']}x{geometry['head_dim']}/{geometry['v_head_dim']}",
                     f"{ours_per_token:,.0f}", f"{checkpoints / run.held_tokens:,.0f}", f"{peer_per_token:,.0f}"])
    return rows


def recurrent_row(result: BenchResult, kind: str, group: dict[str, Any], run: Run, peer_bytes: float) -> list[object]:
    """A recurrent group holds a state per sequence, not bytes per token: the agent's bytes (its state and the
    snapshots a later turn can resume from) against mlx-lm's one state."""
    held = group["used_bytes"]
    result.metric(kind, "recurrent group: semantic pool bytes (state and snapshots)", held, "B", better="lower")
    result.metric(kind, "recurrent group: of which snapshots", run.checkpoint_bytes, "B", better="lower")
    result.metric(kind, "recurrent group: mlx-lm cache bytes (one state)", peer_bytes, "B", better="lower")
    return [kind, "recurrent", len(group["layers"]), "state per sequence", f"{held:,.0f} (total)",
            f"{run.checkpoint_bytes:,.0f} (total)", f"{peer_bytes:,.0f} (total)"]


def check_same_prompts(kind: str, ours: list[Run], theirs: list[Run]) -> str:
    a = [t.prompt_tokens for t in ours[0].turns]
    b = [t.prompt_tokens for t in theirs[0].turns]
    if a[0] != b[0]:
        raise SystemExit(f"{kind}: the servers rendered different prompts: {a[0]} vs {b[0]} tokens")
    return f"{kind}: prompt token counts equal on both servers for {sum(x == y for x, y in zip(a, b))}/{len(a)} turns"


def main() -> None:
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES),
                        help=f"comma-separated, any of {', '.join(FAMILIES + RECURRENT)} (default: "
                             f"{', '.join(FAMILIES)})")
    parser.add_argument("--repeats", type=int, default=2, help="runs per server and family (default 2; 1 with --quick)")
    parser.add_argument("--turns", type=int, help="warm turns per run (default 4; 2 with --quick)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="weight dtype (default: bfloat16 on a GPU, float32 on the CPU)")
    parser.add_argument("--system-tokens", type=int, default=SYSTEM_TOKENS,
                        help=f"tokens of the opening system prompt (default {SYSTEM_TOKENS})")
    parser.add_argument("--peer", choices=("tuned", "defaults"), default="tuned",
                        help="tuned: mlx_lm.server with its batching set equal to semantic's (as in earlier "
                             "reports); defaults: `mlx_lm.server --model FOLDER` as users run it")
    args = parser.parse_args()
    if args.system_tokens < 1:
        parser.error("--system-tokens must be 1 or more")
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    if unknown := [f for f in families if f not in SHAPES]:
        parser.error(f"unknown family {', '.join(unknown)}; choose from {', '.join(FAMILIES + RECURRENT)}")
    import mlx.core as mx

    dtype = args.dtype or ("bfloat16" if mx.default_device().type == mx.DeviceType.gpu else "float32")
    repeats = 1 if args.quick and args.repeats == 2 else args.repeats
    turns = args.turns or (2 if args.quick else 4)
    tokenizer_dir = tokenizer_folder(args.model, args.cache_dir)
    tokenizer = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    result = BenchResult("bench_model_families", "Latent, multi-geometry and chunked families (vs mlx_lm.server)",
                         args={"families": families, "quick": args.quick, "repeats": repeats, "turns": turns,
                               "dtype": dtype, "system_tokens": args.system_tokens, "peer": args.peer, "turn_tokens": TURN_TOKENS,
                               "reply_tokens": REPLY_TOKENS, "shapes": {f: SHAPES[f] for f in families}})
    started = time.perf_counter()
    rows: list[list[object]] = []
    with tempfile.TemporaryDirectory(prefix="bench-families-") as work:
        for kind in families:
            t0 = time.perf_counter()
            folder = write_family_folder(kind, Path(work) / kind, tokenizer_dir, dtype)
            print(f"# {kind}: wrote {folder} ({dtype}) in {time.perf_counter() - t0:.1f} s", flush=True)
            batching = Batching()
            peer = peer_defaults_launch(folder) if args.peer == "defaults" else peer_launch(folder, batching,
                                                                                             cache_entries=10)
            launches = (semantic_launch(folder, Path(work) / f"{kind}-state", args.pool_mb, batching), peer)

            def run(launch, kind=kind) -> Run:
                async def work_fn(client: ChatClient) -> Run:
                    return await converse(client, tokenizer, turns, stats=launch.sends_session_id,
                                          system_tokens=args.system_tokens)
                return served_once(launch, Path(work), work_fn)

            ours, theirs = on_both(launches, repeats, run)
            note = check_same_prompts(kind, ours, theirs)
            print(f"# {note}")
            result.notes.append(note)
            rows += family_rows(result, kind, folder, ours, theirs)
    print_comparisons(result.comparisons)
    print_table(["family", "group", "layers", "heads x K/V dims", "semantic B/token", "of which checkpoints",
                 "mlx-lm B/token"], rows)
    for m in result.metrics:
        if m.unit == "%":
            print(f"{m.group}: {m.name} = {m.value:.1f} %")
    result.duration_s = time.perf_counter() - started
    result.write(args.json)


if __name__ == "__main__":
    main()

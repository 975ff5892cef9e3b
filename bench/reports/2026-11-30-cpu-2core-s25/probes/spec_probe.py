"""semantic only: copy (and free) workloads at 1 and N agents, speculation on (env max draft) vs off."""
import asyncio, sys, tempfile, time, os
from dataclasses import replace
from pathlib import Path
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[4]) + "/bench")
from tokenizers import Tokenizer
from bench_speculation import SOURCES, copy_request, decode_tok_s, tally, _all
from bench_vs_mlx_lm_server import model_folder
from served import Batching, semantic_launch, serving
from workload_text import story_request
folder = model_folder("smollm2-135m", Path("/tmp/dbg/mc"))
tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
levels = [int(x) for x in os.environ.get("LEVELS", "1,8").split(",")]
wl = {"copy": ([copy_request(tok, p) for p in SOURCES], int(os.environ.get("COPY", 640)))}
if os.environ.get("ONLYFREE"): wl = {}
if os.environ.get("FREE") or os.environ.get("ONLYFREE"):
    wl["free"] = ([story_request(len(SOURCES), i) for i in range(len(SOURCES))], 256)
arms = os.environ.get("ARMS", "on,off").split(",")
with tempfile.TemporaryDirectory() as work:
    work = Path(work)
    for rep in range(int(os.environ.get("REPS", 1))):
        for arm in (arms if rep % 2 == 0 else arms[::-1]):
            launch = semantic_launch(folder, work / f"state-{arm}-{rep}", 2048.0, Batching())
            if arm == "off":
                launch = replace(launch, argv=(*launch.argv, "--speculate", "off"))
            elif arm.startswith("k"):
                launch = replace(launch, argv=(*launch.argv, "--speculate-max-draft", arm[1:]))
            with serving(launch, work) as url:
                res = asyncio.run(_all(url, launch, wl, levels, rep))
            for w, by in res.items():
                for n, turns in by.items():
                    t = tally(turns)
                    print(f"{arm:4} {w} {n} agents: {decode_tok_s(turns):.1f} tok/s acc {t['acceptance']:.2f} tps {t['tokens_per_step']:.2f} tokens {sum(x.completion_tokens for x in turns)}", flush=True)

"""The multi-turn hybrid workload (bench_vs_mlx_lm_server.py's, full size) against semantic only: per-turn TTFT
means and the wall time, to compare two commits of semantic in one sitting (run from each checkout)."""
import sys, tempfile, time
from dataclasses import replace
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from tokenizers import Tokenizer  # noqa: E402
import bench_vs_mlx_lm_server as b  # noqa: E402
from peer_runs import Outcome, served_once  # noqa: E402
from results import BenchResult  # noqa: E402
from served import Batching  # noqa: E402

folder = Path(sys.argv[1])
with tempfile.TemporaryDirectory() as work:
    bench = b.Bench(folder, Tokenizer.from_file(str(folder / "tokenizer.json")), Batching(), None, Path(work),
                    replace(b.FULL, repeats=1), BenchResult("probe", "probe", args={}))
    ours, _, _ = b._conversation_launches(bench, "multiturn", persist=False)
    script = b.AgentScript(bench)

    async def work_(client):
        t0 = time.perf_counter()
        turns = await script.turns(client, script.conversations(), range(bench.sizes.turns))
        return Outcome(turns, time.perf_counter() - t0)

    outcome = served_once(ours, Path(work), work_)
    by_turn = {}
    for t in outcome.turns:
        by_turn.setdefault(t.index, []).append(t.ttft_s)
    print(f"{ROOT.name}: wall {outcome.wall_s:.1f} s; TTFT mean per turn " +
          " / ".join(f"{sum(v) / len(v):.2f}" for _, v in sorted(by_turn.items())), flush=True)

"""CPU of each rank of an idle two-rank server started by hand over MLX's ring backend (tiny llama at
/tmp/cx/llama-tiny from bench/random_model.py --shape llama-tiny), over 30 s; then the time of a small
completion right after another one, and after 10 s idle (what the idle pause between ticks costs a first
request). Run: python idle_ranks.py SCRATCH_CACHE_DIR."""
import statistics, sys, time
from pathlib import Path

import httpx
import psutil

sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
from tests.support.distributed_run import launch_by_hand, wait_ranks_ready

model = Path("/tmp/cx/llama-tiny")
ranks, url = launch_by_hand(model, Path(sys.argv[1]), [[], []])
body = {"model": "m", "max_tokens": 4, "temperature": 0, "messages": [{"role": "user", "content": "hi"}]}
try:
    wait_ranks_ready(ranks, url)
    time.sleep(3)
    procs = [psutil.Process(r.process.pid) for r in ranks]
    before = [p.cpu_times() for p in procs]
    t0 = time.monotonic(); time.sleep(30); dt = time.monotonic() - t0
    after = [p.cpu_times() for p in procs]
    for i, (a, b) in enumerate(zip(before, after)):
        print(f"idle 30 s: rank {i}: {((b.user + b.system) - (a.user + a.system)) / dt:.3f} cores")
    with httpx.Client(base_url=url, timeout=60) as client:
        def timed() -> float:
            start = time.monotonic()
            assert client.post("/v1/chat/completions", json=body).status_code == 200
            return time.monotonic() - start
        busy = [timed() for _ in range(5)]
        idle = []
        for _ in range(5):
            time.sleep(10)
            idle.append(timed())
    print(f"4-token completion, back to back: median {statistics.median(busy) * 1000:.0f} ms {[round(x * 1000) for x in busy]}")
    print(f"4-token completion after 10 s idle: median {statistics.median(idle) * 1000:.0f} ms {[round(x * 1000) for x in idle]}")
finally:
    for r in ranks:
        r.process.terminate()
    for r in ranks:
        try:
            r.process.wait(30)
        except Exception:
            r.process.kill()

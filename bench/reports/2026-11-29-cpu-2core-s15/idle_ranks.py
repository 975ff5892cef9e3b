"""CPU of each rank of an idle two-rank server started by hand (tiny llama at /tmp/cx/llama-tiny from bench/random_model.py --shape llama-tiny), over 20 s. Run: python idle_ranks.py SCRATCH_CACHE_DIR."""
import json, os, subprocess, sys, time, socket
import psutil
sys.path.insert(0, str(__import__('pathlib').Path(__file__).resolve().parents[3]))
from tests.support.distributed_run import launch_by_hand, wait_ranks_ready
from pathlib import Path
model = Path("/tmp/cx/llama-tiny")
ranks, url = launch_by_hand(model, Path(sys.argv[1]), [[], []])
try:
    wait_ranks_ready(ranks, url)
    time.sleep(3)
    procs = [psutil.Process(r.process.pid) for r in ranks]
    before = [p.cpu_times() for p in procs]
    t0 = time.monotonic(); time.sleep(20); dt = time.monotonic() - t0
    after = [p.cpu_times() for p in procs]
    for i, (a, b) in enumerate(zip(before, after)):
        print(f"rank {i}: {((b.user + b.system) - (a.user + a.system)) / dt:.3f} cores")
finally:
    for r in ranks:
        r.process.terminate()
    for r in ranks:
        try: r.process.wait(30)
        except Exception: r.process.kill()

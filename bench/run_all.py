"""Run every benchmark in turn (``make bench``; ``make bench ARGS=--quick`` for a smoke run).

Benchmarks run one after another, never together: they share two CPU cores
and each one's numbers assume the machine is otherwise quiet.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORDER = (
    "bench_block_pool.py",
    "bench_engine.py",
    "bench_cache_store.py",
    "bench_swap.py",
    "bench_vs_mlx_lm_server.py",
    "bench_ui_overhead.py",
)


def main() -> int:
    extra = sys.argv[1:]
    failed = []
    for name in ORDER:
        script = HERE / name
        if not script.is_file():
            continue
        args = [] if name == "bench_block_pool.py" else extra
        print(f"\n# ===== {name} {' '.join(args)}", flush=True)
        start = time.perf_counter()
        code = subprocess.call([sys.executable, str(script), *args], cwd=HERE.parent)
        print(f"# ===== {name}: exit {code} after {time.perf_counter() - start:.0f} s", flush=True)
        if code != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

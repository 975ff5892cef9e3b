"""``semantic doctor``: is this machine set up to run models at speed?

It reports the compute backend MLX uses, the BLAS under its CPU matmul, the
threading layer of numba (the CPU backend's compiled loops), and a measured
matmul rate against what that backend should reach. The one problem it finds
on a fresh Linux box is MLX's bundled reference BLAS (about 30x slower than
OpenBLAS): a 12K-token prefill that should take about a minute takes over
seven. It prints the exact command that fixes it and exits 1 while it stands.
"""

from __future__ import annotations

import time

from rich.console import Console

from engine.platform import blas_report, install_command, slow_blas
from engine.settings import Settings

# A float32 matmul of this size: big enough to be BLAS-bound, small enough to time in a second.
MATMUL_N = 1024
# Below this, MLX's CPU matmul runs on the bundled reference BLAS or something as slow (it measures about
# 6 GFLOP/s; OpenBLAS on this project's 2-core CI box about 60-100).
SLOW_GFLOPS = 20.0


def matmul_gflops(n: int = MATMUL_N, repeats: int = 5) -> float:
    import mlx.core as mx

    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a @ b)  # warm-up: kernels, threads
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - started)
    return 2 * n**3 / min(times) / 1e9


def numba_threading() -> str:
    try:
        import numba
    except ImportError:
        return "numba not installed (the CPU backend's compiled loops are off)"
    return f"numba {numba.__version__}, threading layer {numba.config.THREADING_LAYER!r}, {numba.config.NUMBA_NUM_THREADS} threads"


def doctor(settings: Settings) -> int:
    console = Console(highlight=False)
    report = blas_report()
    console.print(f"backend      {report['backend']}")
    library = f" ({report['library']}, via {report['source']})" if report["library"] else f" ({report['source']})"
    console.print(f"BLAS         {report['blas']}{library}")
    if report["backend"] == "cpu":
        console.print(f"compiled     {numba_threading()}")
    rate = matmul_gflops()
    console.print(f"matmul       {rate:.1f} GFLOP/s (float32, {MATMUL_N}x{MATMUL_N})")
    slow = slow_blas() or (report["backend"] == "cpu" and rate < SLOW_GFLOPS)
    if slow:
        console.print(f"[bold red]slow BLAS[/]: MLX's CPU matmul runs at {rate:.1f} GFLOP/s; OpenBLAS should give "
                      f"over {SLOW_GFLOPS:.0f}. Fix: [bold]{install_command()}[/] (semantic preloads it by itself "
                      f"once installed{'' if settings.preload_openblas else '; preload_openblas is off in your settings'})")
        return 1
    console.print("[green]ok[/]: models run at this machine's speed")
    return 0

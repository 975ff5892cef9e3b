"""How many ranks of an ``mlx.launch`` run share this host, read from the launch environment alone.

Several ranks on one Linux box (a test run, a big machine) each preload
OpenBLAS, whose threads default to one per core: two ranks on two cores then
run four spinning BLAS threads. Two ranks against one process measured 0.27x
that way and 0.42x with a thread per rank (``python -m bench.bench_distributed``,
Llama-3.2-1B shape, the 2-core CPU box). The engine's own compiled
loops (numba: the decode step's linear pass and attention) take the same
share. No mlx import here: the
OpenBLAS re-exec decides before MLX is loaded.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping
from pathlib import Path


def local_ranks(environ: Mapping[str, str]) -> int:
    """Ranks on this rank's host per the ring hostfile (``[["ip:port", ...], ...]``); 1 when unknown."""
    path, rank = environ.get("MLX_HOSTFILE"), environ.get("MLX_RANK")
    if not path or rank is None:
        return 1
    try:
        hosts = json.loads(Path(path).read_text())
        ips = [entry[0].rsplit(":", 1)[0] for entry in hosts]
        return max(1, ips.count(ips[int(rank)]))
    except (OSError, ValueError, TypeError, IndexError, KeyError, AttributeError):
        return 1  # another backend's hostfile (JACCL, MPI): leave OpenBLAS's own choice


def cores_per_rank(environ: Mapping[str, str], cores: int | None = None) -> int:
    """This rank's share of the host's cores: all of them unless ranks of one run share the host."""
    return max(1, (cores or os.cpu_count() or 1) // local_ranks(environ))


@functools.cache
def process_cores() -> int:
    """This process's share of the host's cores (:func:`cores_per_rank` of its environment, read once)."""
    return cores_per_rank(os.environ)


def blas_threads(environ: Mapping[str, str], cores: int | None = None) -> int | None:
    """OpenBLAS threads for this rank when ranks share the host and the user set none; else None."""
    if "OPENBLAS_NUM_THREADS" in environ or local_ranks(environ) <= 1:
        return None
    return cores_per_rank(environ, cores)

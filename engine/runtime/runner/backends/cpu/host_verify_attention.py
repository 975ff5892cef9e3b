"""A speculative step's attention on the host, or a prompt chunk's that rides a decode step: each sequence's
tokens over its cache together, through BLAS.

A verification feeds each sequence its last token and its drafts, each a
query at its own position that sees the sequence's cache up to itself; a
prompt chunk carried by a decode step (``CpuBackend.carries_prompts``) is
the same shape, wider, and is split into runs of tokens one a thread.
``host_decode``'s loops take one query row at a time: dot products of 64
floats, each summed across a vector register, then a scalar ``exp`` per
score, ~350 us a token and layer over 1,000 keys on SmolLM2, so 8 tokens
cost 8 times one (47 of a 136 ms pass; measured on the 2-core CPU box).
Here a sequence's queries go together, per key head: one product of all
its queries (tokens times the query heads sharing that key head) with the
keys, one softmax per query cut at its own position (``softmax_kernel``'s
rows: MLX's ``exp``), one product with the values. BLAS reads each key and
value once for all of them: 8 tokens over 1,000 keys take ~0.5 ms a layer,
~66 us a token.

The products run on the calling thread (``threadpoolctl`` holds numpy's and
MLX's OpenBLAS to one thread while they run): OpenBLAS's threads keep
spinning on the cores for a while after each call, and the step's linear
layers then run numba's threads on the same two cores. Measured on
SmolLM2, one agent, a pass of 8 tokens: 94-105 ms this way, 1,123 ms with
OpenBLAS's threads (a pass of 4 tokens: its linear layers took 778 ms
instead of 48).

The step's own keys and values are written first, into the positions the
sequence claimed (``HostFullKV.claim_one``: never written before, so no
view shows them), through numpy's view of the cache's buffer.

Only for sequences feeding several tokens: a plain decode step's rows (one token a sequence) keep
``host_decode``'s loops, so turns without speculation compute what they
did. Sums are BLAS's and the ``exp`` is MLX's polynomial where the loops
use the C library's: the tokens' logits differ from a plain step's in the
last bits, as batching already makes them; the real-model tests hold
greedy outputs with and without speculation identical.
"""

from __future__ import annotations

from concurrent.futures import Executor
from contextlib import AbstractContextManager
from typing import Any, Sequence

import numpy as np

from engine.runtime.runner.backends.cpu.host_decode import PartArrays, run_shares, thread_shares, worker_count


def attend_groups(scaled: np.ndarray, parts_per_row: Sequence[Sequence[PartArrays]], new_keys: np.ndarray,
                  new_values: np.ndarray, claimed: Sequence[int], widths: Sequence[int],
                  workers: Executor | None = None) -> np.ndarray:
    """Each group of ``widths[g]`` consecutive rows (one sequence's tokens, in order) over its keys.

    ``scaled`` (rows, heads, dim): the queries times the scale; ``parts_per_row``: each row's parts
    (``host_decode.host_parts``: shared segments, then its own arrays up to and including its position);
    ``new_keys``, ``new_values`` (rows, kv_heads, dim): the rows' own keys and values, written at
    ``claimed[r]`` in the own arrays of the group's parts (consecutive positions, one per row) before any
    row attends; ``workers``: threads that take a share of the groups (numpy and the softmax release the
    GIL). Returns (rows, heads, v_dim).
    """
    rows, heads, _ = scaled.shape
    kv_heads = new_keys.shape[1]
    out = np.empty((rows, heads, new_values.shape[-1]), dtype=np.float32)
    starts = np.cumsum([0, *widths])
    groups = [(int(starts[g]), int(starts[g + 1])) for g in range(len(widths))]
    for first, end in groups:  # every group's keys before any attends: a piece of a group reads the whole group's
        _write_own(parts_per_row[end - 1][-1], new_keys[first:end], new_values[first:end], claimed[first:end])
    threads = 1 if workers is None else worker_count()
    pieces = [piece for first, end in groups for piece in _pieces(first, end, threads)]

    def run(share: list[tuple[int, int]]) -> None:
        for first, end in share:
            # The piece's last token's parts: every key any of its tokens sees.
            out[first:end] = _attend_group(scaled[first:end], parts_per_row[end - 1], kv_heads)

    keys = [(end - first) * sum(n for _, _, n in parts_per_row[end - 1]) for first, end in pieces]
    shares = [[pieces[p] for p in chunk] for chunk in thread_shares(keys, threads)]
    with one_blas_thread():
        run_shares(run, shares, workers)
    return out


def _pieces(first: int, end: int, threads: int) -> list[tuple[int, int]]:
    """A group's tokens in runs that attend apart: a wide one (a prompt chunk riding a decode step) in one run a
    thread, so that both cores share it (a run's tokens see about as many keys as another's); a verification's
    few tokens whole."""
    width = end - first
    if threads == 1 or width < SPLIT_TOKENS:
        return [(first, end)]
    cuts = [first + width * t // threads for t in range(threads + 1)]
    return list(zip(cuts, cuts[1:]))


# Tokens of one group from which its attention is split across threads (a verification's drafts stay whole).
SPLIT_TOKENS = 16

_blas: Any = None  # threadpoolctl's handle on the BLAS libraries loaded in this process (found once)


def one_blas_thread() -> AbstractContextManager[Any]:
    """While inside: every loaded BLAS runs on its caller's thread alone (~12 us to enter and leave)."""
    global _blas
    if _blas is None:
        from threadpoolctl import ThreadpoolController

        _blas = ThreadpoolController().select(user_api="blas")
    return _blas.limit(limits=1)


def _write_own(own: PartArrays, keys: np.ndarray, values: np.ndarray, positions: Sequence[int]) -> None:
    """The group's keys and values (width, kv_heads, dim) into their claimed positions of the own arrays."""
    first = positions[0]
    if list(positions) != list(range(first, first + len(positions))):
        raise RuntimeError("a verification's positions are not consecutive")
    for array, new in ((own[0], keys), (own[1], values)):
        host = np.asarray(array)
        if not (host.flags.c_contiguous and host.flags.writeable and host.dtype == np.float32):
            raise RuntimeError("a claimed verification position's cache is not one writable float32 buffer")
        host[0, :, first:first + len(positions), :] = new.transpose(1, 0, 2)


def _attend_group(scaled: np.ndarray, parts: Sequence[PartArrays], kv_heads: int) -> np.ndarray:
    """One sequence's ``width`` queries (width, heads, dim) over its parts; token ``j`` sees every key but the
    group's last ``width - 1 - j``."""
    width, heads, dim = scaled.shape
    repeats = heads // kv_heads
    queries = width * repeats
    # (kv_heads, token x repeat, dim): the queries of each key head, token after token.
    q = np.ascontiguousarray(scaled.reshape(width, kv_heads, repeats, dim).transpose(1, 0, 2, 3)).reshape(
        kv_heads, queries, dim)
    keys = [np.asarray(k)[0, :, :n, :] for k, _, n in parts]
    scores = [np.matmul(q, part.transpose(0, 2, 1)) for part in keys]
    weights = scores[0] if len(scores) == 1 else np.concatenate(scores, axis=-1)
    total = weights.shape[-1]
    from engine.runtime.runner.backends.cpu.softmax_kernel import softmax_rows_here  # (numba: CPU only)

    seen = np.repeat(np.arange(total - width + 1, total + 1, dtype=np.int64), repeats)
    softmax_rows_here(weights.reshape(kv_heads * queries, total), np.tile(seen, kv_heads))
    columns = np.cumsum([0, *(n for _, _, n in parts)])
    out = sum(np.matmul(weights[:, :, columns[i]:columns[i + 1]], np.asarray(v)[0, :, :n, :])
              for i, (_, v, n) in enumerate(parts))
    v_dim = out.shape[-1]
    return out.reshape(kv_heads, width, repeats, v_dim).transpose(1, 0, 2, 3).reshape(width, heads, v_dim)

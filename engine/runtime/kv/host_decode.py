"""A decode batch's attention on the CPU, computed with numpy over the rows' own caches.

In a decode step every row attends with one query to its own cache, so a
batch of 16 rows on a 30-layer model makes 480 small attention calls. MLX's
CPU backend pays ~7-50 us per operation of such a call (a grouped
3 x (3x64 @ 64x200) matmul: 35 us; a softmax over 1,800 scores: 48 us), far
more than its arithmetic, and one call takes ~6 of them. numpy does the same
arithmetic on the same memory (a ``memoryview`` of an evaluated MLX array is
not a copy) at ~1-2 us per call: measured on 16 rows x 30 layers, 27 ms a
step against MLX's 70 ms at 200 tokens of context, 113 against 165 ms at
1,000 (``bench/bench_forward_split.py``).

The price is one ``mx.eval`` per layer (the queries and the rows' updated
caches must exist before numpy reads them), so this runs only where it pays:
on the CPU, inside the engine's forward (``cpu_math.routing``), for float32
decode batches of more than one row without attention sinks (masks: none, or
one boolean per key, as a sliding-window layer's ring makes).
The arithmetic is MLX's unfused attention's (scaled queries, one float32
softmax over all scores); the real-model tests hold greedy outputs
token-identical to mlx-lm's.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import mlx.core as mx
import numpy as np

# Turned off to compare (bench/bench_forward_split.py) and by --no-fast-cpu-math (through routing()).
enabled = True
# Keys in a batch from which rows are split across threads (see _chunks), and the most threads.
PARALLEL_MIN_KEYS = 4096
MAX_WORKERS = 8


def applies(queries: mx.array, parts_per_row: Sequence[Sequence[tuple[mx.array, mx.array]]], masks: Sequence[Any],
            sinks: Any) -> bool:
    """Whether :func:`attend` computes this batch: one float32 query per row, no sinks, masks it can apply."""
    return (enabled and sinks is None and len(parts_per_row) > 1 and queries.shape[2] == 1
            and queries.dtype == mx.float32 and parts_per_row[0][-1][0].dtype == mx.float32
            and all(m is None or isinstance(m, str) or _key_mask(m, sum(k.shape[2] for k, _ in parts))
                    for m, parts in zip(masks, parts_per_row)))


def _key_mask(mask: Any, keys: int) -> bool:
    """A boolean mask with one entry per key (a window layer's ring longer than its window)."""
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.size == keys


def attend(queries: mx.array, parts_per_row: Sequence[Sequence[tuple[mx.array, mx.array]]],
           scale: float, masks: Sequence[Any]) -> mx.array:
    """Row ``b``'s query (``queries[b]``: heads x 1 x dim) over its keys and values, given in consecutive parts.

    A part is a (1, kv_heads, length, dim) pair: shared prefix segments, then
    the row's own cache. A row's mask is None or "causal" (one query at the
    last position sees every key) or a boolean per key (False: hidden).
    """
    key_masks = [m if isinstance(m, mx.array) else None for m in masks]
    mx.eval(queries, [a for parts in parts_per_row for pair in parts for a in pair], [m for m in key_masks if m is not None])
    scaled = np.asarray(queries) * np.float32(scale)
    batch, heads, _, _ = scaled.shape
    v_dim = parts_per_row[0][0][1].shape[-1]
    out = np.empty((batch, heads, 1, v_dim), dtype=np.float32)
    rows = [[(np.asarray(k)[0], np.asarray(v)[0]) for k, v in parts] for parts in parts_per_row]
    hidden = [None if m is None else ~np.asarray(m).reshape(-1) for m in key_masks]
    chunks = _chunks([sum(k.shape[1] for k, _ in parts) for parts in rows])
    if len(chunks) == 1:
        _attend_rows(scaled, rows, hidden, out, range(batch))
    else:
        pending = [_workers().submit(_attend_rows, scaled, rows, hidden, out, chunk) for chunk in chunks[1:]]
        _attend_rows(scaled, rows, hidden, out, chunks[0])
        for future in pending:
            future.result()
    return mx.array(out)


def _attend_rows(scaled: np.ndarray, rows: list[list[tuple[np.ndarray, np.ndarray]]],
                 hidden: list[np.ndarray | None], out: np.ndarray, which: Sequence[int]) -> None:
    heads, dim = scaled.shape[1], scaled.shape[3]
    for b in which:
        parts = rows[b]
        kv_heads = parts[0][0].shape[0]
        q = scaled[b, :, 0, :].reshape(kv_heads, heads // kv_heads, dim)
        scores = q @ parts[0][0].transpose(0, 2, 1) if len(parts) == 1 else np.concatenate(
            [q @ k.transpose(0, 2, 1) for k, _ in parts], axis=-1)
        if hidden[b] is not None:
            scores[..., hidden[b]] = np.finfo(np.float32).min  # as MLX's mx.where(mask, scores, min)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        scores /= scores.sum(axis=-1, keepdims=True)
        row = None
        start = 0
        for _, values in parts:
            piece = scores[..., start:start + values.shape[1]] @ values
            row = piece if row is None else row + piece
            start += values.shape[1]
        out[b, :, 0, :] = row.reshape(heads, -1)


def _chunks(keys_per_row: list[int]) -> list[list[int]]:
    """Rows split into consecutive groups of about equal keys, one per worker; one group for short rows.

    numpy's matmul and ufuncs release the GIL, so threads read the rows'
    caches in parallel: on 2 cores, 16 rows x 1,000 keys x 30 layers took
    62 ms a step against 111 ms on one thread. Under ~256 keys a row the
    calls are too short to gain (24 against 26 ms at 200).
    """
    total = sum(keys_per_row)
    workers = _worker_count()
    if workers == 1 or total < PARALLEL_MIN_KEYS:
        return [list(range(len(keys_per_row)))]
    share = total / workers
    chunks: list[list[int]] = [[]]
    held = 0
    for b, keys in enumerate(keys_per_row):
        if held + keys / 2 > share * len(chunks) and len(chunks) < workers and chunks[-1]:
            chunks.append([])
        chunks[-1].append(b)
        held += keys
    return [c for c in chunks if c]


def _worker_count() -> int:
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _workers() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_worker_count() - 1, thread_name_prefix="semantic-attention")
        return _pool

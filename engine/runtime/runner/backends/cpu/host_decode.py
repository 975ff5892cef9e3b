"""A decode batch's attention on the CPU, in compiled loops over the rows' own caches.

In a decode step every row attends with one query to its own cache, so a
batch of 16 rows on a 30-layer model makes 480 small attention calls. MLX's
CPU backend pays ~7-50 us per operation of such a call (a grouped
3 x (3x64 @ 64x200) matmul: 35 us; a softmax over 1,800 scores: 48 us), far
more than its arithmetic, and one call takes ~6 of them: 70 ms a step at
200 tokens of context, 165 ms at 1,000. This hands the whole batch of one
layer to one compiled call (``host_kernels.batch_rows``, numba) that reads
each row's cache where it lies: an evaluated MLX array gives numpy its own
buffer, and the call gets its address. Measured on 16 rows x 30 layers,
2 cores: 19 ms a step at 200 tokens, 54 ms at 1,000, where the rows' keys
and values (737 MB a step) are read at ~14 GB/s.

The price is one ``mx.eval`` per layer (the queries and the rows' updated
caches must exist before the loops read them), so this runs only where it
pays: in the CPU backend's decode batches (``host_kv.HostRaggedLayerCache``),
float32 ones of more than one row without attention sinks (masks:
none, or one boolean per key, as a sliding-window layer's ring makes). The
arithmetic is MLX's unfused attention's (scaled queries, one float32
softmax over all scores); the real-model tests hold greedy outputs
token-identical to mlx-lm's.

A Llama-family decode step that runs whole on the host
(``host_forward.py``) calls :func:`attend_host` directly, with its
queries, keys and values already in numpy: no evaluation at all.

The loops also write the step's own key and value into each row's cache
before the row attends, where ``FullKV.claim_one`` allowed it (a position
never written in those arrays, so no view can show it): through MLX that is
two slice updates a row and layer, ~2,000 small operations a step at 16
rows x 30 layers.
"""

from __future__ import annotations

import logging
from concurrent.futures import Executor
from typing import Any, Callable, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from engine.distributed.local_ranks import process_cores
from engine.runtime.runner.kv.full_kv import length_of

log = logging.getLogger("semantic.engine")

# (keys, values, length): the first ``length`` positions of (1, kv_heads, capacity, dim) arrays (or of packed
# K/V's three arrays each: host_packed_decode.py).
PartArrays = Tuple[mx.array, mx.array, int]
# A decode step's new keys, values (batch, kv_heads, 1, dim), and per row the own position to write them to.
NewPositions = Tuple[mx.array, mx.array, Sequence[Optional[int]]]

# Keys in a batch from which rows are split across threads (see thread_shares), and the most threads.
PARALLEL_MIN_KEYS = 2048
MAX_WORKERS = 8


def warm_up() -> None:
    """Load the compiled loops (compile them, the first run after an install); raises where they cannot load.

    Importing numba and loading its cache takes ~0.4 s; the CPU backend runs
    this in the background when it attaches a model, so the first batch of
    several rows does not wait for it.
    """
    from engine.runtime.runner.backends.cpu import host_kernels
    from engine.runtime.runner.backends.cpu.softmax_kernel import softmax_rows_here  # (verifications' and chunks')
    from engine.runtime.runner.backends.cpu.top_k_kernel import top_k_rows  # (sampling's: same compiler)

    alive: list[np.ndarray] = []
    q = np.zeros((2, 2, 4), dtype=np.float32)
    cache = np.ones((1, 8, 4), dtype=np.float32)
    table = np.array([[address_of(cache, alive), 32, address_of(cache, alive), 32, 8]] * 2, dtype=np.int64)
    out = np.empty((2, 2, 4), dtype=np.float32)
    writes = np.ones(2, dtype=np.int64)
    host_kernels.batch_rows(q, table, np.array([0, 1, 2]), np.zeros(2, dtype=np.int64), 1, out, 0, 2,
                            np.zeros((2, 1, 4), dtype=np.float32), np.zeros((2, 1, 4), dtype=np.float32), writes)
    top_k_rows(np.zeros((1, 4), dtype=np.float32), 2, np.empty((1, 2), dtype=np.int64))
    softmax_rows_here(np.zeros((2, 4), dtype=np.float32), np.array([4, 1], dtype=np.int64))


def worker_count() -> int:
    """Threads a batch's rows are split across: this process's cores (ranks sharing a host split them), up to 8."""
    return min(MAX_WORKERS, process_cores())


def applies(queries: mx.array, parts_per_row: Sequence[Sequence[PartArrays]], masks: Sequence[Any],
            sinks: Any) -> bool:
    """Whether :func:`attend` computes this batch: one float32 query per row, no sinks, masks it can apply."""
    return (sinks is None and len(parts_per_row) > 1 and queries.shape[2] == 1 and queries.dtype == mx.float32
            and all(isinstance(parts[-1][0], mx.array) for parts in parts_per_row)
            and parts_per_row[0][-1][0].dtype == mx.float32
            and masks_apply(masks, parts_per_row))


def masks_apply(masks: Sequence[Any], parts_per_row: Sequence[Sequence[PartArrays]]) -> bool:
    """Whether the loops can apply every row's mask: none, causal, or a boolean per key."""
    return all(m is None or isinstance(m, str) or _key_mask(m, sum(n for _, _, n in parts))
               for m, parts in zip(masks, parts_per_row))


def host_parts(row: Any, held: int) -> list[PartArrays]:
    """A row's parts: its shared segments (a full-attention layer's), then the first ``held`` positions of
    its own arrays."""
    return [*((k, v, length_of(k)) for k, v in getattr(row, "prefix", ())), (row.keys, row.values, held)]


def may_write(keys: mx.array, rows: int) -> bool:
    """Whether a decode step's new keys (batch x kv_heads x 1 x dim) may be left for :func:`attend` to write:
    it will run for them if the layer's queries and masks let it (``applies``; else the caller writes them)."""
    return rows > 1 and keys.dtype == mx.float32


def _key_mask(mask: Any, keys: int) -> bool:
    """A boolean mask with one entry per key (a window layer's ring longer than its window)."""
    return isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.size == keys


def attend(queries: mx.array, parts_per_row: Sequence[Sequence[PartArrays]], scale: float,
           masks: Sequence[Any], new: NewPositions | None = None, workers: Executor | None = None) -> mx.array:
    """Row ``b``'s query (``queries[b]``: heads x 1 x dim) over its keys and values, given in consecutive parts.

    A part is (keys, values, length): (1, kv_heads, capacity, dim) arrays
    whose first ``length`` positions it holds (shared prefix segments, then
    the row's own cache). A row's mask is None or "causal" (one query at the
    last position sees every key) or a boolean per key (False: hidden).

    ``new``: the step's keys and values (batch x kv_heads x 1 x dim) and,
    per row, None or the own position they go to (the last key of the row's
    last part), which the loops write in place before the row attends; the
    row's own arrays must then be their own memory (``HostFullKV.claim_one``).
    ``workers``: threads that take groups of rows (None: this thread alone).
    """
    key_masks = [m if isinstance(m, mx.array) else None for m in masks]
    mx.eval(queries, [(k, v) for parts in parts_per_row for k, v, _ in parts],
            [m for m in key_masks if m is not None], new[:2] if new is not None else [])
    scaled = np.asarray(queries)[:, :, 0, :] * np.float32(scale)
    if new is not None:
        new_keys, new_values, claimed = _rows(new[0]), _rows(new[1]), new[2]
    else:
        new_keys = new_values = None
        claimed = ()
    hidden = [None if m is None else np.asarray(m) for m in key_masks]
    out = attend_host(scaled, parts_per_row, new_keys, new_values, claimed, hidden, workers)
    return mx.array(out[:, :, None, :])


def attend_host(scaled: np.ndarray, parts_per_row: Sequence[Sequence[PartArrays]], new_keys: np.ndarray | None,
                new_values: np.ndarray | None, claimed: Sequence[Optional[int]],
                hidden: Sequence[np.ndarray | None] | None = None, workers: Executor | None = None) -> np.ndarray:
    """:func:`attend` on host arrays: ``scaled`` (batch, heads, dim) queries already times the scale; ``new_keys``
    and ``new_values`` (batch, kv_heads, dim) and ``claimed`` as ``new`` there; ``hidden``: per row None or a
    boolean per key (False: hidden). The parts' arrays must be evaluated. Returns (batch, heads, v_dim)."""
    from engine.runtime.runner.backends.cpu import host_kernels

    scaled = np.ascontiguousarray(scaled, dtype=np.float32)
    batch, heads, _ = scaled.shape
    kv_heads = parts_per_row[0][0][0].shape[1]
    out = np.empty((batch, heads, parts_per_row[0][0][1].shape[-1]), dtype=np.float32)
    alive: list[np.ndarray] = []  # every buffer whose address the table holds, until the kernels return
    table = np.empty((sum(len(parts) for parts in parts_per_row), host_kernels.PART_COLUMNS), dtype=np.int64)
    row_parts = np.zeros(batch + 1, dtype=np.int64)
    writes = np.zeros(batch, dtype=np.int64)
    for b, at in enumerate(claimed):
        if at is not None:
            assert parts_per_row[b][-1][2] == at + 1, "a claimed position is the last key of its row"
            writes[b] = 1
    if writes.any():  # (the loops read them as (batch, kv_heads, dim) float32 runs)
        new_keys = np.ascontiguousarray(new_keys, dtype=np.float32)
        new_values = np.ascontiguousarray(new_values, dtype=np.float32)
    else:
        new_keys = new_values = _NO_ROWS
    line = 0
    for b, parts in enumerate(parts_per_row):
        for p, (keys, values, length) in enumerate(parts):
            in_place = bool(writes[b]) and p == len(parts) - 1
            table[line] = (*_flat(keys, alive, in_place), *_flat(values, alive, in_place), length)
            line += 1
        row_parts[b + 1] = line
    addresses = hidden_addresses(hidden, batch, alive)
    keys_per_row = [sum(n for _, _, n in parts) for parts in parts_per_row]
    chunks = thread_shares(keys_per_row, 1 if workers is None else worker_count())
    args = (scaled, table, row_parts, addresses, kv_heads, out)
    run_shares(lambda c: host_kernels.batch_rows(*args, c[0], c[-1] + 1, new_keys, new_values, writes), chunks,
               workers)
    del alive
    return out


def run_shares(run: Callable[[Any], None], shares: Sequence[Any], workers: Executor | None) -> None:
    """``run(share)`` for every share: the first on this thread, the others on ``workers``, all waited for.

    Even when this thread's share fails, the others still read and write the caller's buffers (which it
    keeps alive until this returns), so they are waited for before the error goes up."""
    pending = [workers.submit(run, share) for share in shares[1:]]  # type: ignore[union-attr]
    try:
        run(shares[0])
    finally:
        for future in pending:
            future.exception()
    for future in pending:
        future.result()


def _flat(array: mx.array, alive: list[np.ndarray], in_place: bool = False) -> tuple[int, int]:
    """The address of ``array``'s (1, kv_heads, capacity, dim) floats, and the floats from one head to the next.

    The engine's caches are C-contiguous, so this is their own memory (an
    evaluated MLX array hands numpy its buffer); another layout is copied,
    except ``in_place`` (the loops write there), where a copy would lose the write.
    """
    own = np.asarray(array)[0]
    if in_place and not (own.flags.c_contiguous and own.dtype == np.float32):
        raise RuntimeError("a claimed decode position's cache is not one contiguous float32 buffer")
    heads = np.ascontiguousarray(own, dtype=np.float32)
    return address_of(heads, alive), heads.shape[1] * heads.shape[2]


def _rows(array: mx.array) -> np.ndarray:
    """(batch, kv_heads, 1, dim) -> (batch, kv_heads, dim) float32, contiguous."""
    return np.ascontiguousarray(np.asarray(array)[:, :, 0, :], dtype=np.float32)


_NO_ROWS = np.zeros((1, 1, 1), dtype=np.float32)  # (nothing to write: the loops never read it)


def hidden_addresses(hidden: Sequence[np.ndarray | None] | None, batch: int, alive: list[np.ndarray]) -> np.ndarray:
    """Per row the address of one byte per key (non-zero: hidden), or 0 where nothing is hidden."""
    addresses = np.zeros(batch, dtype=np.int64)
    for b, m in enumerate(hidden or ()):
        if m is not None:
            addresses[b] = address_of(np.logical_not(m).astype(np.uint8).reshape(-1), alive)
    return addresses


def address_of(buffer: np.ndarray, alive: list[np.ndarray]) -> int:
    """The address of ``buffer``'s data, kept alive (in ``alive``) while the loops read it."""
    alive.append(buffer)
    return buffer.__array_interface__["data"][0]


def thread_shares(keys_per_row: list[int], workers: int) -> list[list[int]]:
    """Rows split into consecutive groups of about equal keys, one per worker; one group for short rows.

    The compiled loops release the GIL, so threads read the rows' caches in
    parallel: on 2 cores, 16 rows x 30 layers took 54 ms a step against
    90 ms on one thread at 1,000 keys a row, 19 against 24 ms at 200. Under
    ~100 keys a row a thread's hand-off costs more than it saves (11.8
    against 8.7 ms at 30).
    """
    total = sum(keys_per_row)
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

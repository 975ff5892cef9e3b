"""Sampling's top-k pass over the vocabulary in numpy and a compiled heap, for the CPU backend.

On the CPU, MLX's ``exp`` costs ~15 ns an element against numpy's ~1.3, and
its ``argpartition`` sorts far more than k: at 16 rows x 49K tokens the
log-sum-exp and the top-k selection took ~20 ms a decode step in MLX
(3.4 ms here). The same values come out as ``sampling.mlx_top_k``'s: each
kept log-probability is its logit minus the row's log-sum-exp.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class HostTopK:
    """One engine's pass; it keeps a scratch buffer (a 3 MB temporary a step would be fresh pages each time)."""

    def __init__(self) -> None:
        self._scratch: np.ndarray | None = None

    def __call__(self, logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
        """Each row's ``k`` largest log-probabilities (normalized over the vocabulary) and their ids."""
        host = np.asarray(logits, dtype=np.float32)
        ids = _top_k_ids(host, k)
        top = host.max(axis=-1, keepdims=True)
        shifted = self._buffer(host.shape)
        np.exp(np.subtract(host, top, out=shifted), out=shifted)
        normalizer = top + np.log(shifted.sum(axis=-1, keepdims=True, dtype=np.float32))
        logprobs = np.take_along_axis(host, ids, axis=-1) - normalizer
        return mx.array(logprobs), mx.array(ids.astype(np.uint32))

    def _buffer(self, shape: tuple[int, ...]) -> np.ndarray:
        if self._scratch is None or self._scratch.shape != shape:
            self._scratch = np.empty(shape, dtype=np.float32)
        return self._scratch


def _top_k_ids(host: np.ndarray, k: int) -> np.ndarray:
    try:
        from engine.runtime.runner.backends.cpu.top_k_kernel import top_k_rows
    except Exception:  # noqa: BLE001 (numba cannot load here: numpy's selection, slower)
        return np.argpartition(-host, k - 1, axis=-1)[:, :k]
    ids = np.empty((host.shape[0], k), dtype=np.int64)
    top_k_rows(host, k, ids)
    return ids

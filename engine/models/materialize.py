"""Evaluating every array a freshly built model holds, on the thread that built it.

MLX streams are per thread: an array built lazily on one thread cannot be
evaluated on another ("There is no Stream(cpu, 0) in current thread"). mlx-lm
evaluates a model's parameters when it loads them, but not the arrays modules
keep under private names, such as the frequencies of YaRN and Llama 3 RoPE
(``_freqs``: DeepSeek V2/V3, Kimi K2.5 and every model with scaled rotary
embeddings). The engine runs the model on its own thread, so whatever loads a
model evaluates all of them before handing it over.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


def evaluate_all_arrays(model: Any) -> None:
    """Evaluate every array in ``model``'s modules, parameters or not."""
    arrays = [value for _, module in model.named_modules() for value in module.values() if isinstance(value, mx.array)]
    mx.eval(arrays, model.parameters())

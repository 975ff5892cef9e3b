"""A served process's long-lived objects, set aside from Python's cycle collector.

From startup a process holds about a hundred thousand objects that live as long as it does (the model's
modules, the tokenizer, the web stack), and every full collection walks them all, on whichever thread set it off,
the engine's included, where every agent's next token waits for it. ``gc.freeze`` moves them to a permanent
generation that collections skip; they are still freed by their reference counts. An in-process engine on the
DeepSeek V3-shape folder (``bench.random_model``, the 2-core x86 box, medians of 5): a full collection 63-87 ms,
14-19 ms once they are set aside. Before a model is unloaded they are let back in (:func:`release`), so that
cycles among its objects are collected with it.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect what is garbage now, then keep every surviving object out of later collections."""
    gc.collect()
    gc.freeze()


def release() -> None:
    """Let the set-aside objects be collected again (a model about to be unloaded is among them)."""
    gc.unfreeze()

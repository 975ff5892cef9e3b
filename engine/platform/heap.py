"""A served process's long-lived objects, set aside from Python's cycle collector.

From startup a server holds about a hundred thousand objects that live as long as it does (the model's
modules, the tokenizer, the web stack), and every full collection walks them all: 66-98 ms a collection in a
served DeepSeek V3-shape process on the 2-core x86 box, on whichever thread set it off, the engine's
included, where every agent's next token waits for it. ``gc.freeze`` moves them to a permanent generation
that collections skip; they are still freed by their reference counts. A full collection in an in-process
engine on that model (~105,000 objects) 45-59 ms -> 14 ms; served, two rounds of 16 agents saw two 90 ms
collections on the engine's thread, four rounds after it none. Before a model is unloaded they are
let back in (:func:`release`), so that cycles among its objects are collected with it.
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

"""Qwen-VL's multi-axis rotary embedding (M-RoPE) on mlx-lm's own attention layers.

mlx-lm loads a Qwen-VL checkpoint's language model as plain Qwen2 (``mlx_lm.models.qwen2_vl``): its
attention rotates queries and keys at ``cache.offset`` with one position a token, which is exact for text
(a text token's three positions are one number) and wrong for an image's run, whose tokens take the image's
rows and columns, and for the text after an image, whose positions go on from the image's extent rather
than its token count (domain/rotary_positions.py).

So each attention layer's ``rope`` is replaced by :class:`MultimodalRope`, which rotates as mlx-lm's did
unless the forward pass in progress says otherwise (its :class:`RotarySlot`): a shift a row (text after
images: mlx-lm's own rotation at the cache offset plus the shift) or explicit positions (a prefill chunk
holding an image's tokens: mlx-vlm's own M-RoPE, so those tokens rotate exactly as mlx-vlm rotates them).
The engine fills the slot around each forward pass from the rows' caches (runtime/runner/rotary_passes.py);
a pass with nothing to say (a text model, a conversation without images) runs mlx-lm's rotation untouched.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import mlx.core as mx

# The frequency layout of each family's M-RoPE (mlx-vlm's ``style``): which position axis drives which
# frequency of a head.
MROPE_STYLES = {"qwen2_vl": "chunked", "qwen2_5_vl": "chunked", "qwen3_5": "interleaved",
                "qwen3_5_moe": "interleaved"}


@dataclass(frozen=True, slots=True)
class RotaryPass:
    """How one forward pass's rows rotate: ``shifts`` (batch,) added to the cache offsets, or ``axes``
    (3, batch, tokens) the explicit positions of every token of the pass."""

    shifts: mx.array | None = None
    axes: mx.array | None = None


class RotarySlot:
    """What the forward pass in progress says about its rotary positions (None: the cache offsets). Per thread:
    a model's weights may serve two engines (an extra model that is another's draft), each on its own thread."""

    def __init__(self, rotary: Any) -> None:
        self.rotary = rotary  # mlx-vlm's MRoPERotaryEmbedding for this model's heads
        self._passes = threading.local()

    @property
    def current(self) -> RotaryPass | None:
        return getattr(self._passes, "current", None)

    @contextmanager
    def rotating(self, positions: RotaryPass | None) -> Iterator[None]:
        self._passes.current = positions
        try:
            yield
        finally:
            self._passes.current = None


class MultimodalRope:
    """One attention layer's rotation: mlx-lm's ``rope`` at the positions the slot gives."""

    def __init__(self, inner: Any, slot: RotarySlot) -> None:
        self.inner = inner
        self.slot = slot

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        current = self.slot.current
        if current is None:
            return self.inner(x, offset=offset)
        if current.axes is None:
            return self.inner(x, offset=offset + current.shifts)
        # (apply_rotary rotates a query and a key together; this layer's mlx-lm code rotates them one at a time)
        return self.slot.rotary.apply_rotary(x, x, current.axes)[0]


def install(model: Any, text_config: dict[str, Any], style: str) -> RotarySlot:
    """Replace every attention layer's ``rope`` of the mlx-lm ``model`` with :class:`MultimodalRope`; the slot
    they share (also kept as ``model.rotary_slot``, where the engine's forward passes find it)."""
    from mlx_vlm.models.rope_utils import MRoPERotaryEmbedding

    slot: RotarySlot | None = None
    for _, module in list(model.named_modules()):
        rope = getattr(module, "rope", None)
        if rope is None or isinstance(rope, MultimodalRope) or not hasattr(module, "q_proj"):
            continue
        if slot is None:
            if getattr(rope, "traditional", False):
                raise ValueError("M-RoPE over a traditional (interleaved pairs) rotation")
            # (the rotated part of a head and its base as mlx-lm read them; the sections from the config)
            sections = text_config.get("rope_scaling") or text_config.get("rope_parameters")
            rotary = MRoPERotaryEmbedding(rope.dims, base=float(rope.base), rope_scaling=sections, style=style)
            slot = RotarySlot(rotary)
        module.rope = MultimodalRope(rope, slot)
    if slot is None:
        raise ValueError("the language model has no attention layer with a rotary embedding")
    model.rotary_slot = slot
    return slot


def slot_of(model: Any) -> RotarySlot | None:
    return getattr(model, "rotary_slot", None)

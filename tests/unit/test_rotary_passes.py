"""How a forward pass's rows rotate on a multi-axis model (runtime/runner/rotary_passes.py), read off its caches."""

from __future__ import annotations

import contextlib

import numpy as np

from engine.domain.images import PromptImage
from engine.domain.rotary_positions import ImagePositions
from engine.models.multimodal_rope import RotaryPass, RotarySlot
from engine.runtime.runner import rotary_passes


class Layer:
    """A layer cache as the pass sees it: an offset (and, assigned, the turn's rotary positions)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset


class Kv:
    def __init__(self, offset: int) -> None:
        self.layers = [Layer(offset)]


class Rows:
    """A batch's view of one layer: row ``b`` is ``rows[b]``."""

    def __init__(self, kvs: list[Kv]) -> None:
        self.rows = [kv.layers[0] for kv in kvs]


class Model:
    def __init__(self) -> None:
        self.rotary_slot = RotarySlot(rotary=None)
        self.seen: list[RotaryPass | None] = []

    def forward(self, cache, tokens: int) -> None:
        with rotary_passes.positioned(self, cache, tokens):
            self.seen.append(self.rotary_slot.current)


POSITIONS = ImagePositions([PromptImage(4, 6, "k", "d", 1, {}, (1, 3, 2))])  # a 3x2 image at 4: shift -3 after


def test_a_text_pass_after_an_image_shifts_each_row_by_its_own() -> None:
    model, imaged, plain = Model(), Kv(20), Kv(7)
    rotary_passes.assign(imaged, POSITIONS)
    model.forward([Rows([imaged, plain])], 1)
    (seen,) = model.seen
    assert seen is not None and seen.axes is None and seen.shifts.tolist() == [-3, 0]
    assert model.rotary_slot.current is None  # only while the pass is built


def test_a_chunk_over_an_image_rotates_every_row_by_explicit_positions() -> None:
    model, imaged, plain = Model(), Kv(2), Kv(30)
    rotary_passes.assign(imaged, POSITIONS)
    model.forward([Rows([imaged, plain])], 5)
    (seen,) = model.seen
    assert seen is not None and seen.shifts is None
    axes = np.array(seen.axes)
    assert axes.shape == (3, 2, 5)
    assert np.array_equal(axes[:, 0], np.array(POSITIONS.axes(2, 5)))
    assert np.array_equal(axes[:, 1], np.tile(np.arange(30, 35), (3, 1)))


def test_one_row_a_pass_and_rows_without_images_rotate_as_mlx_lm_does() -> None:
    model, imaged, plain = Model(), Kv(20), Kv(7)
    rotary_passes.assign(imaged, POSITIONS)
    model.forward(imaged.layers, 1)  # (a backend splitting a batch: each row's own caches)
    model.forward(plain.layers, 1)
    assert model.seen[0] is not None and model.seen[0].shifts.tolist() == [-3]
    assert model.seen[1] is None
    rotary_passes.assign(imaged, None)  # the turn ended
    model.forward([Rows([imaged, plain])], 1)
    assert model.seen[2] is None


def test_a_model_without_a_slot_is_untouched() -> None:
    kv = Kv(20)
    rotary_passes.assign(kv, POSITIONS)
    # (a model with one position a token: no slot to fill, whatever its caches carry)
    assert isinstance(rotary_passes.positioned(object(), kv.layers, 1), contextlib.nullcontext)

"""Qwen-VL's multi-axis rotary positions (domain/rotary_positions.py) against mlx-vlm's own ``get_rope_index``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from engine.domain.images import PromptImage
from engine.domain.rotary_positions import ImagePositions

START, PAD, VIDEO = 7, 9, 10  # vision_start, image_pad, video_pad ids of the made-up vocabulary


def image(start: int, grid: tuple[int, int, int]) -> PromptImage:
    t, h, w = grid
    return PromptImage(start, t * h * w, f"key{start}", "digest", 1, {}, grid)


# text, an image of 3x2 tokens, text, an image of 2x4 tokens, text
IMAGES = (image(4, (1, 3, 2)), image(13, (1, 2, 4)))
LENGTH = 26


def mlx_vlm_positions(images: tuple[PromptImage, ...], length: int) -> np.ndarray:
    """mlx-vlm's Qwen2-VL ``get_rope_index`` over the same prompt (its image runs after a vision-start token)."""
    mx = pytest.importorskip("mlx.core")
    language = pytest.importorskip("mlx_vlm.models.qwen2_vl.language")
    ids = [1] * length
    for i in images:
        ids[i.start - 1] = START
        ids[i.start:i.end] = [PAD] * i.length
    config = SimpleNamespace(vision_config=SimpleNamespace(spatial_merge_size=2), image_token_id=PAD,
                             video_token_id=VIDEO, vision_start_token_id=START)
    grids = mx.array([[t, h * 2, w * 2] for t, h, w in (i.grid for i in images)])
    positions, _ = language.LanguageModel.get_rope_index(SimpleNamespace(config=config), mx.array([ids]), grids)
    return np.array(positions)[:, 0, :]


def test_positions_of_a_whole_prompt_are_mlx_vlms() -> None:
    assert np.array_equal(np.array(ImagePositions(IMAGES).axes(0, LENGTH)), mlx_vlm_positions(IMAGES, LENGTH))


@pytest.mark.parametrize("chunk", [1, 3, 5, 8])
def test_chunks_from_anywhere_are_slices_of_the_whole(chunk: int) -> None:
    positions = ImagePositions(IMAGES)
    whole = np.array(positions.axes(0, LENGTH + 10))  # and past the prompt: the reply goes on from the last shift
    for start in range(0, LENGTH + 10 - chunk):
        assert np.array_equal(np.array(positions.axes(start, chunk)), whole[:, start:start + chunk]), start
        if not positions.in_image(start, chunk):
            assert np.array_equal(whole[:, start:start + chunk],
                                  np.tile(np.arange(start, start + chunk) + positions.shift(start), (3, 1)))


def test_text_after_an_image_goes_on_from_its_extent() -> None:
    positions = ImagePositions(IMAGES)
    assert positions.shift(3) == 0  # before any image
    assert positions.shift(10) == 3 - 6  # a 3x2 run spans 3 positions, not 6
    assert positions.shift(30) == (3 - 6) + (4 - 8)
    assert positions.in_image(12, 2) and not positions.in_image(10, 3)


def test_a_model_without_grids_has_none_and_a_run_that_disagrees_with_its_grid_is_refused() -> None:
    assert ImagePositions.of([PromptImage(4, 6, "k", "d", 1, {})]) is None
    with pytest.raises(ValueError, match="grid of 1x3x3"):
        ImagePositions([PromptImage(4, 6, "k", "d", 1, {}, (1, 3, 3))])

"""Rotary positions that part from cache positions: Qwen-VL's multi-axis rotary embedding (M-RoPE).

A Qwen-VL language model rotates each token by three positions (frames, rows, columns), each over its own
section of the head's frequencies. A text token's three are one number, so it rotates as plain rotary
embedding does; an image's run of ``t * h * w`` tokens takes its grid instead: the token at frame ``i``, row
``j``, column ``k`` is at ``(base + i, base + j, base + k)``, ``base`` being where the run begins. The text
after the image goes on from ``base + max(t, h, w)``, so from there on a token's rotary position is its cache
position plus a shift (negative: an image of ``t * h * w`` tokens spans only ``max(t, h, w)`` positions).

That is mlx-vlm's ``get_rope_index`` (Qwen2-VL, Qwen2.5-VL), computed per position so the engine can ask
about any chunk: a prefill chunk that holds an image's tokens rotates by explicit positions (:meth:`axes`);
every other pass, text or decode, by its cache offset plus :meth:`shift` (one number a row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from engine.domain.images import PromptImage


@dataclass(frozen=True, slots=True)
class _Run:
    start: int
    length: int
    grid: tuple[int, int, int]
    base: int  # the rotary position of the run's first token
    shift_after: int  # rotary minus cache position for the tokens after the run

    @property
    def end(self) -> int:
        return self.start + self.length


class ImagePositions:
    """The rotary positions of one prompt's tokens (and every token after it), from its images' grids."""

    def __init__(self, images: Sequence[PromptImage]) -> None:
        runs: list[_Run] = []
        shift = 0
        for image in sorted(images, key=lambda i: i.start):
            assert image.grid is not None
            t, h, w = image.grid
            if t * h * w != image.length:
                raise ValueError(f"an image run of {image.length} tokens with a grid of {t}x{h}x{w}")
            base = image.start + shift
            shift = base + max(t, h, w) - image.end
            runs.append(_Run(image.start, image.length, image.grid, base, shift))
        self._runs = tuple(runs)

    @classmethod
    def of(cls, images: Sequence[PromptImage]) -> "ImagePositions | None":
        """The prompt's positions where its images have grids (a multi-axis model); None where every rotary
        position is the cache position."""
        gridded = [image for image in images if image.grid is not None]
        return cls(gridded) if gridded else None

    def shift(self, position: int) -> int:
        """Rotary minus cache position of a text token at ``position`` (not inside an image's run)."""
        shift = 0
        for run in self._runs:
            if run.end > position:
                break
            shift = run.shift_after
        return shift

    def in_image(self, start: int, length: int) -> bool:
        """Whether positions ``[start, start + length)`` hold an image token (they need :meth:`axes`)."""
        return any(run.start < start + length and start < run.end for run in self._runs)

    def axes(self, start: int, length: int) -> list[list[int]]:
        """The three rotary positions (3 lists of ``length``) of cache positions ``[start, start + length)``."""
        out: list[list[int]] = [[], [], []]
        for position in range(start, start + length):
            run = next((r for r in self._runs if r.start <= position < r.end), None)
            if run is None:
                value = position + self.shift(position)
                for axis in out:
                    axis.append(value)
                continue
            index = position - run.start
            _, h, w = run.grid
            out[0].append(run.base + index // (h * w))
            out[1].append(run.base + index // w % h)
            out[2].append(run.base + index % w)
        return out

"""Prefill chunks that hold image tokens: their embeddings, with the vision tower's output in each image's run.

A chunk's text tokens are embedded by the model's own table; an image's positions take the rows of its
vision-tower output that fall in the chunk (a run may span chunks, or start inside a cached prefix). The
output of recent images is kept by key (bounded, oldest out first), so a second agent sending the same
image, or a turn that re-reads it after a rewind, computes no vision tower.
"""

from __future__ import annotations

import contextlib
import time
from collections import OrderedDict
from typing import Any, Callable, ContextManager, Sequence

import mlx.core as mx

from engine.domain.images import PromptImage, is_image_token
from engine.models.vision import VisionModel, embedding_table


class ImageEmbedder:
    def __init__(self, vision: VisionModel, model: Any, capacity: int = 64,
                 vision_pass: Callable[[], ContextManager[None]] = contextlib.nullcontext) -> None:
        self.vision = vision
        # The compute backend's context for a tower run (Backend.vision_pass: the CPU's faster attention and GELU).
        self.vision_pass = vision_pass
        self.embed = embedding_table(model)
        self.capacity = capacity
        self._kept: OrderedDict[str, mx.array] = OrderedDict()
        # What the throughput pane and /v1/stats show: images through the tower, images served kept, its time.
        self.encoded = 0
        self.reused = 0
        self.seconds = 0.0

    def features(self, image: PromptImage) -> mx.array:
        """The image's run of embeddings (length, hidden): kept, or computed now (engine thread)."""
        kept = self._kept.get(image.key)
        if kept is not None:
            self._kept.move_to_end(image.key)
            self.reused += 1
            return kept
        started = time.perf_counter()
        with self.vision_pass():
            features = self.vision.embeddings(image.inputs, image.length)
            mx.eval(features)
        self.seconds += time.perf_counter() - started
        self.encoded += 1
        if self.capacity > 0:
            self._kept[image.key] = features
            while len(self._kept) > self.capacity:
                self._kept.popitem(last=False)
        return features

    def chunk(self, tokens: Sequence[int], start: int, images: Sequence[PromptImage]) -> mx.array:
        """Embeddings (len(tokens), hidden) of prompt tokens from position ``start`` on (``images``: the prompt's)."""
        end = start + len(tokens)
        pieces: list[mx.array] = []
        at = start
        for image in sorted((i for i in images if i.overlaps(start, end)), key=lambda i: i.start):
            if image.start > at:
                pieces.append(self._text(tokens[at - start:image.start - start]))
            stop = min(end, image.end)
            lo = max(at, image.start)
            pieces.append(self.features(image)[lo - image.start:stop - image.start])
            at = stop
        if at < end:
            pieces.append(self._text(tokens[at - start:]))
        return mx.concatenate(pieces) if len(pieces) > 1 else pieces[0]

    def _text(self, tokens: Sequence[int]) -> mx.array:
        if any(is_image_token(t) for t in tokens):
            raise ValueError("image tokens with no image to read them from")
        return self.embed(mx.array(list(tokens)))


def has_images(images: Sequence[PromptImage], start: int, length: int) -> bool:
    return any(image.overlaps(start, start + length) for image in images)

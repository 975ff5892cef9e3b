"""Images in prompts: what a client sent, where it sits in the prompt tokens, and how tokens name it.

A vision model's processor writes an image as a run of placeholder tokens (Gemma 3's 256
``<image_soft_token>``, Qwen-VL's ``<|image_pad|>``) whose embeddings the vision tower's
features replace. Those ids are the same for every image, so the cache could not tell two
images apart by them. In the prompt the engine sees, each position of an image run holds an
**image token** instead: an id above every vocabulary, derived from the image's key (a hash of
its bytes and the processor's settings) and the position within the run. Every part of the
engine that matches, shares, stores or compares prompts by their tokens (an agent's cached
prefix, prefix sharing between agents, the warm tier, restart, fork, forensics) then tells
images apart with no code of its own; only the forward pass looks the features up, and no
image token ever reaches an embedding table.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

# Image tokens are IMAGE_TOKEN_BASE + 30 bits of hash: above any vocabulary, within int32.
IMAGE_TOKEN_BASE = 1 << 30
_HASH_MASK = (1 << 30) - 1


def is_image_token(token: int) -> bool:
    return token >= IMAGE_TOKEN_BASE


def image_tokens(key: str, length: int) -> list[int]:
    """The ``length`` tokens of the image run named ``key``; two runs share a token only by chance (2^-30 a
    position), so no two images share a run."""
    seed = hashlib.blake2b(key.encode(), digest_size=16).digest()
    out = []
    for index in range(length):
        digest = hashlib.blake2b(index.to_bytes(4, "little"), digest_size=4, key=seed).digest()
        out.append(IMAGE_TOKEN_BASE + (int.from_bytes(digest, "little") & _HASH_MASK))
    return out


def image_digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True, slots=True)
class PromptImage:
    """One image of a rendered prompt: its run of tokens at ``start`` (``length`` of them), its key (the bytes'
    digest with the processor's settings), and what the vision tower takes for it (the processor's arrays,
    plain numpy: built off the engine thread, read on it)."""

    start: int
    length: int
    key: str
    digest: str  # sha256 of the bytes the client sent (the key adds the processor's settings)
    size_bytes: int
    inputs: Any  # a mapping of the processor's arrays for this image (pixel_values, image_grid_thw, ...)
    # The run's grid as the language model's rotary positions see it (frames, rows, columns), for a model whose
    # positions follow an image's rows and columns (Qwen-VL's M-RoPE: domain/rotary_positions.py); None where a
    # run's positions are its tokens' own.
    grid: tuple[int, int, int] | None = None

    @property
    def end(self) -> int:
        return self.start + self.length

    def overlaps(self, start: int, end: int) -> bool:
        return self.start < end and start < self.end


def images_from(images: Sequence[PromptImage], position: int) -> tuple[PromptImage, ...]:
    """The images that still have tokens at or after ``position`` (what a prefill from there must embed)."""
    return tuple(image for image in images if image.end > position)


def describe_image_token(images: Sequence[PromptImage], position: int) -> str | None:
    """``image <digest> (N bytes)`` when ``position`` lies in one of ``images``' runs (for forensics)."""
    for image in images:
        if image.start <= position < image.end:
            return f"image {image.digest[:12]} ({image.size_bytes:,} bytes)"
    return None

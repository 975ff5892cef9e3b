"""A conversation with images into prompt tokens for a vision model.

The conversation goes through the same renderer as any other (tools, reasoning, fallbacks alike), with each
image a private-use sentinel in its message's text; the sentinels become the chat template's image marker in
the rendered text, and the model's processor tokenizes that text with the images (its marker expanded into
each image's run of tokens, as mlx-vlm's generation does). Each run then takes the image's own tokens
(domain/images.py), so the agent's cache tells images apart. A message's parts are joined with nothing
between them, as chat templates join a list content.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, replace

import numpy as np

from engine.domain.chat import ChatMessage, Conversation, ImagePart
from engine.domain.images import PromptImage, image_digest, image_tokens
from engine.errors import InvalidRequestError
from engine.models.vision import VisionModel

from .rendering import PromptRenderer

_SENTINEL = "\ue000semantic-image-{}\ue001"


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    tokens: list[int]
    images: tuple[PromptImage, ...] = ()


def render_with_images(renderer: PromptRenderer, vision: VisionModel, conversation: Conversation) -> RenderedPrompt:
    """Tokens and images of ``conversation`` (whose images were checked: image_inputs.checked_images)."""
    images: list[ImagePart] = []
    messages = tuple(_with_sentinels(message, images) for message in conversation.messages)
    text = renderer.render_text(replace(conversation, messages=messages))
    for index in range(len(images)):
        text = text.replace(_SENTINEL.format(index), vision.marker, 1)
    inputs = vision.prepare(text, [_picture(image) for image in images])
    ids = [int(t) for t in inputs.pop("input_ids")[0]]
    inputs.pop("attention_mask", None)
    runs = _runs(ids, vision.image_token_id)
    if len(runs) != len(images):
        raise InvalidRequestError(f"the model's processor wrote {len(runs)} image runs for {len(images)} images "
                                  "(an image marker in the text itself, or a processor that tiles images)",
                                  field=images[0].field if images else "messages")
    per_image = _split(inputs, [length for _, length in runs])
    prompt_images = []
    for image, (start, length), arrays in zip(images, runs, per_image):
        digest = image_digest(image.data)
        key = f"{digest}:{vision.settings_key}"
        ids[start:start + length] = image_tokens(key, length)
        prompt_images.append(PromptImage(start, length, key, digest, len(image.data), arrays, vision.grid(arrays)))
    return RenderedPrompt(ids, tuple(prompt_images))


def _with_sentinels(message: ChatMessage, images: list[ImagePart]) -> ChatMessage:
    if not message.parts:
        return message
    pieces = []
    for part in message.parts:
        if isinstance(part, ImagePart):
            pieces.append(_SENTINEL.format(len(images)))
            images.append(part)
        else:
            pieces.append(part)
    return replace(message, content="".join(pieces), parts=())


def _picture(image: ImagePart):
    from PIL import Image

    with Image.open(io.BytesIO(image.data)) as picture:
        picture.seek(0)  # an animation's first frame only
        return picture.convert("RGB")


def _runs(ids: list[int], token: int) -> list[tuple[int, int]]:
    """(start, length) of each run of ``token``."""
    runs: list[tuple[int, int]] = []
    for at, value in enumerate(ids):
        if value != token:
            continue
        if runs and runs[-1][0] + runs[-1][1] == at:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((at, 1))
    return runs


def _split(inputs: dict[str, np.ndarray], lengths: list[int]) -> list[dict[str, np.ndarray]]:
    """Each image's own vision-tower inputs: a batch row each, or, where the processor flattens patches and says
    each image's grid (``image_grid_thw``), the rows of its patches."""
    count = len(lengths)
    grid = inputs.get("image_grid_thw")
    if grid is not None:
        sizes = [int(np.prod(row)) for row in grid]
        bounds = np.cumsum([0, *sizes])
        return [{"pixel_values": inputs["pixel_values"][bounds[i]:bounds[i + 1]], "image_grid_thw": grid[i:i + 1]}
                for i in range(count)]
    return [{key: value[i:i + 1] for key, value in inputs.items() if value.ndim and value.shape[0] == count}
            for i in range(count)]

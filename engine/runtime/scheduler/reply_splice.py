"""A reply's text round trip keeps its cached tokens.

A client sends the text this server wrote back in the next turn's history, and the chat template renders it
again: where the text no longer tokenizes to the tokens the model wrote, the agent's cache diverges at the
reply and the whole reply is prefilled again. The common cause is a reply whose first token carries a leading
blank (``" examines"``): the detokenizer drops that blank, as mlx-lm's does, and many templates trim a
message's content too, so ``"examines"`` comes back and tokenizes to other ids.

Here the prompt is walked against the agent's cached tokens: at each place the two part, the shortest
stretches after which they run on token for token again (or the cache ends) are compared as text; where
they read the same, blanks at either end aside, the prompt takes the cached stretch in place of its own, and
the walk goes on to the next parting (a conversation's every reply comes back this way, turn after turn).
The first parting that reads otherwise ends the walk: from there the prompt is as the client sent it, and
prefilled. So the model reads its replies as it wrote them, the cache serves them, and the turn's forensics
show no divergence there. An image's tokens are never part of a replaced stretch; positions after a
replacement (images, the reply's start, cache-control marks) move with it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from engine.domain.block_layout import common_prefix_length
from engine.domain.requests import GenerationRequest

# How many tokens longer or shorter the prompt's stretch may be than the cached one (a blank split or merged).
SLACK = 4
# Tokens that must follow equal in both for the walk to take them as back in step.
IN_STEP = 2
# The longest cached stretch compared at one parting: past it, the two really differ.
MAX_STRETCH = 64


def spliced(cached: Sequence[int], request: GenerationRequest,
            decode: Callable[[list[int]], str]) -> GenerationRequest | None:
    """``request`` with the cached stretches of ``cached`` in place of the prompt's tokens that read as the same
    text; None where nothing was replaced."""
    prompt = request.prompt_tokens
    out: list[int] = []
    moves: list[tuple[int, int]] = []  # (prompt position where a replaced stretch ended, shift from there on)
    at_cached = at_prompt = 0
    while True:
        same = common_prefix_length(tuple(cached[at_cached:]), tuple(prompt[at_prompt:]))
        out += prompt[at_prompt:at_prompt + same]
        at_cached, at_prompt = at_cached + same, at_prompt + same
        if at_cached >= len(cached) or at_prompt >= len(prompt) - 1:
            break
        step = _stretches(cached, at_cached, prompt, at_prompt, decode)
        if step is None or _holds_image(request, at_prompt, at_prompt + step[1]):
            break
        ours, theirs = step
        out += cached[at_cached:at_cached + ours]
        at_cached, at_prompt = at_cached + ours, at_prompt + theirs
        moves.append((at_prompt, len(out) - at_prompt))
    if not moves:
        return None
    out += prompt[at_prompt:]

    def moved(position: int) -> int:
        shift = 0
        for end, total in moves:
            if position >= end:
                shift = total
        return position + shift

    return replace(
        request, prompt_tokens=tuple(out),
        reply_start=moved(request.reply_start) if request.reply_start else 0,
        retain_tokens=moved(request.retain_tokens) if request.retain_tokens else 0,
        images=tuple(replace(image, start=moved(image.start)) for image in request.images))


def _stretches(cached: Sequence[int], at_cached: int, prompt: Sequence[int], at_prompt: int,
               decode: Callable[[list[int]], str]) -> tuple[int, int] | None:
    """The shortest stretches (cached length, prompt length) from a parting that read as the same text, blanks
    at the ends aside, and after which both run on equal (or the cache ends); None where there are none. The
    prompt keeps at least one token after its stretch (the turn's own token to feed)."""
    room = len(prompt) - at_prompt - 1
    for ours in range(1, min(MAX_STRETCH, len(cached) - at_cached) + 1):
        ends = at_cached + ours >= len(cached)
        for theirs in sorted(range(max(1, ours - SLACK), min(room, ours + SLACK) + 1), key=lambda n: abs(n - ours)):
            if not ends and not _in_step(cached, at_cached + ours, prompt, at_prompt + theirs):
                continue
            text = decode(list(cached[at_cached:at_cached + ours])).strip()
            if text and text == decode(list(prompt[at_prompt:at_prompt + theirs])).strip():
                return ours, theirs
    return None


def _in_step(cached: Sequence[int], i: int, prompt: Sequence[int], j: int) -> bool:
    n = min(IN_STEP, len(cached) - i, len(prompt) - j)
    return n > 0 and all(cached[i + d] == prompt[j + d] for d in range(n))


def _holds_image(request: GenerationRequest, start: int, end: int) -> bool:
    return any(image.start < end and start < image.start + image.length for image in request.images)


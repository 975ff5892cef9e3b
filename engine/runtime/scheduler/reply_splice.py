"""A reply's text round trip keeps its cached tokens.

A client sends the text this server wrote back in the next turn's history, and the chat template renders it
again: where the text no longer tokenizes to the tokens the model wrote, the agent's cache diverges at the
reply and the whole reply is prefilled again. The common cause is a reply whose first token carries a leading
blank (``" examines"``): the detokenizer drops that blank, as mlx-lm's does, and many templates trim a
message's content too, so ``"examines"`` comes back and tokenizes to other ids. Here, when the prompt parts
from the agent's cached tokens and the rest of what is cached (the end of its last turn: its reply) reads
as the same text as the prompt's next tokens, blanks at either end aside, the prompt takes the cached tokens
in their place: the model reads its reply as it wrote it, the cache serves it, and the turn's forensics show
no divergence there.

Only blanks at the ends of that span may differ (the text is otherwise the same, character for character),
and a span holding an image's tokens is never touched.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

from engine.domain.requests import GenerationRequest

# How many tokens the prompt's span may be longer or shorter than the cached one (a blank split or merged).
SLACK = 4
# Characters compared first, so a history that really changed costs two short decodes, not a long search.
HEAD_CHARS = 24
# A cached tail longer than this is not a reply (the client cut the history): no search.
MAX_TAIL = 16384


def spliced(cached: Sequence[int], request: GenerationRequest,
            decode: Callable[[list[int]], str]) -> GenerationRequest | None:
    """``request`` with the cached tail of ``cached`` in place of the prompt's tokens that read as the same
    text; None where the prompt follows ``cached`` to its end, parts from it elsewhere, or reads otherwise."""
    prompt = request.prompt_tokens
    k = _common(cached, prompt)
    tail = list(cached[k:])
    if k == 0 or not tail or len(tail) > MAX_TAIL or k >= len(prompt) - 1:
        return None
    if any(image.start + image.length > k for image in request.images):
        return None
    target = decode(tail).strip()
    if not target or not decode(list(prompt[k:k + min(len(tail), 2 * HEAD_CHARS)])).strip().startswith(
            target[:HEAD_CHARS]):
        return None
    for span in sorted(range(max(1, len(tail) - SLACK), len(tail) + SLACK + 1), key=lambda n: abs(n - len(tail))):
        if k + span >= len(prompt):
            continue  # the prompt must still end with a token of its own to prefill
        if decode(list(prompt[k:k + span])).strip() == target:
            shift = len(tail) - span
            return replace(request, prompt_tokens=(*prompt[:k], *tail, *prompt[k + span:]),
                           reply_start=request.reply_start + shift if request.reply_start > k else request.reply_start)
    return None


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i

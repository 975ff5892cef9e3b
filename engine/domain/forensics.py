"""Why a turn prefilled what it prefilled: how its prompt met the agent's cache.

Users of a local server keep asking why a turn computed 40K tokens again.
The usual answers: volatile bytes in the prompt (a date, a counter, a
reordered tool list), a sliding-window cache that could not go back to the
divergence, an eviction, a model swap. For every admitted turn the engine
records which of these it was, where the prompt left the cached tokens
(token index, 256-token block, whether inside the system prompt and tools),
the text on both sides of that point, and, when the divergence falls on a
span Claude Code is known to change between requests, its name.
"""

from __future__ import annotations

import enum
import re
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from engine.domain.block_layout import common_prefix_length
from engine.domain.images import PromptImage, describe_image_token, is_image_token

# Turns remembered per agent.
HISTORY_KEPT = 16
# Tokens of context shown on each side of a divergence.
CONTEXT_TOKENS = 40
IMAGE_TEXT = "[image]"  # how an image's run of tokens reads in the texts shown
# Tokens looked back for the start of the line a divergence sits on.
LINE_TOKENS = 96
# A chat turn re-renders the last reply, whose final tokens (an end-of-turn marker) often differ
# from what was generated: losing that many cached tokens is an ordinary warm turn, not a miss.
TAIL_TOLERANCE = 16


class CacheOutcome(str, enum.Enum):
    """How a turn met its agent's cache (one per turn; the first that applies)."""

    FULL = "full"  # every cached token the prompt still starts with was reused
    NEW_AGENT = "new_agent"  # nothing was cached for this agent yet
    SHARED = "shared"  # a new or emptied agent started from another agent's prefix (hot or on disk)
    DIVERGED = "diverged"  # the prompt differs from the cached tokens before their end
    WINDOW = "window"  # sliding-window layers could only resume from an earlier checkpoint
    SNAPSHOT = "snapshot"  # recurrent state could only resume from an earlier snapshot (the note names where)
    RESTORED = "restored"  # the cache came back from the warm tier (disk) for this turn
    DROPPED = "dropped"  # the cache had gone cold (dropped) before this turn
    MODEL_CHANGED = "model_changed"  # the agent's cache was made by another model
    SIDE_REQUEST = "side_request"  # a side request (title, probe) served from a prefix; the cache untouched
    NO_ROOM = "no_room"  # the pool could not hold what was planned; less was kept


# Spans of Claude Code prompts that change between requests of one session, by a pattern that
# appears on the line where they sit.
VOLATILE_SPANS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"Today's date is|currentDate"), "Claude Code's currentDate line (changes every day)"),
    (re.compile(r"gitStatus|Current branch:|Recent commits:"), "Claude Code's git status snapshot"),
    (re.compile(r"x-anthropic-billing-header|cc_version="), "Claude Code's billing header"),
    (re.compile(r"Primary working directory:|Working directory:"), "the working directory line"),
    (re.compile(r"<system-reminder>"), "a Claude Code system reminder"),
    (re.compile(r"\b\d{4}-\d{2}-\d{2}\b"), "a date"),
    (re.compile(r"\b\d{1,2}:\d{2}(:\d{2})?\b"), "a time of day"),
)


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where the prompt left the cached tokens, and the text on both sides of that point."""

    token: int  # index of the first differing token
    block: int  # the 256-token block (of ``block_tokens``) it falls in
    region: str  # "system prompt and tools", "messages", or a finer label the API adds
    cached_text: str  # the cached side: some tokens before the point, then the cached tokens from it
    prompt_text: str  # the prompt side, over the same span
    common_chars: int  # characters of both texts before the point (equal on both sides)
    volatile: str | None  # a known volatile span at the point, named
    # Whose tokens the prompt was compared with: "own cache", or the agent whose prefix it shared
    # (a Claude Code session whose system prompt changed continues as a new agent sharing the old one's).
    against: str = "own cache"


@dataclass(frozen=True, slots=True)
class TurnForensics:
    request_id: str
    at: float  # wall time of admission
    outcome: CacheOutcome
    prompt_tokens: int
    cached_tokens: int  # what the agent's cache held when the turn arrived
    reused_tokens: int
    source: str  # reuse_source: self, shared:<agent>, prefix:<key>, none
    note: str | None  # the engine's explanation when it could use less than it had
    divergence: Divergence | None = None

    @property
    def prefilled_tokens(self) -> int:
        return self.prompt_tokens - self.reused_tokens


Decode = Callable[[Sequence[int]], str]


def examine(
    *, request_id: str, prompt: Sequence[int], cached: Sequence[int], cached_tokens: int, tier_before: str,
    model_changed: bool, reused: int, source: str, note: str | None, side: bool, head_tokens: int,
    block_tokens: int, decode: Decode, donor: tuple[str, Sequence[int]] | None = None,
    images: Sequence[PromptImage] = (),
) -> TurnForensics:
    """The record of one admitted turn.

    ``cached`` are the tokens the agent held (hot, or restored from disk);
    ``donor`` the agent and tokens a shared prefix came from, compared with
    when the agent had nothing of its own; ``images`` the prompt's (an image
    where the two part is named by its digest).
    """
    decode = readable(decode)
    outcome, divergence = _outcome(prompt, cached, tier_before, model_changed, reused, source, note, side), None
    against, compare = ("own cache", cached) if cached or donor is None else donor
    diverged_at = common_prefix_length(compare, prompt) if compare else None
    if diverged_at is not None and diverged_at < min(len(compare), len(prompt)):
        divergence = _divergence(prompt, compare, diverged_at, head_tokens, block_tokens, decode, against)
        named = _image_at(prompt, compare, diverged_at, images)
        if named is not None:
            divergence = replace(divergence, volatile=named)
    return TurnForensics(request_id, time.time(), outcome, len(prompt), cached_tokens, reused, source, note,
                         divergence)


def _outcome(prompt: Sequence[int], cached: Sequence[int], tier_before: str, model_changed: bool, reused: int,
             source: str, note: str | None, side: bool) -> CacheOutcome:
    if side:
        return CacheOutcome.SIDE_REQUEST
    if model_changed:
        return CacheOutcome.MODEL_CHANGED
    if tier_before == "cold":
        return CacheOutcome.DROPPED
    if not cached:
        return CacheOutcome.SHARED if reused else CacheOutcome.NEW_AGENT
    if source != "self" and reused and common_prefix_length(cached, prompt) == 0:
        return CacheOutcome.SHARED
    usable = min(common_prefix_length(cached, prompt), len(prompt) - 1)
    if reused < usable:
        if note and "no pool room" in note:
            return CacheOutcome.NO_ROOM
        if note and "snapshot at token" in note:
            return CacheOutcome.SNAPSHOT
        return CacheOutcome.WINDOW if note and "window" in note else CacheOutcome.DIVERGED
    if len(cached) - usable > TAIL_TOLERANCE and usable < len(prompt) - 1:
        return CacheOutcome.DIVERGED
    return CacheOutcome.RESTORED if tier_before == "warm" else CacheOutcome.FULL


def _divergence(prompt: Sequence[int], cached: Sequence[int], at: int, head_tokens: int, block_tokens: int,
                decode: Decode, against: str) -> Divergence:
    start = max(0, at - CONTEXT_TOKENS // 2)
    before = decode(prompt[start:at])
    cached_text = before + decode(cached[at:at + CONTEXT_TOKENS // 2])
    prompt_text = before + decode(prompt[at:at + CONTEXT_TOKENS // 2])
    region = "system prompt and tools" if at < head_tokens else "messages"
    # The line the point sits on names the span; it can start further back than the shown context.
    line_start = max(0, at - LINE_TOKENS)
    lead = decode(prompt[line_start:at])
    lines = (lead + decode(prompt[at:at + CONTEXT_TOKENS // 2]), lead + decode(cached[at:at + CONTEXT_TOKENS // 2]))
    return Divergence(at, at // block_tokens, region, cached_text, prompt_text, len(before),
                      _volatile(lines, len(lead)), against)


def readable(decode: Decode) -> Decode:
    """``decode`` with each run of image tokens written ``[image]`` (no tokenizer knows those ids)."""
    def text(tokens: Sequence[int]) -> str:
        out, run = [], []
        for token in tokens:
            if is_image_token(token):
                if run:
                    out.append(decode(run))
                    run = []
                if not out or out[-1] != IMAGE_TEXT:
                    out.append(IMAGE_TEXT)
            else:
                run.append(token)
        if run:
            out.append(decode(run))
        return "".join(out)

    return text


def _image_at(prompt: Sequence[int], cached: Sequence[int], at: int, images: Sequence[PromptImage]) -> str | None:
    """Names the image where prompt and cache part, when one of them has an image there."""
    if is_image_token(prompt[at]):
        named = describe_image_token(images, at) or "an image"
        return f"{named}: not the image the cache holds here" if is_image_token(cached[at]) else \
            f"{named}: where the cache holds text"
    if is_image_token(cached[at]):
        return "an image in the cache where the prompt has text"
    return None


def _volatile(texts: tuple[str, str], point: int) -> str | None:
    """The known volatile span on the line where the two texts part, if any."""
    for text in texts:
        line_start = text.rfind("\n", 0, point) + 1
        line_end = text.find("\n", point)
        line = text[line_start:line_end if line_end >= 0 else len(text)]
        for pattern, name in VOLATILE_SPANS:
            if pattern.search(line):
                return name
    return None

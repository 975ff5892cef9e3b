"""Anthropic ``cache_control`` breakpoints as retention hints for the engine.

A client marks tools, system blocks or message blocks with
``{"type": "ephemeral", "ttl": "5m" | "1h"}``: it will send the same prefix
again within that time. The engine keeps such an agent's cache in the pool
for the longest TTL asked, evicting unmarked agents first when it needs room
(a preference, not a pin: when only marked agents are left, the least
recently used of them goes to disk as usual).

The breakpoint also decides the usage split. Anthropic counts the prompt as
``cache_read_input_tokens`` (served from the cache) + ``cache_creation_input_tokens``
(computed and written to the cache because they lie before a breakpoint)
+ ``input_tokens`` (computed, after the last breakpoint). This server
computes that split from its own cache: reused tokens are reads, prefilled
tokens before the last breakpoint are creation, the rest are input. Without a
breakpoint nothing is "created" (every prefilled token is input), though
semantic keeps every agent's cache anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from .anthropic_schemas import CacheControl, MessagesRequest

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True, slots=True)
class Retention:
    ttl_s: float
    # Where the last breakpoint sits: "head" (tools or system) or "messages" (a message block,
    # or the request-level breakpoint, which marks the last block).
    through: str


def retention_of(body: MessagesRequest) -> Retention | None:
    """The longest TTL of the request's breakpoints and where the last one is; None without any."""
    head = [t.cache_control for t in body.tools or ()] + _marks(body.system or ())
    messages = [mark for message in body.messages for mark in _marks(message.content)]
    if body.cache_control is not None:
        messages.append(body.cache_control)
    marks = [m for m in head + messages if m is not None]
    if not marks:
        return None
    through = "messages" if any(m is not None for m in messages) else "head"
    return Retention(max(TTL_SECONDS[m.ttl] for m in marks), through)


def _marks(blocks: Iterable[object]) -> list[CacheControl | None]:
    return [getattr(block, "cache_control", None) for block in blocks]


def retained_tokens(retention: Retention | None, prompt_tokens: int, head_tokens: int) -> int:
    """How many leading prompt tokens lie before the last breakpoint (0 without one).

    A breakpoint in the messages is taken to cover the whole prompt (clients mark the
    last message); one in the tools or system covers the rendered head.
    """
    if retention is None:
        return 0
    return prompt_tokens if retention.through == "messages" else min(head_tokens, prompt_tokens)


def usage_split(prompt_tokens: int, reused: int, retain_tokens: int) -> tuple[int, int, int]:
    """(input_tokens, cache_creation_input_tokens, cache_read_input_tokens); they add up to the prompt."""
    created = max(0, min(retain_tokens, prompt_tokens) - reused)
    return prompt_tokens - reused - created, created, reused

"""Anthropic cache diagnostics (beta ``cache-diagnosis-2026-04-07``): why a request missed the cache.

A request that carries the beta header and a ``diagnostics`` object leaves a
fingerprint of itself under its response's id: hashes of the model, the
system prompt, the tools, each message, and of the other parameters that
change the prompt (``tool_choice``, ``thinking``), and its rendered prompt
tokens. The next request names that id as ``diagnostics.previous_message_id``
and gets ``diagnostics.cache_miss_reason`` for the first point where it
diverged, in the API's own shapes: ``model_changed``, ``tools_changed``,
``system_changed``, ``messages_changed`` (an earlier message differs, not
only new ones appended), each with ``cache_missed_input_tokens``; or
``previous_message_not_found``; or ``unavailable`` (model, system and tools
match but another prompt-affecting parameter differs). No divergence:
``diagnostics`` is null. Without the beta or the field, no ``diagnostics``
key at all.

``cache_missed_input_tokens`` is exact here, not an estimate: the previous
prompt's tokens after the first token the two rendered prompts differ in,
what the agent's cache held and this prompt could not use (for another
model: the whole previous prompt, though semantic answers any model name
with the model it has loaded, and its own cache may well have been reused).

The comparison is of the requests' structure, like the API's, and
independent of whether this turn really hit the cache (the engine's own
forensics, ``usage.semantic``, say that). Fingerprints live in memory, as
many per agent as its cache history (16 turns), and go with a restart.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Mapping

from engine.domain.block_layout import common_prefix_length

BETA = "cache-diagnosis-2026-04-07"
PER_AGENT = 16  # as many as an agent's cache history holds
MAX_FINGERPRINTS = 4096  # across agents: the oldest go first


def wants_diagnostics(headers: Mapping[str, str], diagnostics: Any) -> bool:
    """The beta named in ``anthropic-beta`` (comma-separated) and a ``diagnostics`` object in the body."""
    betas = {b.strip() for b in headers.get("anthropic-beta", "").split(",")}
    return BETA in betas and diagnostics is not None


def _hash(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False, default=str).encode()).hexdigest()


def _without_cache_control(value: Any) -> Any:
    """A breakpoint moving is no change of the prompt: cache_control is left out of every hash."""
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


@dataclass(frozen=True, slots=True)
class Fingerprint:
    agent_id: str
    model: str
    system: str
    tools: str
    messages: tuple[str, ...]
    other: str  # tool_choice, thinking
    tokens: array  # the rendered prompt

    @classmethod
    def of(cls, agent_id: str, body: Mapping[str, Any], prompt_tokens: tuple[int, ...]) -> "Fingerprint":
        """``body``: the request as JSON (``model_dump(exclude_none=True)`` of the parsed request)."""
        clean = _without_cache_control(dict(body))
        model = f"{clean.get('model')} {clean.get('speed') or ''}"  # the API counts a speed change as the model's
        return cls(agent_id, model, _hash(clean.get("system")), _hash(clean.get("tools")),
                   tuple(_hash(m) for m in clean.get("messages") or ()),
                   _hash([clean.get("tool_choice"), clean.get("thinking")]), array("I", prompt_tokens))


def diagnose(previous: Fingerprint | None, now: Fingerprint) -> dict[str, Any] | None:
    """The ``diagnostics`` object of a request that named ``previous`` (None when found and nothing diverged)."""
    if previous is None:
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    if previous.model != now.model:  # another model's cache holds nothing of this prompt
        return {"cache_miss_reason": {"type": "model_changed", "cache_missed_input_tokens": len(previous.tokens)}}
    missed = len(previous.tokens) - common_prefix_length(previous.tokens, now.tokens)
    for kind, changed in (("tools_changed", previous.tools != now.tools),
                          ("system_changed", previous.system != now.system),
                          ("messages_changed", now.messages[:len(previous.messages)] != previous.messages)):
        if changed:
            return {"cache_miss_reason": {"type": kind, "cache_missed_input_tokens": missed}}
    if previous.other != now.other:
        return {"cache_miss_reason": {"type": "unavailable"}}
    return None


class FingerprintStore:
    """Fingerprints by response id; touched only on the event loop."""

    def __init__(self, per_agent: int = PER_AGENT, limit: int = MAX_FINGERPRINTS) -> None:
        self.per_agent = per_agent
        self.limit = limit
        self._by_id: OrderedDict[str, Fingerprint] = OrderedDict()
        self._by_agent: dict[str, deque[str]] = {}

    def get(self, message_id: str | None) -> Fingerprint | None:
        return self._by_id.get(message_id) if message_id else None

    def put(self, message_id: str, fingerprint: Fingerprint) -> None:
        ids = self._by_agent.setdefault(fingerprint.agent_id, deque())
        ids.append(message_id)
        self._by_id[message_id] = fingerprint
        while len(ids) > self.per_agent:
            self._by_id.pop(ids.popleft(), None)
        while len(self._by_id) > self.limit:
            oldest, gone = self._by_id.popitem(last=False)
            agent_ids = self._by_agent.get(gone.agent_id)
            if agent_ids is not None and oldest in agent_ids:
                agent_ids.remove(oldest)

    def __len__(self) -> int:
        return len(self._by_id)

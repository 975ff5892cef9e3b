"""Sibling agents for concurrent requests that no client named.

A request without a session id is the agent its prompt's prefix hash names
(identity.py): every such request with the same system prompt and tools is
one agent. An agent runs one turn at a time, so twelve concurrent calls of a
script that sends no session id ran one after another (measured: SmolLM2,
twelve identical chat completions of 120 tokens, 129 s, the last answered
after the other eleven; ``mlx_lm.server`` batches them). Such a request now
takes the first lane of its agent that has no turn: ``openai-<hash>``, then
``openai-<hash>-2``, ``-3``, ... Each lane is its own agent; a new lane starts
from the prefix the others cached (prefix sharing), and a stateless client's
next turn finds the conversation on whichever lane is free.

Claimed and released on the event loop only, so no lock: the claim before the
turn is rendered, the release when its finish arrives (or its start fails).
"""

from __future__ import annotations

from collections import Counter


class AgentLanes:
    def __init__(self, most: int) -> None:
        self.most = most  # lanes per agent: more could not run at once (max_batch_size)
        self._running: Counter[tuple[str, str]] = Counter()  # (model key, agent id) -> turns claimed
        self._claims: dict[str, tuple[str, str]] = {}  # request id -> (model key, agent id)

    def claim(self, model_key: str, base: str, request_id: str) -> str:
        """The first lane of ``base`` without a turn (``base`` itself first), held for ``request_id``; past
        ``most`` lanes, ``base`` (the turn queues behind its running one, as before)."""
        agent_id = next((lane for lane in self._lanes(base) if not self._running[(model_key, lane)]), base)
        self._running[(model_key, agent_id)] += 1
        self._claims[request_id] = (model_key, agent_id)
        return agent_id

    def release(self, request_id: str) -> None:
        """The turn of ``request_id`` finished, or never started (a request that claimed nothing: no-op)."""
        claim = self._claims.pop(request_id, None)
        if claim is None:
            return
        self._running[claim] -= 1
        if self._running[claim] <= 0:
            del self._running[claim]

    @property
    def held(self) -> int:
        return len(self._claims)

    def _lanes(self, base: str) -> list[str]:
        return [base, *(f"{base}-{lane}" for lane in range(2, self.most + 1))]

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

A lane whose turns all belong to clients that have gone (a client that gave
up and sends its request again at once) counts as free: the new turn queues
behind the one being cancelled, on the agent that holds its conversation,
rather than starting another agent. Seeing that a client went is not
immediate: uvicorn stops reading a connection once its request body is in,
so the first disconnect check only resumes reading and says "still there";
the close is seen an event-loop turn or two later. A claim that would start
a sibling lane therefore waits ``SETTLE_S`` once and looks again (measured:
the soak's clients that drop a request and send the next at once got a
lane of their own in 1 of 3 half-minute runs without it). A request whose
own client has already gone takes its base agent: it will only be
cancelled, and a lane started for it would hold blocks nobody uses.

Claimed and released on the event loop only, so no lock: the claim before the
turn is rendered, the release when its finish arrives (or its start fails).
"""

from __future__ import annotations

import asyncio
from typing import Awaitable, Callable

ClientGone = Callable[[], Awaitable[bool]]

# Long enough for the event loop to read a closed connection's end once reading resumed (a few loop turns),
# short against any turn: it is paid only by a claim that finds its first lane busy.
SETTLE_S = 0.01


class AgentLanes:
    def __init__(self, most: int) -> None:
        self.most = most  # lanes per agent: more could not run at once (max_batch_size)
        self._holders: dict[tuple[str, str], list[str]] = {}  # (model key, agent id) -> request ids
        self._claims: dict[str, tuple[str, str]] = {}  # request id -> (model key, agent id)
        self._gone: dict[str, ClientGone | None] = {}  # request id -> its client's disconnect check

    async def claim(self, model_key: str, base: str, request_id: str,
                    client_gone: ClientGone | None = None) -> str:
        """The first lane of ``base`` without a live turn (``base`` itself first), held for ``request_id``;
        past ``most`` lanes, ``base`` (the turn queues behind its running one)."""
        if client_gone is not None and await client_gone():
            self._hold(model_key, base, request_id, client_gone)
            return base
        lanes = self._lanes(base)
        agent_id = await self._first_free(model_key, lanes)
        self._hold(model_key, agent_id, request_id, client_gone)  # held while it waits: no other claim takes it
        if agent_id != base:  # a busy lane's client may have gone unseen: look again once it could be seen
            try:
                await asyncio.sleep(SETTLE_S)
                earlier = await self._first_free(model_key, lanes[:lanes.index(agent_id)], default=agent_id)
            except BaseException:  # the request was cancelled while it waited: it holds nothing
                self.release(request_id)
                raise
            if earlier != agent_id:
                self.release(request_id)
                self._hold(model_key, earlier, request_id, client_gone)
                agent_id = earlier
        return agent_id

    def release(self, request_id: str) -> None:
        """The turn of ``request_id`` finished, or never started (a request that claimed nothing: no-op)."""
        claim = self._claims.pop(request_id, None)
        self._gone.pop(request_id, None)
        if claim is None:
            return
        holders = self._holders[claim]
        holders.remove(request_id)
        if not holders:
            del self._holders[claim]

    @property
    def held(self) -> int:
        return len(self._claims)

    def _hold(self, model_key: str, agent_id: str, request_id: str, client_gone: ClientGone | None) -> None:
        self._holders.setdefault((model_key, agent_id), []).append(request_id)
        self._claims[request_id] = (model_key, agent_id)
        self._gone[request_id] = client_gone

    async def _first_free(self, model_key: str, lanes: list[str], default: str | None = None) -> str:
        """The first of ``lanes`` without a live turn; ``default`` (the first lane) when every one has one."""
        for lane in lanes:
            if await self._free(model_key, lane):
                return lane
        return lanes[0] if default is None else default

    async def _free(self, model_key: str, agent_id: str) -> bool:
        for request_id in list(self._holders.get((model_key, agent_id), ())):
            gone = self._gone.get(request_id)
            if gone is None or not await gone():
                return False
        return True

    def _lanes(self, base: str) -> list[str]:
        return [base, *(f"{base}-{lane}" for lane in range(2, self.most + 1))]

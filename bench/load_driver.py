"""Mixed, seeded client traffic for the load test and the soak.

Each agent sends its requests back to back; all agents run at once. An agent
speaks one protocol (even agents Anthropic Messages, odd ones OpenAI chat
completions with ``session_id``); each request is drawn from the agent's own
seeded ``random.Random``, so a run is reproducible whatever the interleaving:
streaming or not, a small ``max_tokens``, and what the client does:

* ``complete``: read the whole response and check it (every SSE frame
  against its grammar, or the JSON body and its usage);
* ``drop_early``: send the request on a raw socket and close it before
  reading a byte;
* ``drop_mid``: read the first frames of a stream, then close it.

Prompts start with the agent's number, so no two agents share a cached
prefix block, and grow by one number per request, so every turn reuses the
agent's cache and adds a little; after ``prompt_wrap`` requests the count
starts over, which keeps a long soak's prompts bounded and trims caches.
"""

from __future__ import annotations

import asyncio
import enum
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.model.sse_grammar import check_anthropic_stream, check_openai_stream  # noqa: E402

TIMEOUT = httpx.Timeout(120, connect=30)
# A drop_mid client reads this many bytes before closing: past the first frame, short of a 4-token stream's end.
MID_DROP_BYTES = 200


class Protocol(str, enum.Enum):
    ANTHROPIC = "anthropic"
    OPENAI = "openai"


class Action(str, enum.Enum):
    COMPLETE = "complete"
    DROP_EARLY = "drop_early"
    DROP_MID = "drop_mid"


class Outcome(str, enum.Enum):
    COMPLETED = "completed"
    DROPPED_EARLY = "dropped_early"
    DROPPED_MID = "dropped_mid"
    # A well-formed 429 with retry-after: the pool had no room (a side request may not evict a main agent).
    REJECTED = "rejected"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class TrafficMix:
    agents: int = 10
    seed: int = 7
    stream_share: float = 0.5
    drop_early_share: float = 0.1
    drop_mid_share: float = 0.15  # of streamed requests
    max_tokens: tuple[int, int] = (4, 8)
    prompt_wrap: int = 40
    # Tells this run's OpenAI sessions apart from another run's on the same server.
    tag: str = "load"

    def __post_init__(self) -> None:
        if self.agents < 1 or self.prompt_wrap < 1:
            raise ValueError("agents and prompt_wrap must be positive")
        for share in (self.stream_share, self.drop_early_share, self.drop_mid_share):
            if not 0.0 <= share <= 1.0:
                raise ValueError(f"shares are fractions in [0, 1], got {share}")


@dataclass(frozen=True, slots=True)
class RequestPlan:
    agent: int
    index: int
    protocol: Protocol
    stream: bool
    action: Action
    max_tokens: int
    tag: str
    wrap: int

    @property
    def path(self) -> str:
        return "/v1/messages" if self.protocol is Protocol.ANTHROPIC else "/v1/chat/completions"

    def body(self) -> dict[str, Any]:
        system = f"Agent {self.agent} of the {self.tag} run. Answer in one short line."
        numbers = " ".join(str(n) for n in range(1, 2 + self.index % self.wrap))
        user = f"Numbers so far: {numbers}. Say the next one."
        if self.protocol is Protocol.ANTHROPIC:
            return {"model": "claude-load", "max_tokens": self.max_tokens, "stream": self.stream,
                    "system": system, "messages": [{"role": "user", "content": user}]}
        return {"model": "load", "max_tokens": self.max_tokens, "stream": self.stream,
                "stream_options": {"include_usage": True}, "session_id": f"{self.tag}-{self.agent}",
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}


def plan_request(mix: TrafficMix, rng: random.Random, agent: int, index: int,
                 action: Action | None = None) -> RequestPlan:
    """Request ``index`` of ``agent``; ``action`` forces what the client does."""
    stream = rng.random() < mix.stream_share
    drawn = rng.random()
    if drawn < mix.drop_early_share:
        chosen = Action.DROP_EARLY
    elif stream and drawn < mix.drop_early_share + mix.drop_mid_share:
        chosen = Action.DROP_MID
    else:
        chosen = Action.COMPLETE
    protocol = Protocol.ANTHROPIC if agent % 2 == 0 else Protocol.OPENAI
    return RequestPlan(agent, index, protocol, stream, action or chosen, rng.randint(*mix.max_tokens),
                       mix.tag, mix.prompt_wrap)


# -- results -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class Tally:
    counts: dict[str, int] = field(default_factory=lambda: {o.value: 0 for o in Outcome})
    by_kind: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    generated_tokens: int = 0

    def add(self, plan: RequestPlan, outcome: Outcome, detail: str = "", generated: int = 0) -> None:
        self.counts[outcome.value] += 1
        kind = f"{plan.protocol.value}/{'stream' if plan.stream else 'json'}/{outcome.value}"
        self.by_kind[kind] = self.by_kind.get(kind, 0) + 1
        self.generated_tokens += generated
        if outcome is Outcome.FAILED:
            self.failures.append(f"agent {plan.agent} request {plan.index} ({kind}, {plan.action.value}): {detail}")

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        parts = ", ".join(f"{n} {name}" for name, n in self.counts.items())
        return f"{self.total} requests: {parts}; {self.generated_tokens} tokens generated"


# -- checks of completed responses -----------------------------------------------------------------
def check_usage(plan: RequestPlan, prompt: int, generated: int) -> int:
    assert prompt > 0, f"prompt tokens {prompt}"
    assert 1 <= generated <= plan.max_tokens, f"{generated} tokens generated, max_tokens {plan.max_tokens}"
    return generated


def check_anthropic_json(plan: RequestPlan, body: dict[str, Any]) -> int:
    assert body["type"] == "message" and body["role"] == "assistant", body
    assert all(block["type"] == "text" for block in body["content"]), body
    assert body["stop_reason"] in ("end_turn", "max_tokens"), body
    usage = body["usage"]
    return check_usage(plan, usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"])


def check_openai_json(plan: RequestPlan, body: dict[str, Any]) -> int:
    assert body["object"] == "chat.completion", body
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), body
    assert choice["finish_reason"] in ("stop", "length"), body
    usage = body["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"], usage
    return check_usage(plan, usage["prompt_tokens"], usage["completion_tokens"])


def check_stream(plan: RequestPlan, raw: str) -> int:
    if plan.protocol is Protocol.ANTHROPIC:
        stream = check_anthropic_stream(raw)
        usage = stream.final_usage
        return check_usage(plan, usage["input_tokens"] + usage["cache_read_input_tokens"], usage["output_tokens"])
    said = check_openai_stream(raw)
    return check_usage(plan, said.usage["prompt_tokens"], said.usage["completion_tokens"])


def stream_ended(raw: str) -> bool:
    return "event: message_stop" in raw or "data: [DONE]" in raw


# -- clients -------------------------------------------------------------------------------------------
async def send(client: httpx.AsyncClient, url: str, plan: RequestPlan, rng: random.Random, tally: Tally) -> None:
    """One request as ``plan`` says; the outcome goes into ``tally``, never raises for a bad response."""
    try:
        if plan.action is Action.DROP_EARLY:
            await drop_early(url, plan, rng.uniform(0.0, 0.05))
            tally.add(plan, Outcome.DROPPED_EARLY)
        else:
            outcome, generated = await (streamed(client, plan) if plan.stream else non_streamed(client, plan))
            tally.add(plan, outcome, generated=generated)
    except (AssertionError, KeyError, ValueError, TypeError, httpx.HTTPError, OSError) as exc:
        tally.add(plan, Outcome.FAILED, f"{type(exc).__name__}: {exc}"[:2000])


def check_rejection(plan: RequestPlan, response: httpx.Response, text: str) -> Outcome:
    """Anything but 200 must be a 429 in the protocol's error shape, with retry-after."""
    assert response.status_code == 429, f"HTTP {response.status_code}: {text[:500]}"
    assert float(response.headers["retry-after"]) > 0, response.headers
    body = json.loads(text)
    error = body["error"]
    if plan.protocol is Protocol.ANTHROPIC:
        assert body["type"] == "error" and error["type"] == "rate_limit_error", body
    assert error["message"], body
    return Outcome.REJECTED


async def non_streamed(client: httpx.AsyncClient, plan: RequestPlan) -> tuple[Outcome, int]:
    response = await client.post(plan.path, json=plan.body())
    if response.status_code != 200:
        return check_rejection(plan, response, response.text), 0
    body = response.json()
    check = check_anthropic_json if plan.protocol is Protocol.ANTHROPIC else check_openai_json
    return Outcome.COMPLETED, check(plan, body)


async def streamed(client: httpx.AsyncClient, plan: RequestPlan) -> tuple[Outcome, int]:
    """Read a stream whole (and check it), or with ``drop_mid`` close it after its first bytes."""
    chunks: list[bytes] = []
    async with client.stream("POST", plan.path, json=plan.body()) as response:
        if response.status_code != 200:
            return check_rejection(plan, response, (await response.aread()).decode()), 0
        async for chunk in response.aiter_raw():
            chunks.append(chunk)
            if plan.action is Action.DROP_MID and sum(map(len, chunks)) >= MID_DROP_BYTES:
                break
    raw = b"".join(chunks).decode()
    if plan.action is Action.DROP_MID and not stream_ended(raw):
        return Outcome.DROPPED_MID, 0
    # A short stream can arrive whole in the first read: then it was not dropped and must be valid.
    return Outcome.COMPLETED, check_stream(plan, raw)


async def drop_early(url: str, plan: RequestPlan, linger_s: float) -> None:
    """Send the request on a raw socket and close it unread after ``linger_s``."""
    parts = urlsplit(url)
    payload = json.dumps(plan.body()).encode()
    head = (f"POST {plan.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n").encode()
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    try:
        writer.write(head + payload)
        await writer.drain()
        await asyncio.sleep(linger_s)
    finally:
        writer.close()
        # The server may already have answered into the closed socket: a reset here is expected.
        try:
            await writer.wait_closed()
        except OSError:
            pass


# -- runs ------------------------------------------------------------------------------------------
@dataclass(slots=True)
class AgentCursor:
    """One agent's random stream and request counter, kept across rounds."""

    agent: int
    rng: random.Random
    sent: int = 0


def cursors(mix: TrafficMix) -> list[AgentCursor]:
    return [AgentCursor(a, random.Random(mix.seed * 1_000_003 + a)) for a in range(mix.agents)]


@dataclass(frozen=True, slots=True)
class Budget:
    """How long each agent of a round keeps sending: a request count, a monotonic deadline, or both."""

    requests: int | None = None
    until: float | None = None

    def allows(self, done: int) -> bool:
        return ((self.requests is None or done < self.requests)
                and (self.until is None or time.monotonic() < self.until))


async def run_round(url: str, mix: TrafficMix, agents: list[AgentCursor], budget: Budget,
                    tally: Tally | None = None) -> Tally:
    """Every agent sends requests back to back while ``budget`` allows; all agents at once.

    Outcomes go into ``tally`` (a fresh one by default), which a sampler may read while the round runs.
    """
    tally = tally if tally is not None else Tally()
    limits = httpx.Limits(max_connections=4 * mix.agents, max_keepalive_connections=mix.agents)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        await asyncio.gather(*(agent_loop(client, url, mix, cursor, budget, tally) for cursor in agents))
    return tally


async def agent_loop(client: httpx.AsyncClient, url: str, mix: TrafficMix, cursor: AgentCursor, budget: Budget,
                     tally: Tally) -> None:
    done = 0
    while budget.allows(done):
        plan = plan_request(mix, cursor.rng, cursor.agent, cursor.sent)
        cursor.sent += 1
        await send(client, url, plan, cursor.rng, tally)
        done += 1


async def settle_round(url: str, mix: TrafficMix) -> Tally:
    """Every agent completes the last prompt of the cycle, greedily: its hot cache ends the same every time.

    Run before measuring the idle pool at the start and at the end of a soak, so the two can be compared.
    """
    rng = random.Random(mix.seed)
    plans = [plan_request(mix, rng, agent, mix.prompt_wrap - 1, Action.COMPLETE) for agent in range(mix.agents)]
    tally = Tally()
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT) as client:
        await asyncio.gather(*(send(client, url, plan, rng, tally) for plan in plans))
    return tally

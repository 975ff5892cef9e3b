"""Running one workload on semantic and on mlx_lm.server: one server at a time, order alternating.

Both servers would share the same two cores, so they never run together.
Repeat i runs both back to back (semantic first on even repeats, the peer
first on odd ones), which pairs them under the same machine load.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from bench.chat_stream import ChatClient, Turn
from bench.served import Launch, serving

T = TypeVar("T")


@dataclass(slots=True)
class Conversation:
    """One agent's chat history, grown turn by turn the way an agent loop grows it."""

    agent: str
    messages: list[dict[str, str]]

    async def take_turn(self, client: ChatClient, index: int, user: str, max_tokens: int) -> Turn:
        self.messages.append({"role": "user", "content": user})
        turn = await client.turn(self.agent, index, self.messages, max_tokens)
        self.messages.append({"role": "assistant", "content": turn.text})
        return turn


@dataclass(slots=True)
class Outcome:
    """One run of a conversation workload on one server."""

    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0  # the turns only: a restart's downtime is in restart_s
    restart_s: float = 0.0  # stop (with semantic's cache write) until the restarted server answers

    def turns_at(self, index: int) -> list[Turn]:
        return [t for t in self.turns if t.index == index]

    def from_turn(self, index: int) -> list[Turn]:
        return [t for t in self.turns if t.index >= index]


def load_average() -> str:
    # Other processes on a 2-core box skew every number: say how busy it was.
    return f"load average {os.getloadavg()[0]:.2f}" if hasattr(os, "getloadavg") else ""


def on_both(launches: tuple[Launch, Launch], repeats: int,
            run: Callable[[Launch], T]) -> tuple[list[T], list[T]]:
    """``run(launch)`` ``repeats`` times per server, alternating which goes first."""
    runs: dict[str, list[T]] = {launch.name: [] for launch in launches}
    for repeat in range(repeats):
        for launch in launches if repeat % 2 == 0 else launches[::-1]:
            print(f"# run {repeat + 1}/{repeats}, {launch.name} ({load_average()})", flush=True)
            t0 = time.perf_counter()
            runs[launch.name].append(run(launch))
            print(f"#   done in {time.perf_counter() - t0:.0f} s", flush=True)
    return runs[launches[0].name], runs[launches[1].name]


def served_once(launch: Launch, log_dir: Path, work: Callable[[ChatClient], Awaitable[T]]) -> T:
    """Start the server fresh, run ``work`` against it, stop it."""
    with serving(launch, log_dir) as url:
        return asyncio.run(_drive(url, launch, work))


def served_with_restart(launch: Launch, log_dir: Path, before: Callable[[ChatClient], Awaitable[list[Turn]]],
                        after: Callable[[ChatClient], Awaitable[list[Turn]]]) -> Outcome:
    """``before`` on a fresh server, a stop (SIGTERM, as a user would) and a start on the same state, ``after``."""
    outcome = Outcome()
    with serving(launch, log_dir) as url:
        t0 = time.perf_counter()
        outcome.turns += asyncio.run(_drive(url, launch, before))
        outcome.wall_s += time.perf_counter() - t0
        stopping = time.perf_counter()
    # serving() waits for the restarted server to answer a completion: the downtime a user sees.
    with serving(launch, log_dir, keep_state=True) as url:
        outcome.restart_s = time.perf_counter() - stopping
        t0 = time.perf_counter()
        outcome.turns += asyncio.run(_drive(url, launch, after))
        outcome.wall_s += time.perf_counter() - t0
    return outcome


async def _drive(url: str, launch: Launch, work: Callable[[ChatClient], Awaitable[T]]) -> T:
    async with ChatClient(url, launch.sends_session_id, model=launch.model_field,
                          raw_prompts=launch.raw_prompts) as client:
        return await work(client)

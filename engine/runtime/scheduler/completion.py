"""Finishing a turn: its cache settled into its agent's (or dropped), the agent's record, the finish event.

Every way a turn ends comes here: the model stopped, a limit ended it,
the client cancelled, admission or a step failed.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from engine.domain.event_log import EventKind
from engine.domain.requests import FinishReason
from engine.runtime.scheduler.parts import SchedulerPart, SchedulerState
from engine.runtime.scheduler.turn import Turn
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.runner.kv.disk_slices import prefix_slices


class Completion(SchedulerPart):
    def __init__(self, state: SchedulerState, model_key: str, leave_batch: Callable[[int], Any]) -> None:
        super().__init__(state)
        self.model_key = model_key  # what a finished turn's agent records as its cache's model
        self.leave_batch = leave_batch  # takes a sequence out of the batch, by uid

    def complete(self, turn: Turn, reason: FinishReason, **extra: Any) -> None:
        started = time.monotonic()
        self.stats.completed += 1
        turn.finish()
        self.queues.by_request.pop(turn.request_id, None)
        if turn.uid is not None:
            self.queues.by_uid.pop(turn.uid, None)
            self.leave_batch(turn.uid)
        agent = turn.agent or self.agents.get(turn.request.agent_id)
        kv = turn.holder.kv if turn.holder is not None and turn.uid is not None else None
        if agent is not None:
            self._settle(turn, agent, failed=reason is FinishReason.ERROR and turn.uid is not None)
        # (bytes copied: growth while running, and the tidy after)
        turn.settled(time.monotonic() - started, kv.copied if kv is not None else None)
        event = turn.finish_event(reason, **extra)
        if event.usage.speculation is not None:
            self.stats.speculation = self.stats.speculation + event.usage.speculation
        if agent is not None and turn.uid is not None:
            asked = turn.request.asked_max_tokens
            note = event.note or event.error
            if reason is FinishReason.LENGTH and asked is not None and event.note is None:
                note = f"max_tokens {asked} clamped to {turn.request.max_tokens} by the server's max_output_tokens"
            agent.record_turn(event.reason.value, note, event.usage)
        self.delivery.emit(turn, event)
        failed = reason is FinishReason.ERROR
        self.events.emit(
            EventKind.ERROR if failed else EventKind.FINISH,
            f"{turn.request.agent_id}: {reason.value}, {turn.generated} tokens"
            + (f" ({extra['error']})" if "error" in extra else f" ({extra['note']})" if extra.get("note") else ""),
            turn.request.agent_id,
            logging.WARNING if failed else logging.INFO,
        )

    def _settle(self, turn: Turn, agent: AgentRecord, failed: bool) -> None:
        """The turn is over: its cache now holds what was fed; account for it (or drop it)."""
        if turn.uid is not None:
            agent.turn_left()
            if failed and turn.on_own_cache:
                # A step that raised may have updated some layers and not others.
                self.hot.drop(agent)
                agent.move_to(Tier.COLD)
            elif turn.on_own_cache and turn.sequence is not None:
                tokens = list(turn.request.prompt_tokens[:turn.reused]) + turn.sequence.fed
                reported = turn.prompt_len + turn.generated
                if len(tokens) > reported:
                    # A speculative step fed drafts past the token the turn ended at (a stop string, the
                    # repetition guard, a cancel): the cache keeps what the client was sent.
                    tokens = tokens[:turn.sequence.kv.continue_from(reported)]
                agent.holds(tokens)
                agent.turn_ended_at(turn.reused)
                self.hot.tidy(agent)
                self.hot.publish(agent)
                agent.holds(agent.tokens, self.model_key)
                self._store_prefix(turn, agent)
            elif turn.holder is not None:
                self.hot.release(turn.holder)  # a side request's private cache
        agent.settle_state(self.queues.has_waiting(agent.agent_id))

    def _store_prefix(self, turn: Turn, agent: AgentRecord) -> None:
        """The turn computed its prompt's shareable prefix: write it once for later agents."""
        store = self.tiers.store
        block = self.hot.spec.block_tokens
        point = turn.request.prefix_hint // block * block
        if store is None or not store.usable or point == 0 or len(agent.tokens) < point or agent.kv is None:
            return
        if store.prefixes.has(agent.tokens[:point]):
            return
        slices = prefix_slices(agent.kv, point)
        if slices is not None:
            store.store_prefix(agent.tokens[:point], slices)

"""Preparing an admitted turn's cache: whose cache it runs on, how much of it is reused, and room in the pool.

The hand-off into the batch costs what the turn's own tokens cost: an agent's
resident cache is cut back to the divergence (a window layer to a
checkpoint) and passed to the model as it is. Only a prefix taken from
another agent, or a side request's private copy, is copied.
"""

from __future__ import annotations

import enum
import time
from dataclasses import replace
from typing import Callable

from engine.models.loaded import LoadedModel

from engine.runtime import clock
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.domain.event_log import EventKind
from engine.domain.forensics import TurnForensics, examine
from engine.runtime.tiers.hot import Holder, ReusePlan, SideCache
from engine.store.layer_slice import LayerSlice
from engine.runtime.tiers.manager import HotState
from engine.runtime.scheduler.parts import SchedulerPart, SchedulerState
from engine.runtime.scheduler.reply_splice import spliced
from engine.runtime.scheduler.turn import Turn


PENDING = object()  # a shared prefix is still being read from disk


class Readiness(enum.Enum):
    READY = "ready"  # the turn's cache is prepared: it may enter the batch
    NO_ROOM = "no_room"  # the pool cannot hold this turn now
    DEFERRED = "deferred"  # this turn's cache is still being read; try the next turn


class TurnCaches(SchedulerPart):
    def __init__(self, state: SchedulerState, loaded: LoadedModel, prefix_sharing: bool) -> None:
        super().__init__(state)
        self.loaded = loaded
        self.prefix_sharing = prefix_sharing

    def prepare(self, turn: Turn, running: set[str]) -> Readiness:
        """Plan and prepare ``turn``'s cache; ``running`` are the agents with a turn in the batch."""
        request = turn.request
        agent = self.agents.for_request(request)
        if agent.turns == 0 and agent.tier in (Tier.EMPTY, Tier.COLD):
            agent.first_request(request.auxiliary)
        self.agents.touch(agent)
        agent.retain(request.retain_s, clock.now())
        other_model = agent.model_id is not None and agent.model_id != self.loaded.identity.key
        turn.arrive(agent.tier.value, other_model and agent.tier in (Tier.EMPTY, Tier.COLD))
        state = self.tiers.ensure_hot(agent, protect=running)
        if state is HotState.PENDING:
            return Readiness.DEFERRED
        if state is HotState.NO_ROOM:
            return Readiness.NO_ROOM
        started = time.monotonic()
        cached = agent.tokens  # replaced, never mutated, when the turn cuts it back
        kept_reply = spliced(cached, request, self.loaded.tokenizer.decode)
        if kept_reply is not None:
            turn.take_request(kept_reply)
            request = kept_reply
        plan, side = self._plan(agent, turn)
        if kept_reply is not None:
            plan = replace(plan, note=_joined(plan.note, "the last reply came back as text that reads the same but "
                                                         "tokenizes otherwise (a blank at an end): its cached tokens "
                                                         "were kept"))
        stored = self._stored_prefix(turn, plan)
        if stored is PENDING:
            return Readiness.DEFERRED  # a shared prefix is being read from disk; other turns go ahead
        holder: Holder = SideCache(f"{agent.agent_id}~{request.request_id}") if side else agent
        turn.take_cache(agent, plan, holder)
        if stored is not None:
            stored_plan, slices = stored
            turn.replan(stored_plan)
            copied = self._prepare_from_disk(holder, agent, turn, slices, running)
        else:
            copied = self._prepare(holder, agent, turn, running)
        if copied is None:
            return Readiness.NO_ROOM
        assert holder.kv is not None
        forensics = self._examine(turn, agent, cached, side)
        agent.history.append(forensics)
        turn.cache_ready(copied, holder.kv.copied, forensics, time.monotonic() - started)
        return Readiness.READY

    def _examine(self, turn: Turn, agent: AgentRecord, cached: list[int], side: bool) -> TurnForensics:
        plan = turn.plan
        assert plan is not None and turn.arrival is not None
        tier_before, model_changed = turn.arrival
        donor = self.agents.get(plan.donor) if plan.donor else None
        return examine(
            request_id=turn.request_id, prompt=turn.request.prompt_tokens, cached=cached,
            cached_tokens=len(cached) if cached else agent.stored_tokens, tier_before=tier_before,
            model_changed=model_changed, reused=plan.reused, source=plan.source, note=plan.note, side=side,
            head_tokens=turn.request.head_tokens, block_tokens=self.hot.spec.block_tokens,
            decode=self.loaded.tokenizer.decode,
            donor=(donor.agent_id, donor.tokens) if donor is not None else None,
            images=turn.request.images,
        )

    # -- planning --------------------------------------------------------------------------
    def _plan(self, agent: AgentRecord, turn: Turn) -> tuple[ReusePlan, bool]:
        """The reuse plan, and whether the turn must run on a side cache."""
        donors: Callable[[str], AgentRecord | None] | None = self.agents.get if self.prefix_sharing else None
        plan = self.hot.plan_reuse(agent, turn.request.prompt_tokens, donors)
        would_change = agent.kv is not None and (plan.reused < len(agent.tokens) or plan.donor is not None)
        if turn.request.auxiliary and would_change and not agent.auxiliary:
            # Serve from the prefix without touching the main conversation's cache.
            return replace(plan, note="auxiliary request: the agent's cache was left intact"), True
        return plan, False

    def _stored_prefix(self, turn: Turn, plan: ReusePlan) -> "tuple[ReusePlan, list[LayerSlice]] | object | None":
        """A shared prefix on disk that serves more of the prompt than the hot plan (PENDING while it is read)."""
        store = self.tiers.store
        if store is None or not store.usable:
            return None
        prompt = turn.request.prompt_tokens
        entry = store.prefixes.longest(prompt, at_most=len(prompt) - 1)
        if entry is None or entry.n_tokens < plan.reused + self.hot.spec.block_tokens:
            return None  # nothing stored, or not worth a read
        slices = store.prefixes.slices_for(entry.key, prompt)
        if slices is None:
            return PENDING if store.prefixes.reading(entry.key) else None
        return ReusePlan(entry.n_tokens, f"prefix:{entry.key[:12]}", prefix=entry.key), slices

    def _prepare_from_disk(self, holder: Holder, agent: AgentRecord, turn: Turn, slices: list[LayerSlice],
                           running: set[str]) -> int | None:
        plan = turn.plan
        assert plan is not None and plan.prefix is not None and self.tiers.store is not None
        self.hot.fresh(holder)
        if not self._reserve(holder, turn.admission_tokens, running | {agent.agent_id}, turn):
            self._undo(holder, agent)
            return None
        self.hot.load_prefix(holder, plan.reused, slices)
        self.tiers.store.prefixes.done_with(plan.prefix)
        if holder is agent:
            agent.holds(list(turn.request.prompt_tokens[:plan.reused]))
            agent.move_to(Tier.HOT)
            self.hot.publish(agent)
        self.events.emit(EventKind.SHARE, f"{agent.agent_id}: {plan.reused} prompt tokens from the shared prefix "
                         f"{plan.prefix[:12]} on disk", agent.agent_id)
        assert holder.kv is not None
        return holder.kv.copied

    def _undo(self, holder: Holder, agent: AgentRecord) -> None:
        """No room after all: give back what the fresh cache took."""
        self.hot.release(holder)
        if holder is agent:
            agent.holds([])
            agent.move_to(Tier.COLD if agent.turns else Tier.EMPTY)
            self.hot.publish(agent)

    # -- preparing -------------------------------------------------------------------------
    def _prepare(self, holder: Holder, agent: AgentRecord, turn: Turn, running: set[str]) -> int | None:
        """Make ``holder``'s cache hold exactly the plan's prefix, with room for the prompt; bytes copied.

        Updates ``turn.plan`` when less could be kept than planned.
        """
        plan = turn.plan
        assert plan is not None
        need = turn.admission_tokens
        protect = running | {agent.agent_id}
        donor = self.agents.get(plan.donor) if plan.donor else None
        if holder is agent and donor is None:
            kept = self.hot.continue_own(agent, plan.reused)
            if kept != plan.reused:
                turn.replan(ReusePlan(kept, "self" if kept else "none",
                                      note=f"no pool room to re-base the shared prefix; {kept} tokens kept"))
            before = agent.kv.copied if agent.kv is not None else 0
            if not self._reserve(agent, need, protect, turn):
                return None
            assert agent.kv is not None
            return agent.kv.copied - before
        source = donor if donor is not None else agent
        self.hot.fresh(holder)
        shared, copied = self.hot.share_prefix(holder, source, plan.reused) if plan.reused else (0, 0)
        if not self._reserve(holder, need, protect | {source.agent_id}, turn):
            self._undo(holder, agent)
            return None
        assert holder.kv is not None
        copied += holder.kv.copied  # a fresh cache: everything it copied so far is this turn's
        if plan.reused:
            assert source.kv is not None
            copied += self.hot.copy_prefix(holder, source.kv, plan.reused)
        if holder is agent and donor is not None:
            agent.holds(list(donor.tokens[:plan.reused]))
            agent.move_to(Tier.HOT)
            self.hot.publish(agent)
            self.events.emit(EventKind.SHARE, f"{agent.agent_id}: shares {plan.reused} prefix tokens of "
                             f"{donor.agent_id} ({shared} by reference)", agent.agent_id)
        return copied

    def _reserve(self, holder: Holder, n_tokens: int, protect: set[str], turn: Turn) -> bool:
        if self.hot.ensure(holder, n_tokens):
            return True
        missing = self.hot.missing_blocks(holder, n_tokens)
        self.tiers.make_room(missing, protect, auxiliary_only=turn.request.auxiliary)
        return self.hot.ensure(holder, n_tokens)


def _joined(note: str | None, more: str) -> str:
    return f"{note}; {more}" if note else more

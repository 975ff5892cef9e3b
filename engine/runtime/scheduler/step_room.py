"""Room for a batch step, settled before the step runs, and payment for the checkpoints it took, after.

The batch plans its step (runner/step_plan.py); here each sequence's ask is
granted as far as the pool allows: blocks reserved and arrays grown, other
agents evicted to the warm or cold tier when the pool is short (the tiers
may write to disk). This is the only part of a step that may evict; the
batch then runs within what was granted.
"""

from __future__ import annotations

from engine.runtime.runner.sequence import Sequence
from engine.runtime.runner.step_plan import StepPlan
from engine.runtime.scheduler.parts import SchedulerPart
from engine.runtime.scheduler.turn import Turn


class StepRoom(SchedulerPart):
    def grant(self, plan: StepPlan) -> dict[int, int]:
        """Each planned sequence's room: the highest of its levels the pool could give, in plan order (the
        oldest sequences first). A sequence that cannot get its first level gets none, and its turn says why."""
        room: dict[int, int] = {}
        for ask in plan.asks:
            turn = self.queues.running(ask.sequence.uid)
            if turn is None or turn.holder is None:
                continue
            for i, n_tokens in enumerate(ask.levels):
                if not self._reserve(turn, ask.sequence, n_tokens, say_why=i == 0):
                    break
                room[ask.sequence.uid] = n_tokens
        return room

    def _reserve(self, turn: Turn, sequence: Sequence, n_tokens: int, say_why: bool) -> bool:
        """Room for ``n_tokens`` positions in the turn's cache: reserve blocks, evicting if need be."""
        holder = turn.holder
        assert holder is not None
        if self.hot.ensure(holder, n_tokens):
            return True
        missing = self.hot.missing_blocks(holder, n_tokens)
        self.tiers.make_room(missing, self.queues.running_agents(), auxiliary_only=turn.request.auxiliary)
        if self.hot.ensure(holder, n_tokens):
            return True
        if say_why:
            pool = self.hot.pool
            held = ("side requests may not evict conversations' caches" if turn.request.auxiliary
                    else "the rest is held by running, pinned or busy agents")
            missing = self.hot.missing_blocks(holder, n_tokens)
            turn.no_room(f"the KV pool could not grow the turn past {sequence.kv.offset} positions: "
                         f"{missing} more blocks needed, {pool.free_blocks} of {pool.total_blocks} free ({held})")
        return False

    def pay_checkpoints(self, uids: list[int]) -> None:
        """The step took checkpoints of these sequences' windows or recurrent layers: pay for each, making room
        as for the sequence's own positions, or drop it. (Without making room, a pool under steady pressure
        would keep no checkpoint at all, and every turn that diverged inside the cache would start over.)"""
        for uid in uids:
            turn = self.queues.running(uid)
            if turn is None or turn.holder is None or turn.holder.kv is None:
                continue
            holder = turn.holder
            self.hot.settle(holder)
            unpaid = self.hot.unpaid_blocks(holder)
            if unpaid:
                self.tiers.make_room(unpaid, self.queues.running_agents(), auxiliary_only=turn.request.auxiliary)
            self.hot.keep_checkpoint(holder)

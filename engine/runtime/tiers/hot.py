"""The hot tier: agents' resident caches, what the pool counts for them, and how a turn reuses them.

A hot agent's KV is a :class:`SequenceKV` in the layout the model consumes;
its turns run on it in place. The pool counts its arrays in blocks: an
agent holds exactly as many pool blocks, per layer group, as its arrays
(checkpoints included) occupy. Every method runs on the engine thread.

Reuse, in order of preference: the agent's own cache, cut back to where the
prompt diverges (a window layer can go back only to a checkpoint); else a
prefix of another hot agent's cache. A shared prefix is taken by reference:
the donor's whole blocks become a shared segment (``kv/segment.py``) held by
both, and only the partial block after it is copied (copy on write). Models
whose attention the engine cannot hook get a copy of the prefix instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from engine.domain.block_layout import common_prefix_length
from engine.domain.block_pool import BlockPool
from engine.domain.cache_spec import ModelCacheSpec
from engine.domain.prefix_index import HEAD_CHUNK, PrefixIndex

from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.runner.kv.kinds import MLX_KINDS, LayerKinds
from engine.runtime.runner.kv.segment import Segment
from engine.runtime.runner.kv.sequence_kv import SequenceKV
from engine.store.layer_slice import LayerSlice
from engine.runtime.runner.kv.disk_slices import load_slices

# Donors whose tokens are compared per admission; they share the same hashed
# prefix, so the first few are as good as any.
MAX_DONORS_CHECKED = 4
# The shortest prefix taken from another agent: below it a copy saves less than it costs.
MIN_SHARED_TOKENS = HEAD_CHUNK


class Holder(Protocol):
    """Whoever owns a resident cache and the pool blocks that pay for it."""

    kv: SequenceKV | None
    blocks: dict[int, list[int]]

    @property
    def owner(self) -> str: ...

    def hold_kv(self, kv: SequenceKV) -> None: ...

    def let_go(self) -> None:
        """Its cache and the blocks paying for it are given back."""
        ...


@dataclass(slots=True)
class SideCache:
    """A throwaway cache for a side request that must leave its agent's cache as it is."""

    owner: str
    kv: SequenceKV | None = None
    blocks: dict[int, list[int]] = field(default_factory=dict)

    def hold_kv(self, kv: SequenceKV) -> None:
        self.kv = kv

    def let_go(self) -> None:
        self.blocks, self.kv = {}, None


@dataclass(frozen=True, slots=True)
class ReusePlan:
    """How much of a prompt a hot cache can serve, decided before admission."""

    reused: int
    source: str  # "self", "shared:<agent>", "prefix:<key>", "none"
    note: str | None = None
    donor: str | None = None
    prefix: str | None = None  # the key of a shared prefix stored on disk


class HotCache:
    def __init__(self, spec: ModelCacheSpec, pool: BlockPool, share_by_reference: bool = True,
                 kinds: LayerKinds = MLX_KINDS) -> None:
        self.spec = spec
        self.pool = pool
        self.share_by_reference = share_by_reference
        # The layer-cache classes of the engine's compute backend (runner/kv/kinds.py).
        self.kinds = kinds
        self.prefix = PrefixIndex(spec.block_tokens)

    # -- planning ------------------------------------------------------------------------
    def plan_reuse(
        self, agent: AgentRecord, prompt: tuple[int, ...], donors: Callable[[str], AgentRecord | None] | None = None
    ) -> ReusePlan:
        """The longest prefix of ``prompt`` a hot cache can serve: the agent's own, else a donor's.

        ``donors`` looks up other agents for prefix sharing (None disables it).
        """
        own = self._own_plan(agent, prompt)
        if donors is None or own.reused >= len(prompt) - 1:
            return own
        shared = self._shared_plan(agent, prompt, donors)
        return shared if shared is not None and shared.reused > own.reused else own

    def _own_plan(self, agent: AgentRecord, prompt: tuple[int, ...]) -> ReusePlan:
        if agent.kv is None or not agent.tokens:
            return ReusePlan(0, "none")
        k = _usable_prefix(agent.tokens, prompt)
        if k <= 0:
            return ReusePlan(0, "none", note="cache diverges at the first token")
        resumable = agent.kv.resumable_at(k)
        recurrent = bool(self.spec.recurrent_groups)
        missed = agent.kv.dropped_between(resumable, k) if resumable < k else None
        # (Worded "of token", not "at token": forensics reads "snapshot at token" as a resume from a snapshot.)
        dropped = f"; the {'snapshot' if recurrent else 'checkpoint'} of token {missed[0]} was dropped: {missed[1]}" \
            if missed else ""
        if resumable == 0:
            what = "recurrent state has no snapshot at or before" if recurrent else "sliding-window cache cannot go back to"
            return ReusePlan(0, "none", note=f"{what} token {k}; full prefill{dropped}")
        if resumable == k:
            return ReusePlan(resumable, "self")
        if recurrent:
            note = f"recurrent state resumed from the snapshot at token {resumable} (prompt diverged at {k}){dropped}"
        else:
            note = (f"sliding-window layers resumed from the checkpoint at token {resumable} "
                    f"(prompt diverged at {k}){dropped}")
        return ReusePlan(resumable, "self", note=note)

    def _shared_plan(
        self, agent: AgentRecord, prompt: tuple[int, ...], donors: Callable[[str], AgentRecord | None]
    ) -> ReusePlan | None:
        best: ReusePlan | None = None
        nominated = [donor for donor, _ in self.prefix.candidates(prompt, exclude=agent.agent_id)]
        # No whole block in common: a shorter common head (a template's default system prompt) is
        # still worth a copy of a few positions instead of a prefill.
        nominated = nominated or self.prefix.head_candidates(prompt, exclude=agent.agent_id)
        for donor_id in nominated[:MAX_DONORS_CHECKED]:
            donor = donors(donor_id)
            if donor is None or donor.tier is not Tier.HOT or donor.kv is None:
                continue
            # Hashes nominate; only equal tokens decide.
            k = donor.kv.resumable_at(_usable_prefix(donor.tokens, prompt))
            if k >= MIN_SHARED_TOKENS and (best is None or k > best.reused):
                best = ReusePlan(k, f"shared:{donor_id}", donor=donor_id)
        return best

    # -- preparing a turn's cache ---------------------------------------------------------
    def continue_own(self, agent: AgentRecord, reused: int) -> int:
        """Cut the agent's cache back to ``reused`` tokens (0: start an empty cache); returns the tokens kept.

        Going back inside a shared prefix copies part of it into the agent's
        own arrays; if the pool cannot pay for that, the agent starts empty.
        """
        if agent.kv is not None and reused > 0:
            before = list(agent.kv.segments)
            agent.kv.continue_from(reused)
            self._unshare(agent, [seg for seg in before if seg not in agent.kv.segments])
            self.settle(agent)
            if not self.pay(agent):
                reused = 0
        if agent.kv is None or reused == 0:
            self.fresh(agent)
        agent.holds(agent.tokens[:reused])
        agent.move_to(Tier.HOT)
        self.publish(agent)
        return reused

    def share_prefix(self, holder: Holder, donor: AgentRecord, n_tokens: int) -> tuple[int, int]:
        """Take the donor's whole blocks before ``n_tokens`` by reference; returns (shared positions, bytes copied).

        ``holder`` must have a fresh cache. The donor's own blocks up to there
        become a segment first (a copy, once per prefix); the partial block
        after it is left for :meth:`copy_prefix`.
        """
        assert holder.kv is not None and donor.kv is not None
        if not self.share_by_reference:
            return 0, 0
        copied = 0
        upto = n_tokens // self.spec.block_tokens * self.spec.block_tokens
        if upto > donor.kv.base:
            before = donor.kv.copied
            segment = donor.kv.freeze(upto)
            copied = donor.kv.copied - before
            if segment is not None:
                self._hand_over(donor, segment)
        segments = [seg for seg in donor.kv.segments if seg.end <= upto]
        holder.kv.adopt(segments)
        ids = [b for seg in segments for b in seg.block_ids]
        if ids:
            self.pool.share(ids, holder.owner)
        return holder.kv.base, copied

    def _hand_over(self, donor: AgentRecord, segment: Segment) -> None:
        """The donor's own blocks for the segment's span now pay for the segment (the donor still holds them)."""
        for group in self.spec.global_groups:
            n = segment.length // self.spec.block_tokens * self.spec.group_units(group)
            ids = donor.blocks.get(group.index, [])
            segment.blocks[group.index], donor.blocks[group.index] = ids[:n], ids[n:]

    def _unshare(self, holder: Holder, segments: list[Segment]) -> None:
        ids = [b for seg in segments for b in seg.block_ids]
        if ids:
            self.pool.release(holder.owner, ids)

    def pay(self, holder: Holder) -> bool:
        """Pool blocks for arrays that already exist (a re-base, a new checkpoint); False: no room."""
        extra = self._unpaid(holder)
        if not extra:
            return True
        got = self.pool.allocate(holder.owner, extra)
        if got is None:
            return False
        for group, ids in got.items():
            holder.blocks.setdefault(group, []).extend(ids)
        return True

    def unpaid_blocks(self, holder: Holder) -> int:
        """Pool blocks ``pay(holder)`` would take."""
        return sum(self._unpaid(holder).values())

    def _unpaid(self, holder: Holder) -> dict[int, int]:
        assert holder.kv is not None
        have = holder.kv.capacity_blocks()
        return {g: n - len(holder.blocks.get(g, ())) for g, n in have.items() if n > len(holder.blocks.get(g, ()))}

    def fresh(self, holder: Holder) -> None:
        """Give ``holder`` a new empty cache, releasing whatever it held."""
        self.release(holder)
        holder.hold_kv(SequenceKV.empty(self.spec, self.kinds))

    def copy_prefix(self, holder: Holder, donor: SequenceKV, n_tokens: int) -> int:
        """Load the donor's first ``n_tokens`` positions into ``holder``'s cache (room reserved); bytes copied."""
        assert holder.kv is not None
        return holder.kv.copy_prefix_from(donor, n_tokens)

    # -- pool accounting ------------------------------------------------------------------
    def ensure(self, holder: Holder, n_tokens: int) -> bool:
        """Room for ``n_tokens`` positions: pool blocks first, then the arrays. False: no room now."""
        kv = holder.kv
        assert kv is not None
        self.settle(holder)
        target = kv.blocks_for(n_tokens)
        extra = {g: n - len(holder.blocks.get(g, ())) for g, n in target.items() if n > len(holder.blocks.get(g, ()))}
        if extra:
            got = self.pool.allocate(holder.owner, extra)
            if got is None:
                return False
            for group, ids in got.items():
                holder.blocks.setdefault(group, []).extend(ids)
        kv.reserve(n_tokens)
        return True

    def missing_blocks(self, holder: Holder, n_tokens: int) -> int:
        """Free pool blocks ``ensure(holder, n_tokens)`` would need."""
        assert holder.kv is not None
        target = holder.kv.blocks_for(n_tokens)
        return sum(max(0, n - len(holder.blocks.get(g, ()))) for g, n in target.items())

    def settle(self, holder: Holder) -> None:
        """Give back pool blocks the cache no longer occupies (dropped checkpoints, a smaller cache)."""
        target = holder.kv.capacity_blocks() if holder.kv is not None else {}
        for group, ids in list(holder.blocks.items()):
            surplus = len(ids) - target.get(group, 0)
            if surplus > 0:
                self.pool.release(holder.owner, ids[-surplus:])
                del ids[-surplus:]
            if not ids:
                del holder.blocks[group]

    def tidy(self, holder: Holder) -> None:
        """After a turn: shrink capacity a cut left unused, and give its blocks back."""
        if holder.kv is not None:
            holder.kv.shrink()
        self.settle(holder)

    def release(self, holder: Holder) -> int:
        """Return every pool block of ``holder`` (its own and its holds on shared segments); returns
        how many became free."""
        ids = [b for group in sorted(holder.blocks) for b in holder.blocks[group]]
        if holder.kv is not None:
            ids += [b for seg in holder.kv.segments for b in seg.block_ids]
        holder.let_go()
        return self.pool.release(holder.owner, ids) if ids else 0

    def keep_checkpoint(self, holder: Holder) -> bool:
        """Pay for a checkpoint just taken, or forget it when the pool has no room for it."""
        assert holder.kv is not None
        if self.pay(holder):
            return True
        holder.kv.drop_newest_checkpoint()
        return False

    def drop_checkpoint(self, agent: AgentRecord, keep: int = 0) -> bool:
        """Free the agent's least useful checkpoint (the pool needs room), sparing its newest ``keep``."""
        if agent.kv is None or not agent.kv.drop_oldest_checkpoint(keep):
            return False
        self.settle(agent)
        return True

    # -- agents in and out --------------------------------------------------------------------
    def publish(self, agent: AgentRecord) -> None:
        """Make the agent's cached tokens findable by other agents' prompts."""
        if agent.tokens:
            self.prefix.update(agent.agent_id, agent.tokens)
        else:
            self.prefix.remove(agent.agent_id)

    def load_prefix(self, holder: Holder, n_tokens: int, slices: list[LayerSlice]) -> None:
        """Fill ``holder``'s fresh cache (room reserved) with a shared prefix read from disk."""
        assert holder.kv is not None
        load_slices(holder.kv, n_tokens, slices)
        holder.kv.copied += sum(a.nbytes for s in slices for a in s.arrays)

    def install(self, agent: AgentRecord, tokens: list[int], slices: list[LayerSlice],
                checkpoints: list[dict[str, object]] | tuple = ()) -> bool:
        """Put a restored cache into the pool as the agent's (False: no room; nothing changed).

        Restored checkpoints are kept as far as the pool has room for them, oldest dropped first and the
        newest last (where the agent's next turn resumes when its last reply comes back as other tokens).
        """
        self.fresh(agent)
        if not self.ensure(agent, len(tokens)):
            self.release(agent)
            return False
        assert agent.kv is not None
        load_slices(agent.kv, len(tokens), slices, checkpoints)
        kv = agent.kv
        while not self.pay(agent) and (kv.drop_oldest_checkpoint(keep=1) or kv.drop_oldest_checkpoint()):
            self.settle(agent)
        agent.holds(list(tokens))
        agent.move_to(Tier.HOT)
        self.publish(agent)
        return True

    def drop(self, agent: AgentRecord) -> int:
        """Free the agent's hot cache; returns blocks returned to the pool."""
        freed = self.release(agent)
        agent.holds([])
        self.prefix.remove(agent.agent_id)
        return freed

    def exclusive_blocks(self, agent: AgentRecord) -> int:
        return self.pool.exclusive_blocks(agent.agent_id)


def _usable_prefix(cached: list[int], prompt: tuple[int, ...]) -> int:
    # The generator needs at least one prompt token to feed.
    return min(common_prefix_length(cached, prompt), len(prompt) - 1)

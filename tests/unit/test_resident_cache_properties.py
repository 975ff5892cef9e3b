"""The hot tier under random operation sequences: pool accounting is exact and no position moves.

No model runs here: every K/V entry written is the token id at that position
(``stamp``), so after any sequence of turns, cuts, shares, side copies,
checkpoint drops, spills and restores, each agent's cache must read back
exactly its token list, and the pool must count exactly the arrays alive.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.domain.block_pool import BlockPool
from engine.runtime.tiers.accounting import held_bytes
from engine.runtime.tiers.agents import AgentRecord, Tier
from engine.runtime.tiers.hot import HotCache, SideCache
from engine.runtime.runner.kv.full_kv import FullKV
from engine.runtime.runner.kv.sequence_kv import CheckpointKind, SequenceKV
from engine.runtime.runner.kv.window_kv import WindowKV
from engine.runtime.runner.kv.disk_slices import cache_slices, checkpoint_slices
from tests.support.tiny_models import loaded_tiny

pytestmark = pytest.mark.unit

AGENTS = ("a", "b", "c")
TOKENS = st.lists(st.integers(1, 9), min_size=1, max_size=40)


def stamp(kv: SequenceKV, tokens: list[int], chunk: int = 7) -> None:
    """Feed ``tokens`` to every layer as a model would, in chunks, K = V = the token id."""
    for start in range(0, len(tokens), chunk):
        part = tokens[start:start + chunk]
        for layer in kv.layers:
            shape = layer.shape
            k = mx.broadcast_to(mx.array(part, dtype=shape.dtype)[None, None, :, None], (1, shape.heads, len(part), shape.k_dim))
            layer.update_and_fetch(k, k)
        mx.eval([a for layer in kv.layers for a in (layer.keys, layer.values)])


def read_back(kv: SequenceKV, n: int) -> list[list[int]]:
    """Per layer, the token ids the cache holds for the positions it must keep (window layers: the tail)."""
    out = []
    for layer in kv.layers:
        if isinstance(layer, FullKV):
            keys, _ = layer.head(n)
            out.append(keys[0, 0, :, 0].astype(mx.int32).tolist())
        else:
            keys, _ = layer.recent(min(layer.held, n, layer.window - 1))
            out.append([] if keys is None else keys[0, 0, :, 0].astype(mx.int32).tolist())
    return out


def expected(kv: SequenceKV, tokens: list[int]) -> list[list[int]]:
    return [tokens if isinstance(layer, FullKV) else tokens[len(tokens) - min(layer.held, len(tokens), layer.window - 1):]
            for layer in kv.layers]


class HotCacheMachine(RuleBasedStateMachine):
    @initialize(kind=st.sampled_from(["llama", "gemma"]), blocks=st.integers(60, 200))
    def setup(self, kind: str, blocks: int) -> None:
        self.spec = loaded_tiny(kind).spec
        self.pool = BlockPool(blocks, self.spec.block_bytes, len(self.spec.groups))
        self.hot = HotCache(self.spec, self.pool)
        self.agents = {a: AgentRecord(a) for a in AGENTS}

    def hot_agents(self) -> list[AgentRecord]:
        return [a for a in self.agents.values() if a.kv is not None]

    def turn(self, agent: AgentRecord, reuse: int, new: list[int]) -> None:
        kept = self.hot.continue_own(agent, reuse)
        assert agent.kv is not None and agent.kv.offset == kept == len(agent.tokens)
        if not self.hot.ensure(agent, kept + len(new)):
            return  # no room: the cache stays as cut
        stamp(agent.kv, new)
        agent.tokens = agent.tokens + new
        agent.kv.take_checkpoint(CheckpointKind.TURN, 1)
        self.hot.settle(agent)  # an older checkpoint may have made room
        self.hot.keep_checkpoint(agent)
        self.hot.publish(agent)

    # -- rules ---------------------------------------------------------------------
    @rule(name=st.sampled_from(AGENTS), tokens=TOKENS)
    def first_turn(self, name: str, tokens: list[int]) -> None:
        self.turn(self.agents[name], 0, tokens)

    @precondition(lambda self: self.hot_agents())
    @rule(data=st.data(), new=TOKENS)
    def next_turn(self, data: st.DataObject, new: list[int]) -> None:
        agent = data.draw(st.sampled_from(self.hot_agents()))
        cut = data.draw(st.integers(1, max(1, len(agent.tokens))))
        assert agent.kv is not None
        self.turn(agent, agent.kv.resumable_at(cut), new)

    @precondition(lambda self: len(self.hot_agents()) >= 1)
    @rule(data=st.data(), name=st.sampled_from(AGENTS), tail=TOKENS)
    def share(self, data: st.DataObject, name: str, tail: list[int]) -> None:
        donor = data.draw(st.sampled_from(self.hot_agents()))
        agent = self.agents[name]
        if agent is donor or donor.kv is None:
            return
        k = donor.kv.resumable_at(data.draw(st.integers(1, len(donor.tokens))))
        if k == 0:
            return
        self.hot.fresh(agent)
        self.hot.share_prefix(agent, donor, k)
        if not self.hot.ensure(agent, k + len(tail)):
            self.hot.release(agent)
            agent.tokens = []
            return
        self.hot.copy_prefix(agent, donor.kv, k)
        agent.tokens = donor.tokens[:k]
        stamp(agent.kv, tail)
        agent.tokens = agent.tokens + tail
        self.hot.settle(agent)

    @precondition(lambda self: self.hot_agents())
    @rule(data=st.data(), extra=TOKENS)
    def side_request(self, data: st.DataObject, extra: list[int]) -> None:
        agent = data.draw(st.sampled_from(self.hot_agents()))
        assert agent.kv is not None
        k = agent.kv.resumable_at(len(agent.tokens))
        side = SideCache(f"{agent.agent_id}~side")
        self.hot.fresh(side)
        self.hot.share_prefix(side, agent, k)
        if self.hot.ensure(side, k + len(extra)):
            self.hot.copy_prefix(side, agent.kv, k)
            stamp(side.kv, extra)
            assert read_back(side.kv, k + len(extra)) == expected(side.kv, agent.tokens[:k] + extra)
        self.hot.release(side)

    @precondition(lambda self: self.hot_agents())
    @rule(data=st.data())
    def drop_checkpoint(self, data: st.DataObject) -> None:
        self.hot.drop_checkpoint(data.draw(st.sampled_from(self.hot_agents())))

    @precondition(lambda self: self.hot_agents())
    @rule(data=st.data())
    def spill_and_restore(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from(self.hot_agents()))
        assert agent.kv is not None
        tokens, slices = list(agent.tokens), cache_slices(agent.kv, len(agent.tokens))
        entries, at_checkpoints = checkpoint_slices(agent.kv)
        offsets = [c.offset for c in agent.kv.checkpoints]
        self.hot.drop(agent)
        agent.tier = Tier.WARM
        if not self.hot.install(agent, tokens, slices + at_checkpoints, entries):
            agent.tier = Tier.COLD
            return
        assert agent.kv is not None
        # Checkpoints come back unless the pool had no room for them (then the oldest go first).
        restored = [c.offset for c in agent.kv.checkpoints]
        assert restored == sorted(offsets)[len(offsets) - len(restored):]

    @precondition(lambda self: self.hot_agents())
    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        agent = data.draw(st.sampled_from(self.hot_agents()))
        self.hot.drop(agent)
        agent.tier = Tier.COLD

    # -- invariants ------------------------------------------------------------------
    @invariant()
    def pool_counts_exactly_the_arrays(self) -> None:
        if not hasattr(self, "hot"):
            return
        assert held_bytes(self.agents.values()) == self.pool.used_bytes

    @invariant()
    def every_agent_holds_its_blocks(self) -> None:
        if not hasattr(self, "hot"):
            return
        for agent in self.agents.values():
            assert sorted(agent.hot_block_ids()) == sorted(self.pool.blocks_of(agent.agent_id))

    @invariant()
    def caches_read_back_their_tokens(self) -> None:
        if not hasattr(self, "hot"):
            return
        for agent in self.hot_agents():
            assert agent.kv is not None
            assert agent.kv.offset == len(agent.tokens)
            assert read_back(agent.kv, len(agent.tokens)) == expected(agent.kv, agent.tokens)
            windows = [layer for layer in agent.kv.layers if isinstance(layer, WindowKV)]
            for checkpoint in agent.kv.checkpoints:
                assert checkpoint.offset <= len(agent.tokens)
                for layer, state in zip(windows, checkpoint.states):
                    ring = WindowKV(layer.shape, layer.block_tokens, layer.window)
                    ring.restore(state)
                    n = min(ring.held, checkpoint.offset, layer.window - 1)
                    keys, _ = ring.recent(n)
                    got = [] if keys is None else keys[0, 0, :, 0].astype(mx.int32).tolist()
                    assert got == agent.tokens[checkpoint.offset - n:checkpoint.offset]


TestHotCache = HotCacheMachine.TestCase
TestHotCache.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)

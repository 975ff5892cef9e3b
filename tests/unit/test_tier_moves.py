"""An agent's tier changes in one place (AgentRecord.move_to), held to one table (TIER_MOVES)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from engine.runtime.tiers.agents import TIER_MOVES, AgentRecord, IllegalTierMove, Tier

pytestmark = pytest.mark.unit

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def at(tier: Tier) -> AgentRecord:
    return AgentRecord("a", tier=tier)


@pytest.mark.parametrize("start", list(Tier))
def test_every_move_the_table_names_is_made_and_every_other_refused(start: Tier) -> None:
    for end in Tier:
        agent = at(start)
        if end in TIER_MOVES[start]:
            agent.move_to(end)
            assert agent.tier is end
        else:
            with pytest.raises(IllegalTierMove, match=f"{start.value} -> {end.value}"):
                agent.move_to(end)
            assert agent.tier is start


def test_only_a_cache_in_the_pool_becomes_cool() -> None:
    assert {start for start in Tier if Tier.COOL in TIER_MOVES[start]} == {Tier.HOT, Tier.COOL}
    assert set(TIER_MOVES) == set(Tier)


def _tier_assignments(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        targets: list[ast.expr] = []
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and part.attr == "tier" and isinstance(part.ctx, ast.Store):
                    lines.append(node.lineno)
    return lines


def test_no_engine_module_but_the_records_own_sets_a_tier() -> None:
    owner = ENGINE / "runtime" / "tiers" / "agents.py"
    found = {str(path.relative_to(ENGINE.parent)): lines for path in ENGINE.rglob("*.py")
             if path != owner and (lines := _tier_assignments(ast.parse(path.read_text())))}
    assert found == {}, f"set a tier through AgentRecord.move_to: {found}"
    assert _tier_assignments(ast.parse(owner.read_text())), "the owner's own assignment is what this test finds"

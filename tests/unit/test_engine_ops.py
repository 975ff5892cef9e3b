"""The engine's agent commands as typed records: each calls its own ``AgentOps`` method with its arguments,
and survives the pickling that carries it to a sharded model's other ranks."""

from __future__ import annotations

import inspect
import pickle
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from engine.domain.requests import AgentSource
from engine.runtime.engine_thread import engine_ops
from engine.runtime.engine_thread.agent_ops import AgentOps
from engine.runtime.engine_thread.engine_ops import (AdoptAgent, CheckImport, DeleteAgent, EngineOp, EvictAgent,
                                                     EvictIdle, ForkAgent, HoldAgent, PauseAgent, PinAgent,
                                                     RewindAgent, SetAgentPriority, WriteAgent)
from engine.runtime.tiers.agents import Tier

pytestmark = pytest.mark.unit

OPS: list[tuple[EngineOp, str, tuple[Any, ...]]] = [
    (EvictAgent("a", Tier.COLD), "evict_agent", ("a", Tier.COLD)),
    (EvictIdle(), "evict_idle", (Tier.WARM,)),
    (PinAgent("a", True), "pin_agent", ("a", True)),
    (DeleteAgent("a"), "delete_agent", ("a",)),
    (SetAgentPriority("a", None), "set_agent_priority", ("a", None)),
    (PauseAgent("a", False), "pause_agent", ("a", False)),
    (HoldAgent("a", 2.5), "hold_agent", ("a", 2.5)),
    (ForkAgent("a", "b", display_name="fork", source_kind=AgentSource.API), "fork_agent",
     ("a", "b", None, None, "fork", AgentSource.API)),
    (RewindAgent("a", 2, (1, 2)), "rewind_agent", ("a", 2, (1, 2))),
    (WriteAgent("a"), "write_agent", ("a",)),
    (CheckImport("a", True), "check_import", ("a", True)),
    (AdoptAgent(Path("x.safetensors")), "adopt_agent", (Path("x.safetensors"),)),
]


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.calls.append((name, args)) or name


class Engine:
    def __init__(self) -> None:
        self.ops = Recorder()


@pytest.mark.parametrize(("op", "method", "args"), OPS, ids=[type(op).__name__ for op, _, _ in OPS])
def test_each_op_calls_its_agent_ops_method_with_its_arguments_after_a_pickle_round_trip(
        op: EngineOp, method: str, args: tuple[Any, ...]) -> None:
    engine = Engine()
    carried = pickle.loads(pickle.dumps(op))
    assert carried == op
    assert carried(engine) == method
    assert engine.ops.calls == [(method, args)]
    # The record's fields are the method's parameters, in order: nothing dropped on the way.
    parameters = list(inspect.signature(getattr(AgentOps, method)).parameters)[1:]
    assert [f.name for f in fields(op)] == parameters


def test_every_public_agent_ops_method_has_an_op_and_every_op_is_listed() -> None:
    methods = {name for name, _ in inspect.getmembers(AgentOps, inspect.isfunction) if not name.startswith("_")}
    classes = {c for _, c in inspect.getmembers(engine_ops, inspect.isclass)
               if issubclass(c, EngineOp) and c is not EngineOp}
    assert {method for _, method, _ in OPS} == methods
    assert {type(op) for op, _, _ in OPS} == classes


def test_ops_are_records_that_cannot_change_on_the_way() -> None:
    op = EvictAgent("a", Tier.WARM)
    with pytest.raises(AttributeError):
        op.agent_id = "b"  # type: ignore[misc]

"""The house's seams are typed: no constructor takes a crowd of parameters, the scheduler calls its batch
through the protocol it names (never probing it), and the engine loop runs lockstep through its ranks, not
through branches of its own.

(That both compute backends implement one protocol, neither deriving from the other, is
test_compute_backends.py's.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
MAX_PARAMETERS = 8


def _tree(relative: str) -> ast.Module:
    return ast.parse((ROOT / relative).read_text(), relative)


def _parameters(function: ast.FunctionDef) -> int:
    args = function.args
    named = len(args.posonlyargs) + len(args.args) + len(args.kwonlyargs) - 1  # less self
    return named + (args.vararg is not None) + (args.kwarg is not None)


def test_no_constructor_takes_more_than_eight_parameters() -> None:
    """Every class's own ``__init__`` under engine/, semantic_tui/ and semantic_cli/ (a dataclass's fields are a
    record, not a constructor's dependencies, and are not counted)."""
    crowded = []
    for package in ("engine", "semantic_tui", "semantic_cli"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.FunctionDef) and node.name == "__init__" and _parameters(node) > MAX_PARAMETERS:
                    crowded.append(f"{path.relative_to(ROOT)}:{node.lineno} ({_parameters(node)} parameters)")
    assert crowded == []


def test_the_scheduler_never_probes_its_batch() -> None:
    """The scheduler names the batch's protocol (runner/stepped_batch.py) and calls it: no ``hasattr`` or
    ``getattr`` on it."""
    tree = _tree("engine/runtime/scheduler/scheduler.py")
    probes = [node.lineno for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in {"hasattr", "getattr"}]
    assert probes == []
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    assert "SteppedBatch" in names


def test_the_engine_loop_runs_lockstep_through_its_ranks() -> None:
    """Only the engine's constructor knows lockstep exists (it picks the ranks: alone or a replica); no other
    method of Engine names the lockstep, the replica, or tests whether there is one."""
    tree = _tree("engine/runtime/engine_thread/engine.py")
    (engine,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Engine"]
    offenders = []
    for method in (node for node in engine.body if isinstance(node, ast.FunctionDef) and node.name != "__init__"):
        for node in ast.walk(method):
            name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
            if name is not None and ("lockstep" in name.lower() or "replica" in name.lower()):
                offenders.append(f"{method.name}:{node.lineno} {name}")
    assert offenders == []


def _assigned_attributes(package: str, skip: str) -> list[tuple[str, int, ast.Attribute]]:
    """Every attribute assigned (``x.a = ``, ``x.a += ``, ``x.a, y.b = ``) in the modules under ``package``
    but ``skip``: (the module's path, the line, the target)."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        if relative == skip:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
            for target in targets:
                for part in (target.elts if isinstance(target, ast.Tuple) else [target]):
                    if isinstance(part, ast.Attribute):
                        found.append((relative, node.lineno, part))
    return found


def test_a_turn_changes_only_through_its_own_methods() -> None:
    """No module of the runtime but turn.py assigns a field of a Turn (a variable named ``turn``, ``t`` or
    ``..._turn`` whose assigned attribute is a Turn field): the scheduler's parts call Turn's methods."""
    import dataclasses

    from engine.runtime.scheduler.turn import Turn

    fields = {f.name for f in dataclasses.fields(Turn)}
    writes = [f"{path}:{line} {target.value.id}.{target.attr}"
              for path, line, target in _assigned_attributes("engine/runtime", "engine/runtime/scheduler/turn.py")
              if isinstance(target.value, ast.Name) and target.attr in fields
              and (target.value.id in {"turn", "t"} or target.value.id.endswith("_turn"))]
    assert writes == []


def test_an_agent_record_changes_only_through_its_own_methods() -> None:
    """No module of the engine but tiers/agents.py assigns a field of an AgentRecord (a variable named
    ``agent``, ``record``, ``fork``, ``holder``, ``donor`` or ``source``, or ``<x>.agent``, whose assigned
    attribute is an AgentRecord field): what happens to an agent is AgentRecord's methods."""
    import dataclasses

    from engine.runtime.tiers.agents import AgentRecord

    fields = {f.name for f in dataclasses.fields(AgentRecord)}
    names = {"agent", "record", "fork", "holder", "donor", "source"}
    writes = [f"{path}:{line} .{target.attr}"
              for path, line, target in _assigned_attributes("engine", "engine/runtime/tiers/agents.py")
              if target.attr in fields
              and ((isinstance(target.value, ast.Name) and target.value.id in names)
                   or (isinstance(target.value, ast.Attribute) and target.value.attr == "agent"))]
    assert writes == []

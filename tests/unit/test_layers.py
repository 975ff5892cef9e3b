"""The import graph points one way: domain <- models <- grammar <- formats <- store <- runtime <- api <- workbench <- CLI.

Every import of every module counts, at the top of a file, inside a function
or under ``TYPE_CHECKING``: a lower layer that names a higher one, even
lazily, has learnt about it. Inside the runtime the same holds by role: the
model runner <- the cache tiers <- the scheduler <- the engine thread. Inside
a layer the modules form no circle either (bench/'s scripts included): two
modules that import each other are one job split in two, or one that should
be handed what it needs.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engine", "semantic_tui", "semantic_cli")

# Lowest first; a module may import its own layer and the ones before it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("engine.errors", "engine.settings", "engine.domain"),
    ("engine.distributed",),
    ("engine.platform",),
    ("engine.models",),
    ("engine.grammar",),
    ("engine.formats",),
    ("engine.store",),
    ("engine.runtime.clock", "engine.runtime.meters", "engine.runtime.memory_pressure"),
    ("engine.runtime.runner",),
    ("engine.runtime.tiers",),
    ("engine.runtime.scheduler",),
    ("engine.runtime.engine_thread",),
    ("engine.logging_setup", "engine.bootstrap", "engine.follower", "engine.swap", "engine.resident_models"),
    ("engine.api",),
    ("semantic_tui",),
    ("semantic_cli",),
)


# Package roots that hold nothing but their docstring.
ROOTS = {"engine": 0, "engine.runtime": 5}


def layer_of(module: str) -> int:
    if module in ROOTS:
        return ROOTS[module]
    best, level = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, level = len(prefix), index
    if level is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS")
    return level


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            found[module_name(path)] = path
    return found


def imports_of(path: Path, module: str) -> set[str]:
    """Every project module ``module`` names in an import statement, wherever the statement stands."""
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    named: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            named |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            named.add(base)
            named |= {f"{base}.{alias.name}" for alias in node.names}
    return {name for name in named if name.split(".")[0] in PACKAGES}


def resolved_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Each module's project imports as modules (``from a.b import c`` names ``a.b.c`` if that is a module, else
    ``a.b``); a package's own ``__init__`` is not counted as an import of its submodules' names."""
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = set()
        for name in imports_of(path, module):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def bench_modules() -> dict[str, Path]:
    """bench/'s modules, ``bench.NAME`` (run as ``python -m bench.NAME``)."""
    return {f"bench.{path.stem}": path for path in sorted((ROOT / "bench").glob("*.py")) if path.stem != "__init__"}


def bench_imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which bench modules each imports: ``from bench.NAME import ...``, ``from bench import NAME``, and a
    sibling's bare name (which only a script run from inside bench/ could resolve)."""
    graph = {}
    for module, path in modules.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                named |= {alias.name for alias in node.names} | {f"bench.{a.name}" for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                if node.module == "bench":
                    named |= {f"bench.{alias.name}" for alias in node.names}
                else:
                    named |= {".".join(node.module.split(".")[:2]), f"bench.{node.module.split('.')[0]}"}
        graph[module] = {name for name in named if name in modules} - {module}
    return graph


def bare_sibling_imports(modules: dict[str, Path]) -> list[str]:
    """Imports of a bench module by its bare name (``from common import ...``)."""
    bare = {name.removeprefix("bench.") for name in modules}
    found = []
    for module, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else [])
            found += [f"{module}: {name}" for name in names if name.split(".")[0] in bare]
    return found


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of ``graph`` with more than one module (Tarjan's algorithm), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            part = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                part.append(member)
                if member == node:
                    break
            if len(part) > 1:
                circles.append(sorted(part))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(circles)


def upward_imports() -> list[str]:
    modules = project_modules()
    found = []
    for module, path in sorted(modules.items()):
        mine = layer_of(module)
        for target in sorted(imports_of(path, module)):
            if target not in modules and target.rsplit(".", 1)[0] in modules:
                continue  # a name imported from a module (its module is checked on its own)
            if target in modules and layer_of(target) > mine:
                found.append(f"{module} -> {target}")
    return found


def test_no_module_imports_a_higher_layer() -> None:
    assert upward_imports() == []


def test_the_walk_would_see_an_upward_import(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check itself: a store module that imports the runtime lazily, inside a function, is caught."""
    bad = ROOT / "engine" / "store" / "_upward_probe.py"
    bad.write_text("def f():\n    from engine.runtime.tiers.hot import HotCache\n    return HotCache\n")
    try:
        assert "engine.store._upward_probe -> engine.runtime.tiers.hot" in upward_imports()
    finally:
        bad.unlink()


def test_no_modules_import_each_other_round_a_circle() -> None:
    assert import_circles(resolved_imports(project_modules())) == []
    assert import_circles(bench_imports(bench_modules())) == []


def test_bench_modules_import_each_other_as_a_package() -> None:
    """``python -m bench.NAME`` from the root needs ``from bench.common import ...``: a bare sibling name resolves
    only for a script run from inside bench/. And the walk above sees the package form's edges."""
    modules = bench_modules()
    assert bare_sibling_imports(modules) == []
    graph = bench_imports(modules)
    assert "bench.common" in graph["bench.bench_engine"] and "bench.results" in graph["bench.bench_engine"]


def test_the_circle_walk_finds_a_circle_through_several_modules() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"e"}}
    assert import_circles(graph) == [["a", "b", "c"]]


def test_the_domain_is_pure_python() -> None:
    """No MLX, numpy or other third-party package below the models: the domain's tests need none."""
    allowed = set(sys.stdlib_module_names) | {"engine"}
    for module, path in project_modules().items():
        if layer_of(module) != 0 or module.startswith("engine.settings"):
            continue  # (settings is pydantic's, by design)
        tree = ast.parse(path.read_text())
        roots = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                 for alias in node.names}
        roots |= {node.module.split(".")[0] for node in ast.walk(tree)
                  if isinstance(node, ast.ImportFrom) and node.module and not node.level}
        assert roots <= allowed, f"{module} imports {sorted(roots - allowed)}"


def test_the_store_is_handed_plain_facts_of_the_model_never_the_loaded_model() -> None:
    """The cache files check a model's identity, layout and cache classes (store/stored_model.py); only the one
    function that reads those facts off a loaded model may name it."""
    names = {}
    for module, path in project_modules().items():
        if module.startswith("engine.store.") and module != "engine.store.stored_model":
            tree = ast.parse(path.read_text())
            named = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                     and node.module == "engine.models.loaded" for alias in node.names}
            if "LoadedModel" in named:
                names[module] = sorted(named)
    assert names == {}


def test_the_cache_file_package_is_used_through_its_public_face() -> None:
    """Outside engine/store/cache_file/, code imports ``engine.store.cache_file`` itself, never one of its modules
    (their un-underscored names are the package's internal API); inside, no module imports another's _name."""
    inside = "engine.store.cache_file"
    reached, private = [], []
    for module, path in project_modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(inside + "."):
                if not module.startswith(inside):
                    reached.append(f"{module} -> {node.module}")
                private += [f"{module} -> {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert reached == [] and private == []


def test_importing_the_lower_layers_loads_nothing_of_the_runtime_or_the_api() -> None:
    code = ("import sys, engine.domain, engine.models.loader, engine.store.warm_store, engine.store.agent_export; "
            "print(sorted(m for m in sys.modules if m.startswith(('engine.runtime', 'engine.api'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"

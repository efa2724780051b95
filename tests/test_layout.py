"""The package layout is the architecture: a written layer order over every module, no import
cycles, and the runtime never imports the tools.

``LAYERS`` lists every module of ``src/adaspec`` from the bottom up; a module may import
modules of its own layer and of the layers below, never above, and no chain of imports may
lead back to where it started. Checked statically on every import statement, lazy ones inside
functions included. Importing ``a.b.c`` also runs the package ``a.b`` (its ``__init__``), so
such an import is an edge to each package above the module imported that is not one of the
importer's own packages; the package root ``adaspec/__init__.py`` (the public facade, the top
layer) is left out of that rule, as every import of the package runs it first.
"""

import ast
import fnmatch
from pathlib import Path

import adaspec

PKG = Path(adaspec.__file__).parent
TOOLS = ("bench", "training", "cli", "serve", "integrations")
# which tool packages each group may import
ALLOWED = {"runtime": set(), "bench": {"bench"}, "training": {"training", "bench"}, "cli": set(TOOLS),
           "serve": set(), "integrations": set()}

#: the layers, bottom first: (name, module patterns relative to ``adaspec``; "" is the root)
LAYERS = [
    ("foundations", ["errors", "config", "version", "registry", "persist"]),
    ("maths and machine", ["sampling", "exactness", "metrics", "kernels", "quant", "artifacts", "progress", "trees"]),
    ("backends", ["backends", "backends.*"]),
    ("models", ["models", "pools"]),
    ("drafters", ["drafters", "drafters.*"]),
    ("feedback", ["feedback"]),
    ("costs", ["costs"]),
    ("length policies", ["length", "length.*"]),
    ("selectors", ["selection", "selection.*"]),
    ("the round", ["round"]),
    ("the scheduler", ["batch"]),
    ("the engine", ["engine"]),
    ("option checks", ["options"]),
    ("measuring", ["bench", "bench.*"]),
    ("tools", ["training", "training.*", "serve", "serve.*", "integrations", "integrations.*"]),
    ("command line", ["cli", "cli.*"]),
    ("public facade", [""]),
]


def _group(path: Path) -> str:
    top = path.relative_to(PKG).parts[0]
    return top if top in TOOLS else "runtime"


def _imported_tools(path: Path, root: Path = PKG) -> set[str]:
    """Top-level adaspec subpackages an adaspec module imports (relative or absolute)."""
    module = path.relative_to(root).with_suffix("").parts
    package = module[:-1] if module[-1] != "__init__" else module[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[tuple[str, ...]] = []
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
                target = base + tuple(node.module.split(".")) if node.module else base
                names = [target] if target else [(alias.name,) for alias in node.names]
            elif node.module and node.module.startswith("adaspec."):
                names = [tuple(node.module.split(".")[1:])]
        elif isinstance(node, ast.Import):
            names = [tuple(a.name.split(".")[1:]) for a in node.names if a.name.startswith("adaspec.")]
        found |= {n[0] for n in names if n and n[0] in TOOLS}
    return found


# -- the module graph ----------------------------------------------------------------------------
def _modules(root: Path) -> dict[str, Path]:
    """Module name (relative to the package, "" for its root) -> file."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def module_graph(root: Path = PKG) -> dict[str, set[str]]:
    """Every module's imports of other modules of the package (see the module docstring)."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        own = [] if not name else name.split(".")
        package = own if path.name == "__init__.py" else own[:-1]
        ancestors = {".".join(own[:i]) for i in range(len(own) + 1)}
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            found: list[str] = []
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[: len(package) - (node.level - 1)]
                    mod = ".".join(base + (node.module.split(".") if node.module else []))
                elif node.module and (node.module == "adaspec" or node.module.startswith("adaspec.")):
                    mod = node.module.partition(".")[2]
                else:
                    continue
                subs = [f"{mod}.{a.name}".lstrip(".") for a in node.names if f"{mod}.{a.name}".lstrip(".") in modules]
                found += subs
                if len(subs) < len(node.names):
                    found.append(mod)
            elif isinstance(node, ast.Import):
                found += [a.name.partition(".")[2] for a in node.names
                          if a.name == "adaspec" or a.name.startswith("adaspec.")]
            for mod in found:
                parts = mod.split(".") if mod else []
                for i in range(1, len(parts) + 1):  # the module and the packages it runs
                    above = ".".join(parts[:i])
                    if above in modules and (above == mod or above not in ancestors):
                        targets.add(above)
                if not mod:
                    targets.add("")  # the package root itself, imported by name
        targets.discard(name)
        graph[name] = targets
    return graph


def layer_of(module: str) -> int | None:
    """The index of the layer ``module`` is in (None: in none)."""
    for i, (_, patterns) in enumerate(LAYERS):
        if any(module == p or (p and fnmatch.fnmatchcase(module, p)) for p in patterns):
            return i
    return None


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a module of a higher layer, as 'importer (layer) -> imported (layer)'."""
    bad = []
    for name, targets in sorted(graph.items()):
        mine = layer_of(name)
        for t in sorted(targets):
            theirs = layer_of(t)
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{name or 'adaspec'} ({LAYERS[mine][0]}) -> {t or 'adaspec'} ({LAYERS[theirs][0]})")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


# -- the checks ----------------------------------------------------------------------------------
def test_runtime_never_imports_the_tools():
    bad = {}
    for path in sorted(PKG.rglob("*.py")):
        group = _group(path)
        extra = _imported_tools(path) - ALLOWED[group] - {group}
        if extra:
            bad[str(path.relative_to(PKG))] = sorted(extra)
    assert not bad, f"imports across the layering: {bad}"


def test_the_checker_sees_relative_and_lazy_imports(tmp_path):
    # a negative control: the same walk flags a runtime module that imports bench lazily
    (tmp_path / "drafters").mkdir()
    lazy = tmp_path / "drafters" / "probe.py"
    lazy.write_text("def f():\n    from ..bench.runner import run_bench\n    return run_bench\n")
    absolute = tmp_path / "engine.py"
    absolute.write_text("import adaspec.training.pool\nfrom . import cli\n")
    assert _imported_tools(lazy, tmp_path) == {"bench"}
    assert _imported_tools(absolute, tmp_path) == {"training", "cli"}


def test_every_module_has_a_layer():
    missing = [m or "adaspec" for m in _modules(PKG) if layer_of(m) is None]
    assert not missing, f"modules in no layer of LAYERS (place them in tests/test_layout.py): {missing}"


def test_no_module_imports_a_higher_layer():
    bad = upward_imports(module_graph())
    assert not bad, "imports up the layer order:\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(module_graph())
    assert not found, f"import cycles (lazy imports included): {found}"


def test_the_layer_and_cycle_checks_catch_an_injected_import(tmp_path):
    """Negative control: a copy of the package with one lazy upward import (``costs`` asking
    ``engine`` for something, as a cost model that priced with the engine would) fails both
    checks; the copy without it passes."""
    pkg = tmp_path / "adaspec"
    for name, path in _modules(PKG).items():
        dest = pkg / path.relative_to(PKG)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    graph = module_graph(pkg)
    assert not upward_imports(graph) and not cycles(graph)
    costs = pkg / "costs.py"
    costs.write_text(costs.read_text(encoding="utf-8") + "\n\ndef _probe():\n    from .engine import SpeculativeEngine\n"
                     "    return SpeculativeEngine\n", encoding="utf-8")
    graph = module_graph(pkg)
    assert "costs (costs) -> engine (the engine)" in upward_imports(graph)
    assert any({"costs", "engine"} <= set(c) for c in cycles(graph))
    # a submodule import runs its package: a cycle through a package's __init__ is one too
    (pkg / "length" / "probe.py").write_text("from ..selection.base import DrafterPolicy\n", encoding="utf-8")
    (pkg / "length" / "__init__.py").write_text("from .probe import DrafterPolicy\n", encoding="utf-8")
    assert any({"length", "selection"} <= set(c) for c in cycles(module_graph(pkg)))


def test_public_api_names():
    from adaspec import SpeculativeEngine, build_drafter, load_model  # noqa: F401
    from adaspec.bench.runner import run_bench  # noqa: F401
    from adaspec.bench.workloads import load_workload  # noqa: F401
    from adaspec.training.pool import build_pool  # noqa: F401

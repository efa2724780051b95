"""The package layout is the architecture: the runtime never imports the tools.

Runtime = the modules at the package root plus drafters/, selection/ and length/; tools =
bench/ (measuring), training/ (building drafters offline), cli/ (the command line). Checked
statically on every import statement, lazy ones inside functions included.
"""

import ast
from pathlib import Path

import adaspec

PKG = Path(adaspec.__file__).parent
TOOLS = ("bench", "training", "cli", "serve", "integrations")
# which tool packages each group may import
ALLOWED = {"runtime": set(), "bench": {"bench"}, "training": {"training", "bench", "cli"}, "cli": set(TOOLS),
           "serve": set(), "integrations": set()}


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


def test_public_api_names():
    from adaspec import SpeculativeEngine, build_drafter, load_model  # noqa: F401
    from adaspec.bench.runner import run_bench  # noqa: F401
    from adaspec.bench.workloads import load_workload  # noqa: F401
    from adaspec.training.pool import build_pool  # noqa: F401

"""The layers point one way: algorithm packages never import the engine or anything above it.

An AST scan of every module under the algorithm packages (imports inside functions included), so a lazy import
cannot hide an upward arrow. The negative control runs the same scan on a module written to break the rule.
"""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "specgraft"
ALGORITHMS = ("core", "drafters", "eagle", "graft", "lossy", "backends")
ABOVE = ("engine", "registry", "auto", "backend_choice", "reference", "eval", "serve", "cli", "tools", "request",
         "costs")


def imported(path: Path, root: Path = PACKAGE) -> set[str]:
    """Top-level ``specgraft`` modules that ``path`` imports (relative imports resolved against its package)."""
    parts = path.relative_to(root.parent).with_suffix("").parts  # ("specgraft", "graft", "drafter")
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = parts[: len(parts) - node.level]
                names = [*base, *(node.module.split(".") if node.module else [])]
                targets = [names] if node.module else [[*base, a.name] for a in node.names]
            else:
                targets = [(node.module or "").split(".")]
        elif isinstance(node, ast.Import):
            targets = [a.name.split(".") for a in node.names]
        else:
            continue
        for t in targets:
            if len(t) >= 2 and t[0] == "specgraft":
                out.add(t[1])
    return out


def upward(path: Path, root: Path = PACKAGE) -> set[str]:
    return imported(path, root) & set(ABOVE)


@pytest.mark.parametrize("package", ALGORITHMS)
def test_algorithm_packages_import_nothing_above_them(package):
    bad = {str(p.relative_to(PACKAGE)): sorted(upward(p)) for p in (PACKAGE / package).rglob("*.py") if upward(p)}
    assert not bad, f"upward imports: {bad}"


def test_core_imports_only_core_and_the_leaves():
    leaves = {"core", "errors"}
    bad = {str(p.relative_to(PACKAGE)): sorted(imported(p) - leaves) for p in (PACKAGE / "core").rglob("*.py")
           if imported(p) - leaves}
    assert not bad, f"core imports above itself: {bad}"


def test_the_scan_finds_an_upward_import(tmp_path):
    """Negative control: a module with a lazy relative import of the engine and one absolute import of the
    registry is caught."""
    fake = tmp_path / "specgraft" / "graft"
    fake.mkdir(parents=True)
    module = fake / "tool.py"
    module.write_text("from ..core.tree import Tree\n\ndef f():\n    from ..engine import Engine\n"
                      "    import specgraft.registry\n")
    assert upward(module, tmp_path / "specgraft") == {"engine", "registry"}

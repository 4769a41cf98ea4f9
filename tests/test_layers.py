"""The package's layers hold: no module imports a pass but the pipeline (passes are only graph rewrites; what other
modules share with them lives below them, as weight_quantization and weight_store do)."""

import ast
from pathlib import Path

import fxquant
from fxquant.pipeline import PASS_TYPES

PACKAGE = Path(fxquant.__file__).parent


def imported_modules(path: Path) -> set[str]:
    """Every module path.py names in an import, with each imported name appended (from m import n -> m, m.n)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return names


def test_no_module_but_the_pipeline_imports_a_pass():
    passes = {pass_type.__module__ for pass_type in PASS_TYPES}
    assert len(passes) == len(PASS_TYPES) and all(name.startswith("fxquant.passes.") for name in passes)
    found = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        reached = {name for name in imported_modules(path) if name in passes} - {module}
        if reached and module != "fxquant.pipeline":
            found[module] = sorted(reached)
    assert not found, f"modules importing passes (move what they share below the passes): {found}"

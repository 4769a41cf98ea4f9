"""The package's layers hold (docs/architecture.md): each layer imports only the layers below it, the top level holds
the public API and a few modules, and no module imports a pass but the pipeline (passes are only graph rewrites; what
other modules share with them lives below them, as weight_quantization and weight_store do)."""

import ast
from pathlib import Path

import fxquant
from fxquant.compile.pipeline import PASS_TYPES

PACKAGE = Path(fxquant.__file__).parent
# Lowest first: a module may import its own layer and those before it.
LAYERS = ("numerics", "kernels", "ops", "quantization", "passes", "compile", "modules", "io", "api")
TOP_LEVEL = {"config": "numerics", "decode_loop": "modules", "generation": "modules", "__main__": "io",
             "api": "api", "__init__": "api"}


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
        if reached and module != "fxquant.compile.pipeline":
            found[module] = sorted(reached)
    assert not found, f"modules importing passes (move what they share below the passes): {found}"


def layer_of(module: str) -> str:
    """fxquant.<package>.x -> its package's layer; fxquant.<module>[.name] -> TOP_LEVEL's; fxquant -> the API."""
    parts = module.split(".")[1:]
    return TOP_LEVEL.get(parts[0], parts[0]) if parts else "api"


def test_each_layer_imports_only_its_own_and_those_below():
    found = []
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        mine = layer_of(module)
        assert mine in LAYERS, f"{module} is in no layer: place it in a package, or in TOP_LEVEL"
        for name in imported_modules(path):
            if name.startswith("fxquant.") and name.count(".") == 1 and name.split(".")[1] not in TOP_LEVEL:
                continue  # `from fxquant import numerics` names a package, reached through a module below
            if name.startswith("fxquant.") and LAYERS.index(layer_of(name)) > LAYERS.index(mine):
                found.append(f"{module} ({mine}) imports {name} ({layer_of(name)})")
    assert not found, found


def test_the_top_level_holds_the_api_and_at_most_a_dozen_modules():
    top = sorted(path.stem for path in PACKAGE.glob("*.py"))
    assert len(top) <= 12 and set(top) <= set(TOP_LEVEL), top

"""Every bench module imports on the CPU: a name the product renamed or removed fails here, not on the device."""

import importlib
import pathlib

import pytest

MODULES = sorted(p.stem for p in pathlib.Path(__file__).parents[1].glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("module", MODULES)
def test_the_bench_module_imports(module):
    assert importlib.import_module(f"bench.{module}").__doc__, f"bench/{module}.py: say what it measures"

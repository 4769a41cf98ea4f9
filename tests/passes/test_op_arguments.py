"""Passes read and write op arguments by the names the op's schema declares."""
import pytest
import torch

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.passes.op_arguments import arguments, with_arguments

SCALED_MM = torch.ops.fxquant.scaled_mm_fp8.default


def scaled_mm_node():
    graph = torch.fx.Graph()
    a, a_scale, w, w_scale = (graph.placeholder(name) for name in ("a", "a_scale", "w", "w_scale"))
    return graph, graph.call_function(SCALED_MM, (a, a_scale, w, w_scale), {"bias": None, "out_dtype": torch.bfloat16})


def test_arguments_are_named_by_the_schema_positional_and_keyword_alike():
    _, node = scaled_mm_node()
    named = arguments(node)
    assert list(named) == ["a", "a_scale", "w", "w_scale", "bias", "out_dtype"]
    assert named["w_scale"].name == "w_scale" and named["out_dtype"] is torch.bfloat16


def test_with_arguments_replaces_by_name_and_refuses_a_name_the_op_lacks():
    graph, node = scaled_mm_node()
    other = graph.placeholder("other")
    args = with_arguments(node, w=other)
    assert args[2] is other and args[3] is node.args[3] and args[5] is torch.bfloat16  # in schema order
    with pytest.raises(ValueError, match=r"has no argument \['weight'\]; it takes a, a_scale, w, w_scale"):
        with_arguments(node, weight=other)

"""The graph edit the fusing passes share: one call replaces a node and the nodes only it read."""

from __future__ import annotations

import torch


def replace_with_call(gm: torch.fx.GraphModule, node: torch.fx.Node, target, args: tuple,
                      dead: tuple = ()) -> torch.fx.Node:
    """call_function(target, args) where `node` was: it takes node's meta (its fake value) and users; node, then
    the `dead` nodes that only the erased ones read, are erased."""
    with gm.graph.inserting_before(node):
        new = gm.graph.call_function(target, args)
    new.meta.update(node.meta)
    node.replace_all_uses_with(new)
    for old in (node, *dead):
        gm.graph.erase_node(old)
    return new

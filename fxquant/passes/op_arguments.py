"""An op node's arguments by the names its schema declares, not by position: `arguments(node)["w_scale"]`, and
`with_arguments(node, w=..., out_features=...)` for the positional tuple with some replaced. The names are the ops'
own (`fxquant/ops/` declares each schema once), so a pass and the op cannot disagree on where an argument sits."""

from __future__ import annotations

import torch


def argument_names(op: torch._ops.OpOverload) -> tuple[str, ...]:
    return tuple(argument.name for argument in op._schema.arguments)


def arguments(node: torch.fx.Node) -> dict[str, object]:
    """node's arguments, positional and keyword alike, by their schema names."""
    named = dict(zip(argument_names(node.target), node.args, strict=False))
    named.update(node.kwargs)
    return named


def with_arguments(node: torch.fx.Node, **changes) -> tuple:
    """node's arguments as one positional tuple in schema order, with `changes` (by name) replacing some."""
    named = {**arguments(node), **changes}
    unknown = set(changes) - set(argument_names(node.target))
    if unknown:
        raise ValueError(f"fxquant: {node.target} has no argument {sorted(unknown)}; it takes "
                         f"{', '.join(argument_names(node.target))}")
    return tuple(named[name] for name in argument_names(node.target))

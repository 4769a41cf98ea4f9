"""Which nodes write memory, decided from op schemas, never from a list of names.

A graph from dynamo or torch.export holds in-place writes whose results nobody reads: a KV cache's
`index_copy_`, a `copy_`, a setitem, an `out=` argument. Dropping one is silent data loss, and moving a read
across one changes what the read sees. Every pass asks this module:

- `has_side_effects(node)`: torch's own `Node.is_impure` (mutable aten schemas, effectful and random ops,
  impure modules), plus what it does not see in torch-level graphs: a Tensor method or torch function whose aten
  schema writes its first argument (`x.index_copy_(...)` is `aten::index_copy_(Tensor(a!) self, ...)`), an
  `out=` tensor, and Python's mutating operators (`x[i] = v`, `x += y`).
- `mutation_epochs(graph)`: per node, how many writes come before it. A rewrite may merge or move computations
  only within one epoch.
- `Writes(graph).reaches(tensors, first, last)`: whether a write between two nodes may reach one of `tensors`,
  following in-place results and views back to the memory they alias; a write whose target is unknown counts.
"""

from __future__ import annotations

import functools
import operator

import torch

# Python's data model: setitem/delitem and the augmented assignments (x += y -> operator.iadd, the in-place twin
# of operator.add; iand of and_) mutate their first operand when the type defines the in-place method, as
# torch.Tensor does.
_PYTHON_MUTATORS = {operator.setitem, operator.delitem} | {
    getattr(operator, name) for name in dir(operator)
    if name.startswith("i") and (hasattr(operator, name[1:]) or hasattr(operator, name[1:] + "_"))
    and hasattr(torch.Tensor, f"__{name}__")}


def has_side_effects(node: torch.fx.Node) -> bool:
    """True if running `node` writes memory (or is an input/output, which DCE must keep)."""
    if node.is_impure():
        return True
    if node.op not in ("call_function", "call_method"):
        return False
    if isinstance(node.kwargs.get("out"), torch.fx.Node):
        return True
    if node.target in _PYTHON_MUTATORS:
        return True
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return isinstance(name, str) and _aten_writes_self(name)


@functools.cache
def _aten_writes_self(name: str) -> bool:
    """Whether some overload of aten::<name> writes its first argument (Tensor(a!) self)."""
    if name in ("__setitem__", "__delitem__"):
        return True
    if name.startswith("__i") and name.endswith("__"):  # __iadd__ and friends: in place by the data model
        return True
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for overload in packet.overloads():
        arguments = getattr(packet, overload)._schema.arguments
        if arguments and arguments[0].alias_info is not None and arguments[0].alias_info.is_write:
            return True
    return False


def mutation_epochs(graph: torch.fx.Graph) -> dict[torch.fx.Node, int]:
    """Each node's number of memory-writing nodes before it in graph order (placeholders and output excluded)."""
    epochs, count = {}, 0
    for node in graph.nodes:
        epochs[node] = count
        if node.op in ("call_function", "call_method", "call_module") and has_side_effects(node):
            count += 1
    return epochs


def eliminate_dead_code(graph: torch.fx.Graph) -> bool:
    """graph.eliminate_dead_code, keeping every node with side effects."""
    return graph.eliminate_dead_code(is_impure_node=has_side_effects)


def _schema(node: torch.fx.Node):
    """The aten schema a node runs: its overload's, or for a torch-level call, None (its name decides)."""
    return node.target._schema if isinstance(node.target, torch._ops.OpOverload) else None


def _name(node: torch.fx.Node) -> str | None:
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", None)
    return name if isinstance(name, str) else None


def _aliases_first_argument(node: torch.fx.Node) -> bool:
    """Whether node's result may share its first argument's memory: an in-place result or a view (an indexing,
    whose slices are views; a reshape or contiguous, views where they can be), by the aten schema; and, not
    knowing, any call aten has no op of that name for (x.float() returns x itself when x is fp32)."""
    if node.op not in ("call_function", "call_method") or not node.args:
        return False
    if node.target is operator.getitem:
        return True
    schema = _schema(node)
    if schema is not None:
        return bool(schema.arguments and schema.returns and schema.arguments[0].alias_info is not None
                    and schema.returns[0].alias_info is not None)
    name = _name(node)
    known = name is not None and name.isidentifier() and isinstance(getattr(torch.ops.aten, name, None),
                                                                    torch._ops.OpOverloadPacket)
    return not known or _aten_writes_self(name) or _aten_returns_view(name)


@functools.cache
def _aten_returns_view(name: str) -> bool:
    """Whether some overload of aten::<name> returns an alias of its first argument (Tensor(a) self -> Tensor(a))."""
    packet = getattr(torch.ops.aten, name, None) if name.isidentifier() else None
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        return False
    for overload in packet.overloads():
        schema = getattr(packet, overload)._schema
        if schema.arguments and schema.returns and schema.arguments[0].alias_info is not None \
                and schema.returns[0].alias_info is not None:
            return True
    return False


def alias_root(node):
    """The node whose memory `node` may alias: followed back through in-place results and views."""
    while isinstance(node, torch.fx.Node) and _aliases_first_argument(node):
        node = node.args[0]
    return node


def _written(node: torch.fx.Node) -> list | None:
    """The tensors a write targets (the arguments an aten schema marks written, an in-place method's or setitem's
    first argument, an out= tensor), [] for an effectful op that writes none (an assert), or None where they are not
    known (a module, a torch-level callable of unknown schema)."""
    if isinstance(node.kwargs.get("out"), torch.fx.Node):
        return [node.kwargs["out"]]
    schema = _schema(node)
    if schema is not None:
        written = [i for i, arg in enumerate(schema.arguments)
                   if arg.alias_info is not None and arg.alias_info.is_write]
        return [node.args[i] for i in written] if all(i < len(node.args) for i in written) else None
    name = _name(node)
    if node.op in ("call_function", "call_method") and node.args and (
            node.target in _PYTHON_MUTATORS or (name is not None and _aten_writes_self(name))):
        return [node.args[0]]
    return None


class Writes:
    """A graph's memory writes in order, read once: `reaches(tensors, first, last)` says whether a write after
    `first` and before `last` may reach the memory of one of `tensors`. Nodes added later are not indexed: ask only
    about nodes the graph held when this was made."""

    def __init__(self, graph: torch.fx.Graph):
        self.order = {node: i for i, node in enumerate(graph.nodes)}
        self.writes = [(self.order[node], node) for node in graph.nodes
                       if node.op in ("call_function", "call_method", "call_module") and has_side_effects(node)]

    def reaches(self, tensors, first: torch.fx.Node, last: torch.fx.Node) -> bool:
        roots = {alias_root(t) for t in tensors}
        start, stop = self.order[first], self.order[last]
        for index, node in self.writes:
            if start < index < stop:
                written = _written(node)
                if written is None or any(alias_root(t) in roots for t in written):
                    return True
        return False

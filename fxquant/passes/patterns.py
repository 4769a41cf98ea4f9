"""Each graph pattern the passes act on, declared once and matched by one function returning a small match object.
Passes edit only after the whole pattern matched.

- `linear_operands`: y = x @ W.T + b in every spelling: F.linear (W [N, K]), addmm(b, x, W) and mm / matmul / @
  with a 2-D parameter W [K, N] on the right (GPT-2's Conv1D, hand-written projections).
- `match_rms_variance`: a hand-written RMSNorm's pow(x, 2) -> mean(-1, keepdim) -> [add eps] -> rsqrt, whose
  intermediates nothing else reads (transformers' LlamaRMSNorm).
- `expert_operands`: an MoE layer's expert matmul over a 3-D parameter W [E, N, K] (or [E, K, N]): grouped_mm of
  rows sorted by expert with offsets (transformers' `grouped_mm` experts, and its fallback op), or bmm of W[ids]
  with one row per (token, expert) pair (its `batched_mm` experts).
- `selects_experts`: a linear whose output reaches a top-k within a few ops: an MoE router.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from fxquant.passes.annotations import PARAMETER_KEY, fake_value, fetch_attr
from fxquant.passes.spellings import (
    ADD,
    ADDMM,
    BMM,
    DTYPE_CASTS,
    EXPAND,
    GATHER_ROWS,
    LINEAR,
    MATMUL,
    MEAN,
    MM,
    PERMUTE,
    POW,
    RESHAPE,
    RSQRT,
    SWAP_2D,
    TOPK,
    TRANSPOSE,
    UNSQUEEZE,
    is_grouped_mm,
    is_swap_2d_attribute,
    target_of,
)

# A router's logits reach its top-k through a cast and a softmax or sigmoid, sometimes a bias add and a view
# (Mixtral, Qwen-MoE: 2-3 ops; DeepSeek-V3's grouped selection: 4).
ROUTER_DEPTH = 4


@dataclass(frozen=True)
class LinearOperands:
    """y = x @ W.T + bias; `transposed`: the graph stores W as [K, N] (addmm / mm / matmul), not [N, K]."""

    x: torch.fx.Node
    weight: object  # a get_attr node for a constant weight
    bias: object  # a node, or None
    transposed: bool
    cast: bool = False  # the product reads the weight cast to another dtype (DeepSeek-V3's router: fp32 logits)

    def weight_nk(self, gm) -> torch.Tensor | None:
        """The constant weight as [N, K] (a transposed view where the graph stores [K, N]), or None."""
        w = fetch_attr(gm, self.weight)
        if not isinstance(w, torch.Tensor):
            return None
        return w.T if self.transposed else w


def call_arg(node, index, *names, default=None):
    """A call's argument by position, or by any of its names (torch's and aten's spellings differ: input / self)."""
    if len(node.args) > index:
        return node.args[index]
    return next((node.kwargs[name] for name in names if name in node.kwargs), default)


def _is_constant(node) -> bool:
    return isinstance(node, torch.fx.Node) and node.op == "get_attr"


def _is_parameter(node, dim: int) -> bool:
    """A constant weight of `dim` dims: a parameter (freeze_params marks them), not a buffer such as a rotary
    table."""
    if not _is_constant(node):
        return False
    value = fetch_attr(node.graph.owning_module, node)
    return node.meta.get(PARAMETER_KEY, False) and isinstance(value, torch.Tensor) and value.dim() == dim


def _is_2d_parameter(node) -> bool:
    return _is_parameter(node, 2)


def _swapped_2d_parameter(node) -> torch.fx.Node | None:
    """The 2-D parameter `node` transposes (w.T, w.t(), w.mT, w.transpose(0, 1), w.permute(1, 0)), or None."""
    if not isinstance(node, torch.fx.Node) or not _is_2d_parameter(source := call_arg(node, 0, "input", "self")):
        return None
    if is_swap_2d_attribute(node):
        return source
    target, dims = target_of(node), node.args[1:]
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):  # permute((1, 0)), aten.permute(w, [1, 0])
        dims = dims[0]
    if not all(isinstance(d, int) for d in dims):
        return None
    dims = [d % 2 for d in dims]
    if target in SWAP_2D or target in TRANSPOSE and sorted(dims) == [0, 1] or target in PERMUTE and dims == [1, 0]:
        return source
    return None


def linear_operands(node: torch.fx.Node) -> LinearOperands | None:
    target = target_of(node)
    if target in LINEAR:
        x, w, bias = call_arg(node, 0, "input"), call_arg(node, 1, "weight"), call_arg(node, 2, "bias")
        if isinstance(w, torch.fx.Node) and target_of(w) in DTYPE_CASTS and _is_2d_parameter(w.args[0]):
            return LinearOperands(x, w.args[0], bias, False, cast=True)
        return LinearOperands(x, w, bias, False)
    if target in ADDMM:
        bias, x, w = (call_arg(node, i, *names) for i, names in enumerate((("input", "self"), ("mat1",), ("mat2",))))
        plain = call_arg(node, 3, "beta", default=1) == 1 and call_arg(node, 4, "alpha", default=1) == 1
        bias_is_row = isinstance(fake_value(bias), torch.Tensor) and fake_value(bias).dim() == 1
        if plain and bias_is_row and _is_2d_parameter(w):
            return LinearOperands(x, w, bias, True)
        return None
    if target in MM | MATMUL:
        x, w = call_arg(node, 0, "input", "self"), call_arg(node, 1, "mat2", "other")
        rows = fake_value(x)
        if _is_constant(x) or not isinstance(rows, torch.Tensor) or rows.dim() < 2:
            return None  # a constant on the left, or a vector: not a layer's activations
        if _is_2d_parameter(w):
            return LinearOperands(x, w, None, True)  # w stored [K, N]: GPT-2's Conv1D weight, x @ w
        if (nk := _swapped_2d_parameter(w)) is not None:
            return LinearOperands(x, nk, None, False)  # x @ w.T with w [N, K]: nn.Linear's layout
    return None


@dataclass(frozen=True)
class ExpertOperands:
    """out[r] = x[r] @ W[e].T for the experts' weights W; rows sorted by expert with cumulative ends `offs`
    (grouped_mm), one expert id per row in `ids` (bmm of W[ids]), or `dense`: x [E, T, K] with every expert over
    its own T rows (bmm(x, W), Llama4's experts). `transposed`: the graph stores W as [E, K, N], not [E, N, K]."""

    x: torch.fx.Node
    weight: torch.fx.Node  # a get_attr node for the 3-D parameter
    transposed: bool
    offs: torch.fx.Node | None = None
    ids: torch.fx.Node | None = None
    dense: bool = False

    def weight_nk(self, gm) -> torch.Tensor:
        """The experts' weights as [E, N, K] (a transposed view where the graph stores [E, K, N])."""
        w = fetch_attr(gm, self.weight)
        return w.transpose(-2, -1) if self.transposed else w


def _swaps_last_dims(node) -> bool:
    if target_of(node) not in TRANSPOSE or len(node.args) != 3:
        return False
    return {d % 3 if isinstance(d, int) else d for d in node.args[1:]} == {1, 2}


def expert_operands(node: torch.fx.Node) -> ExpertOperands | None:
    target = target_of(node)
    if is_grouped_mm(target):
        x, w = node.args[:2]
        offs = call_arg(node, 2, "offs")
        if offs is None or call_arg(node, 3, "bias") is not None:
            return None
        if isinstance(w, torch.fx.Node) and _swaps_last_dims(w) and _is_parameter(w.args[0], 3):
            return ExpertOperands(x, w.args[0], False, offs=offs)  # transformers' W [E, N, K].transpose(-2, -1)
        if _is_parameter(w, 3):
            return ExpertOperands(x, w, True, offs=offs)
        return None
    if target in BMM:
        selected, column = node.args[:2]  # bmm(W[ids] [S, N, K], x.unsqueeze(-1) [S, K, 1])
        if _is_parameter(column, 3) and not _is_constant(selected):
            return ExpertOperands(selected, column, True, dense=True)  # bmm(x [E, T, K], W [E, K, N])
        if not (isinstance(selected, torch.fx.Node) and target_of(selected) in GATHER_ROWS):
            return None
        w, ids = selected.args[:2]
        if isinstance(ids, list | tuple) and len(ids) == 1:  # aten.index.Tensor takes a list of index tensors
            ids = ids[0]
        unsqueezed = isinstance(column, torch.fx.Node) and target_of(column) in UNSQUEEZE
        if unsqueezed and column.args[1] in (-1, 2) and _is_parameter(w, 3) and isinstance(ids, torch.fx.Node):
            return ExpertOperands(column.args[0], w, False, ids=ids)
    return None


def weight_operands(node: torch.fx.Node) -> LinearOperands | ExpertOperands | None:
    """The operands of a linear or of an MoE expert product."""
    return linear_operands(node) or expert_operands(node)


@dataclass(frozen=True)
class RmsVariance:
    pow: torch.fx.Node
    mean: torch.fx.Node
    add: torch.fx.Node | None
    rsqrt: torch.fx.Node
    eps: float


def _only_user(node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _reduces_last_dim(mean) -> bool:
    dim = call_arg(mean, 1, "dim")
    dims = list(dim) if isinstance(dim, list | tuple) else [dim]
    value = fake_value(mean.args[0])
    rank = value.dim() if isinstance(value, torch.Tensor) else None
    return call_arg(mean, 2, "keepdim", default=False) is True and len(dims) == 1 and dims[0] in (-1, rank and rank - 1)


def match_rms_variance(pow_node: torch.fx.Node) -> RmsVariance | None:
    if target_of(pow_node) not in POW or len(pow_node.args) < 2 or pow_node.args[1] != 2:
        return None
    mean = _only_user(pow_node)
    if mean is None or target_of(mean) not in MEAN or not _reduces_last_dim(mean):
        return None
    add, end = None, _only_user(mean)
    eps = 0.0
    if end is not None and target_of(end) in ADD:
        other = [a for a in end.args if a is not mean]
        if len(end.args) != 2 or len(other) != 1 or not isinstance(other[0], int | float):
            return None
        add, eps, end = end, float(other[0]), _only_user(end)
    if end is None or target_of(end) not in RSQRT:
        return None
    return RmsVariance(pow_node, mean, add, end, eps)


def selects_experts(linear: torch.fx.Node) -> bool:
    """Whether the linear's output reaches a top-k within ROUTER_DEPTH ops, without passing another linear."""
    frontier, seen = [linear], {linear}
    for _ in range(ROUTER_DEPTH):
        frontier = [user for node in frontier for user in node.users if user not in seen]
        seen.update(frontier)
        if any(target_of(node) in TOPK for node in frontier):
            return True
        frontier = [node for node in frontier if linear_operands(node) is None]
    return False


# Decode: a step, or a few speculative or chunked positions; past that, prefill's kernels win
MAX_QUERIES = 4
SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def repeated_kv(node) -> tuple[torch.fx.Node | None, int]:
    """(K, n) where node is transformers' repeat_kv(K, n): K [B, Hkv, L, D] given a new dim 2, expanded to n there
    and folded into the heads; (None, 0) for anything else."""
    if not isinstance(node, torch.fx.Node) or target_of(node) not in RESHAPE:
        return None, 0
    expand = node.args[0]
    if not isinstance(expand, torch.fx.Node) or target_of(expand) not in EXPAND:
        return None, 0
    source = _unsqueezed_at_2(expand.args[0])
    value, expanded, folded = fake_value(source), fake_value(expand), fake_value(node)
    if not all(isinstance(t, torch.Tensor) for t in (value, expanded, folded)) or value.dim() != 4:
        return None, 0
    b, kv_heads, length, dim = value.shape
    if expanded.dim() != 5 or tuple(expanded.shape) != (b, kv_heads, expanded.shape[2], length, dim):
        return None, 0
    n = expanded.shape[2]
    if not isinstance(n, int) or tuple(folded.shape) != (b, kv_heads * n, length, dim):
        return None, 0
    return source, n


def _unsqueezed_at_2(node):
    """K where node is K[:, :, None] or K.unsqueeze(2) of a 4-D K, else None."""
    if not isinstance(node, torch.fx.Node):
        return None
    target = target_of(node)
    if target is operator.getitem:
        source, index = node.args
        full = slice(None, None, None)
        if isinstance(index, tuple) and len(index) in (3, 5) and index[:2] == (full, full) and index[2] is None \
                and all(i == full for i in index[3:]):
            return source
        return None
    if target in UNSQUEEZE:
        source, dim = node.args[0], node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        value = fake_value(source)
        if isinstance(value, torch.Tensor) and value.dim() == 4 and dim in (2, -3):
            return source
    return None

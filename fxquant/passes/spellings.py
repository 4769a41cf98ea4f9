"""Every spelling of the ops the passes and the lint look for, in one table: dynamo's torch-level targets
(functions, Tensor methods resolved by `target_of`, Python operators) and torch.export's aten overloads."""

from __future__ import annotations

import operator

import torch
import torch.nn.functional as F

aten = torch.ops.aten

# y = x @ w.T + b with w [N, K]: nn.Linear
LINEAR = {torch._C._nn.linear, F.linear, aten.linear.default}
# y = b + x @ w with w [K, N]: GPT-2's Conv1D (addmm), and a bare parameter on the right of mm / matmul / @
ADDMM = {torch.addmm, torch.Tensor.addmm, aten.addmm.default}
MM = {torch.mm, torch.Tensor.mm, aten.mm.default}
MATMUL = {torch.matmul, torch.Tensor.matmul, operator.matmul, aten.matmul.default}
# MoE experts: y = x @ w[e] over rows sorted by expert, with offsets (x [S, K], w [E, K, N], offs [E]); and the
# per-row form, bmm of w[expert_ids] and x
GROUPED_MM = {torch._grouped_mm, aten._grouped_mm.default} | ({F.grouped_mm} if hasattr(F, "grouped_mm") else set())
BMM = {torch.bmm, torch.Tensor.bmm, aten.bmm.default}
TRANSPOSE = {torch.transpose, torch.Tensor.transpose, aten.transpose.int}
# w.T, w.t(), w.mT of a 2-D w (dynamo records the properties as aten calls); transpose and permute by their dims
SWAP_2D = {torch.t, torch.Tensor.t, aten.t.default, aten.numpy_T, aten.numpy_T.default, aten.mT, aten.mT.default}
# torch 2.11's dynamo records w.T and w.mT as builtins.getattr(w, "T") instead of the aten call
SWAP_2D_ATTRIBUTES = {"T", "mT"}
PERMUTE = {torch.permute, torch.Tensor.permute, aten.permute.default}
UNSQUEEZE = {torch.unsqueeze, torch.Tensor.unsqueeze, aten.unsqueeze.default}
EXPAND = {torch.Tensor.expand, aten.expand.default}
RESHAPE = {torch.reshape, torch.Tensor.reshape, torch.Tensor.view, aten.reshape.default, aten.view.default}
CONTIGUOUS = {torch.Tensor.contiguous, aten.clone.default}  # export spells x.contiguous() as a clone
SDPA = {torch._C._nn.scaled_dot_product_attention, F.scaled_dot_product_attention,
        aten.scaled_dot_product_attention.default}
GATHER_ROWS = {operator.getitem, aten.index.Tensor}
EMBEDDING = {F.embedding, torch.embedding, aten.embedding.default}
SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, aten._softmax.default, aten.softmax.int}
TANH = {torch.tanh, torch.Tensor.tanh, aten.tanh.default}
SILU = {F.silu, torch._C._nn.silu, aten.silu.default}
CAT = {torch.cat, torch.concat, aten.cat.default}
ARANGE = {torch.arange, aten.arange.default, aten.arange.start}
AMAX = {torch.max, torch.Tensor.max, torch.amax, torch.Tensor.amax, aten.max.dim, aten.amax.default}
SUB = {torch.sub, torch.Tensor.sub, aten.sub.Tensor, operator.sub}
DROPOUT = {F.dropout, torch.dropout, aten.dropout.default}
RMS_NORM = {F.rms_norm, torch.rms_norm, aten.rms_norm.default}
LAYER_NORM = {F.layer_norm, torch.layer_norm, aten.layer_norm.default}
TOPK = {torch.topk, torch.Tensor.topk, aten.topk.default}
CONVOLUTION = {F.conv1d, F.conv2d, F.conv3d, F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
               aten.convolution.default, aten.conv1d.default, aten.conv2d.default, aten.conv3d.default}

POW = {torch.pow, torch.Tensor.pow, aten.pow.Tensor_Scalar}
MEAN = {torch.mean, torch.Tensor.mean, aten.mean.dim}
RSQRT = {torch.rsqrt, torch.Tensor.rsqrt, aten.rsqrt.default}
ADD = {torch.add, torch.Tensor.add, aten.add.Tensor, operator.add}
MUL = {torch.mul, torch.Tensor.mul, aten.mul.Tensor, operator.mul}
DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, aten.div.Tensor, operator.truediv}
CASTS = {torch.Tensor.to, torch.Tensor.float, torch.Tensor.type, aten._to_copy.default}
DTYPE_CASTS = {torch.Tensor.to, torch.Tensor.type, aten._to_copy.default, aten.to.dtype}

LOW_PRECISION = (torch.bfloat16, torch.float16)


def is_grouped_mm(target) -> bool:
    """torch's grouped_mm, or transformers' custom-op fallback for dtypes and devices it does not serve."""
    return target in GROUPED_MM or str(target).startswith("transformers.grouped_mm_fallback")


def is_swap_2d_attribute(node: torch.fx.Node) -> bool:
    """getattr(w, "T") or getattr(w, "mT"): a transpose of a 2-D w read as a property."""
    return (node.op == "call_function" and node.target is getattr and len(node.args) == 2
            and node.args[1] in SWAP_2D_ATTRIBUTES)


def target_of(node: torch.fx.Node):
    """The callable a node runs, with Tensor methods resolved (x.softmax -> torch.Tensor.softmax)."""
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, None)
    return node.target if node.op == "call_function" else None

"""pack_lanes: 4-bit weight-only linears also get their scales (and int4's zero points) in the per-lane layout of
the mma.sync decode kernels (`kernels/gemm_int4_mma.py`, `kernels/gemm_fp4_mma.py`), which serve one activation row.

Pre:  quantize_linear and merge_linear have run. Post: each 4-bit linear_weight_only over weights a layer record
owns, or over the model's own quantized parameters (quantize_'s, a loaded checkpoint's), with K a multiple of 128,
on an sm_80+ GPU, is its lanes op over the same tensors plus the per-lane copy; other row counts keep the row-major
tensors and the in-register kernel.
- int4, groups a multiple of 128: linear_int4_lanes (a copy of 7.8% of the codes' bytes: 6.25% scales, 1.6% zero
  points);
- MXFP4 and NVFP4, under the option `fp4_lanes` (on; docs/decisions/0031-fp4-decode-on-mma-sync.md):
  linear_fp4_lanes (a copy of 3.1% and 6.25%).
- int4_fp8's W4A8 linears (scaled_mm_int4_fp8), under the option `int4_fp8_lanes` (on;
  docs/decisions/0043-w4a8-decode-on-the-int4-mma-kernel.md), on an sm_89+ GPU:
  scaled_mm_int4_fp8_lanes, the int4 kernel over the e4m3 activations (a copy of 6.25%, and the zero points').

    %y = fxquant.linear_weight_only(%x, %w, %s, None, %z, %b, "int4", 128, N)
        ->  %y = fxquant.linear_int4_lanes(%x, %w, %s, %z, %s_lanes, %z_lanes, %b, 128, N)
    %y = fxquant.linear_weight_only(%x, %w, %s, %gs, None, %b, "nvfp4", 16, N)
        ->  %y = fxquant.linear_fp4_lanes(%x, %w, %s, %gs, %s_lanes, %b, "nvfp4", 16, N)
    %y = fxquant.scaled_mm_int4_fp8(%a, %as, %w, %s, None, %b, 128, N, bf16, %rs)
        ->  %y = fxquant.scaled_mm_int4_fp8_lanes(%a, %as, %w, %s, None, %s_lanes, None, %b, 128, N, bf16, %rs)

The codes stay what quantize_linear made them: on the GPU, int4 weight-only codes are tiles (kernels/code_tiles.py,
weight_store.tiles_chosen), int4_fp8's rows unless int4_code_tiles=True, and every kernel of the ops reads either at
every row count; FP4's are rows.

The copy is shared by every graph that reads the same scales, and re-packed in place whenever they may have
changed: when a graph is compiled (another graph may have re-quantized shared weights), and on
`weight_store.refresh_lanes` after the backend re-quantizes a changed weight or sees a model parameter the copy
follows change (gm.meta[WATCHED_KEY]: a load_state_dict into quantize_'s scales). A parameter whose source the graph
does not know (an exported program's) keeps the row-major kernel: nothing could tell its copy stale.
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)
from fxquant.kernels.cast import capability
from fxquant.kernels.code_tiles import is_tiled
from fxquant.kernels.gemm_fp4_mma import BLOCKS
from fxquant.kernels.gemm_int4_mma import STEP_K
from fxquant.passes.annotations import PARTS_KEY, SOURCE_KEY, fetch_attr
from fxquant.passes.op_arguments import arguments
from fxquant.passes.order import FxquantPass
from fxquant.passes.state import PipelineState
from fxquant.quantization.weight_store import LANES_KEY, WATCHED_KEY, lanes_of

WEIGHT_ONLY = torch.ops.fxquant.linear_weight_only.default
INT4_LANES = torch.ops.fxquant.linear_int4_lanes.default
FP4_LANES = torch.ops.fxquant.linear_fp4_lanes.default
W4A8 = torch.ops.fxquant.scaled_mm_int4_fp8.default
W4A8_LANES = torch.ops.fxquant.scaled_mm_int4_fp8_lanes.default


def model_sources(node: torch.fx.Node | None) -> list[torch.Tensor] | None:
    """The model's tensors that a get_attr node's value is (freeze_params' source) or stacks (merge_linear's parts),
    [] for no node, None where the graph does not know them."""
    if node is None:
        return []
    if node.meta.get(SOURCE_KEY) is not None:
        return [node.meta[SOURCE_KEY]]
    parts = node.meta.get(PARTS_KEY)
    return list(parts) if parts else None


def kernel_serves(scale: torch.Tensor, e4m3: bool = False) -> bool:
    """Whether the mma.sync kernel can run where this weight lives (over e4m3 activations: sm_89+)."""
    return scale.is_cuda and capability(scale.device) >= ((8, 9) if e4m3 else (8, 0))


class PackLanes(FxquantPass):
    name = "pack_lanes"
    optional = True
    def __init__(self, state: PipelineState):
        super().__init__()
        self.state = state  # its layer records name the buffers this graph quantized, its config the formats

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        owned = {layer.buffers.scale for layer in self.state.layers if layer.buffers is not None}
        packed = {}  # (scale buffer, zero point buffer, format) -> None, in order
        watched = {}  # id -> a model parameter some per-lane copy follows, in order
        for node in list(gm.graph.nodes):
            w4a8 = node.target is W4A8 and self.state.config.int4_fp8_lanes
            if node.target is not WEIGHT_ONLY and not w4a8:
                continue
            args = arguments(node)
            w, scale, zero_point = args["w"], args["w_scale"], args["w_zero_point"]
            fmt = "int4" if w4a8 else args["fmt"]
            if not self._packs(fmt, args["group_size"]) or scale.op != "get_attr":
                continue
            follows = self._follows(scale, zero_point, owned)
            if follows is None:
                continue
            scale_t, zero_t, codes = fetch_attr(gm, scale), fetch_attr(gm, zero_point), fetch_attr(gm, w)
            # int4 codes [N, K / 2], or tiles, whose K is a multiple of 128 by construction; FP4 codes [N, K / 2]
            if (not is_tiled(codes) and 2 * codes.shape[-1] % STEP_K) or not kernel_serves(scale_t, w4a8):
                continue
            lane_scale, lane_zero = lanes_of(scale_t, zero_t, fmt)
            names = (scale.target, zero_point.target if zero_point is not None else None)
            with gm.graph.inserting_before(node):
                s_lanes, z_lanes = (self._attr(gm, name, tensor) for name, tensor in zip(names, (lane_scale, lane_zero),
                                                                                      strict=True))
                if w4a8:
                    lanes = gm.graph.call_function(W4A8_LANES, (args["a"], args["a_scale"], w, scale, zero_point,
                                                                s_lanes, z_lanes, args["bias"], args["group_size"],
                                                                args["out_features"], args["out_dtype"],
                                                                args.get("w_row_scale")))
                elif fmt == "int4":
                    lanes = gm.graph.call_function(INT4_LANES, (args["x"], w, scale, zero_point, s_lanes, z_lanes,
                                                                args["bias"], args["group_size"],
                                                                args["out_features"]))
                else:
                    lanes = gm.graph.call_function(FP4_LANES, (args["x"], w, scale, args["w_global_scale"], s_lanes,
                                                               args["bias"], fmt, args["group_size"],
                                                               args["out_features"]))
            lanes.meta.update(node.meta)
            node.replace_all_uses_with(lanes)
            gm.graph.erase_node(node)
            packed[(*names, fmt)] = None
            watched.update((id(t), t) for t in follows)
        if not packed:
            return PassResult(gm, False)
        gm.meta[LANES_KEY] = list(packed)
        gm.meta[WATCHED_KEY] = list(watched.values())
        return PassResult(gm, True)

    def _packs(self, fmt: str, group: int) -> bool:
        """Whether a weight of this format and group has a lanes kernel the pass is to give it."""
        if fmt == "int4":
            return group % STEP_K == 0
        return self.state.config.fp4_lanes and BLOCKS.get(fmt) == group

    @staticmethod
    def _follows(scale: torch.fx.Node, zero_point: torch.fx.Node | None, owned: set) -> list[torch.Tensor] | None:
        """The model parameters a per-lane copy of these scales must follow: none where the backend owns them (it
        re-quantizes and re-packs them itself), quantize_'s where the graph knows them, None where it cannot."""
        if scale.target in owned:
            return []
        found = [model_sources(scale), model_sources(zero_point)]
        return None if None in found else found[0] + found[1]

    @staticmethod
    def _attr(gm: torch.fx.GraphModule, name: str | None, tensor: torch.Tensor | None):
        """A get_attr node for the per-lane copy of buffer `name`, registered once per graph."""
        if tensor is None:
            return None
        copy = f"{name}_lanes"
        if not hasattr(gm, copy):
            gm.register_buffer(copy, tensor)
        return gm.graph.get_attr(copy)

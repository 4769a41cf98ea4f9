"""upcast: reductions in low precision (softmax, norms, a hand-written RMSNorm's variance) run in fp32.

Pre:  detect has run. Post: each annotated reduction with a bf16/fp16 input reads an fp32 copy of it and
its result is cast back, so the dtypes and shapes the rest of the graph sees do not change. A bf16
reduction over thousands of elements loses range silently; fp32 costs little here. A hand-written variance is
edited only when its whole pattern still matches (`patterns.match_rms_variance`); otherwise nothing changes.

    %y = softmax(%x_bf16, -1)       ->  %x32 = _to_copy(%x_bf16, fp32); %s = softmax(%x32, -1)
                                        %y = _to_copy(%s, bf16)
    (a softmax given dtype=bf16, as GPT-OSS's sinks attention, takes dtype=fp32 with it)
    %v = pow(%h_bf16, 2) ... rsqrt  ->  %v = pow(_to_copy(%h_bf16, fp32), 2) ... %r = _to_copy(rsqrt, bf16)
"""

from __future__ import annotations

import torch
from torch.fx.passes.infra.pass_base import PassResult

from fxquant.passes.annotations import META_KEY, annotation, module_path, node_dtype
from fxquant.passes.order import FxquantPass
from fxquant.passes.patterns import match_rms_variance
from fxquant.passes.spellings import LOW_PRECISION, aten
from fxquant.passes.state import PipelineState

UPCAST_KEY = "fxquant_upcast"  # marks nodes this pass made, so a second run changes nothing


def _cast(graph, node, dtype):
    new = graph.call_function(aten._to_copy.default, (node,), {"dtype": dtype})
    new.meta[UPCAST_KEY] = True
    return new


class Upcast(FxquantPass):
    name = "upcast"
    needs = ("detect",)  # it reads the annotations detect wrote
    def __init__(self, state: PipelineState):
        super().__init__()
        self.state = state

    def call(self, gm: torch.fx.GraphModule) -> PassResult:
        graph, modified = gm.graph, False
        for node in list(graph.nodes):
            found = annotation(node)
            if found is None or node.meta.get(UPCAST_KEY) or found.kind in ("linear", "experts"):
                continue
            x = node.args[0]
            dtype = node_dtype(x)
            if dtype not in LOW_PRECISION:
                continue
            if found.kind == "softmax" and (node.kwargs.get("dtype") == torch.float32 or len(node.args) > 2):
                continue  # softmax(x, dim, dtype=...) / aten._softmax(half_to_float) already chose
            if found.kind == "rms_norm_variance":
                matched = match_rms_variance(node)
                if matched is None:
                    continue  # an earlier edit changed the pattern: leave it whole
                out = matched.rsqrt
            else:
                out = node
            if found.kind == "softmax" and node.kwargs.get("dtype") in LOW_PRECISION:
                # softmax(x, dim, dtype=bf16) casts its input to bf16 first: an fp32 input alone would not upcast it
                node.update_kwarg("dtype", torch.float32)
            with graph.inserting_before(node):
                node.replace_input_with(x, _cast(graph, x, torch.float32))
                for arg in node.args[1:]:  # norm weight / bias follow the input into fp32
                    if isinstance(arg, torch.fx.Node) and node_dtype(arg) in LOW_PRECISION:
                        node.replace_input_with(arg, _cast(graph, arg, torch.float32))
            with graph.inserting_after(out):
                back = _cast(graph, out, dtype)
            out.replace_all_uses_with(back, delete_user_cb=lambda user, back=back: user is not back)
            back.meta.update({k: v for k, v in out.meta.items() if k != META_KEY})
            node.meta[UPCAST_KEY] = True
            where = module_path(node)
            self.state.upcast.append(f"{where} ({found.kind})" if where else f"{node.name} ({found.kind})")
            modified = True
        return PassResult(gm, modified)

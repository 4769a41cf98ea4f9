"""localize_shards, on 2 gloo ranks: column-parallel linears (one with its sharded bias) and a row-parallel one without
bias run on local shards, a row-parallel linear with a bias and a column split into uneven shards are left to
DTensor and reported, a buffer written in place keeps its write, and a second run changes nothing. quantize_ on the
same sharded model quantizes the same three and keeps the other two, with its reason."""

import contextlib
import copy
import io

import torch
import torch.nn as nn
from reports import layer_rows
from tensor_parallel import run

from fxquant.modules.sharded_linear import LAYOUT_REASON
from fxquant.passes.annotations import SHARD_KEY, fetch_attr
from fxquant.passes.freeze_params import FreezeParams
from fxquant.passes.localize_shards import LocalizeShards
from fxquant.passes.side_effects import has_side_effects
from fxquant.quantization.weight_quantization import SHARDED_REASON


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(128, 256)  # column parallel, bias sharded with it
        self.down = nn.Linear(256, 128, bias=False)  # row parallel
        self.up2 = nn.Linear(128, 256, bias=False)  # column parallel
        self.out = nn.Linear(256, 128)  # row parallel with a bias: added once, after the sum, so left to DTensor
        self.uneven = nn.Linear(128, 257, bias=False)  # column parallel into 129 + 128 rows: left to DTensor
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.out(torch.relu(self.up2(self.down(torch.relu(self.up(x)))))) + self.uneven(x)[..., :1]


def localize_on_two_ranks():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import fxquant

    torch.manual_seed(0)
    model = Block().to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    parallelize_module(model, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(), "up2": ColwiseParallel(),
                                     "out": RowwiseParallel(), "uneven": ColwiseParallel()})
    x = torch.randn(2, 4, 128, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = model(x)
        graphs, layers = [], []

        def backend(gm, inputs):
            probe = FreezeParams(inputs)(copy.deepcopy(gm)).graph_module
            first = LocalizeShards()(probe)
            graphs.append((first.modified, LocalizeShards()(first.graph_module).modified, first.graph_module))
            compiled = fxquant.backend(gm, inputs, options={"recipe": "fp8_row", "inner": "eager"})
            layers.extend(compiled.result.layers)
            return compiled

        calls = float(model.calls)
        got = torch.compile(model, backend=backend)(x)
        torch.manual_seed(0)  # quantize_ on the same sharded model, built again
        in_place = Block().to(torch.bfloat16)
        parallelize_module(in_place, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel(),
                                            "up2": ColwiseParallel(), "out": RowwiseParallel(),
                                            "uneven": ColwiseParallel()})
        report = io.StringIO()
        with contextlib.redirect_stdout(report):
            fxquant.quantize_(in_place, {"recipe": "fp8_row", "report": True})
        quantized = in_place(x)
    modified, again, gm = graphs[0]
    reading_dtensors = [n.name for n in gm.graph.nodes if n.op == "call_function" and
                        any(isinstance(fetch_attr(gm, a), DTensor) for a in n.all_input_nodes)]
    shards = sorted(n.meta[SHARD_KEY] for n in gm.graph.nodes if SHARD_KEY in n.meta)
    return dict(modified=modified, again=again, reading_dtensors=reading_dtensors, shards=shards,
                writes=sum(n.op.startswith("call") and has_side_effects(n) for n in gm.graph.nodes),
                calls=(calls, float(model.calls)), layers={r.fqn: (r.recipe, r.reason) for r in layers},
                error=float((got.float() - eager.float()).norm() / eager.float().norm()),
                classes={name: type(getattr(in_place, name)).__name__
                         for name in ("up", "down", "up2", "out", "uneven")},
                report=report.getvalue(),
                quantize_error=float((quantized.float() - eager.float()).norm() / eager.float().norm()))


def test_linears_run_on_local_shards_and_a_row_parallel_bias_is_left_and_reported():
    for result in run(2, localize_on_two_ranks):
        assert result["modified"] and not result["again"]
        assert len(result["reading_dtensors"]) == 2  # out's linear and uneven's, left to DTensor
        assert result["shards"] == [(128, 256), (256,), (256, 128), (256, 128)]  # down's, up's bias, up's, up2's
        assert result["writes"] == 1 and result["calls"] == (1.0, 2.0)  # the compiled call wrote the buffer once
        assert all(result["layers"][name][0] == "fp8_row" for name in ("up", "down", "up2"))
        assert result["layers"]["out"] == result["layers"]["uneven"] == (None, SHARDED_REASON)
        assert result["error"] < 0.05  # fp8 per row and per token, against the sharded bf16 model
        # quantize_ takes the same three; the row-parallel bias and the uneven split stay, with quantize_'s reasons
        assert result["classes"] == {"up": "QuantizedLinear", "down": "QuantizedLinear", "up2": "QuantizedLinear",
                                     "out": "Linear", "uneven": "Linear"}
        rows = layer_rows(result["report"])
        assert LAYOUT_REASON in rows["out"] and LAYOUT_REASON in rows["uneven"]  # on both ranks, 129 rows or 128
        assert result["quantize_error"] < 0.05

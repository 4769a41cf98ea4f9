"""In-place writes survive every pass: each spelling of a mutation is kept, and no rewrite merges or moves a read
across a write. Purity comes from op schemas (side_effects.py), so every spelling below is covered by one rule."""

import operator

import pytest
import torch
import torch.nn as nn
from hf_models import dynamo_graph
from models import rel_err
from torch.fx.passes.infra.pass_manager import PassManager

import fxquant  # noqa: F401  (registers the backend)
from fxquant.config import QuantConfig
from fxquant.passes.cleanup import Cleanup
from fxquant.passes.detect import Detect
from fxquant.passes.freeze_params import FreezeParams
from fxquant.passes.fuse_linear import FuseLinear
from fxquant.passes.fuse_norm import FuseNorm
from fxquant.passes.merge_linear import MergeLinear
from fxquant.passes.quantize_linear import QuantizeLinear
from fxquant.passes.side_effects import Writes, alias_root, has_side_effects
from fxquant.passes.state import PipelineState
from fxquant.passes.upcast import Upcast

D = 128
WRITES = {
    "index_copy_ method": lambda cache, pos, y: cache.index_copy_(0, pos, y),
    "index_copy_ function": lambda cache, pos, y: torch.Tensor.index_copy_(cache, 0, pos, y),
    "aten index_copy_": lambda cache, pos, y: torch.ops.aten.index_copy_(cache, 0, pos, y),
    "copy_ of a slice": lambda cache, pos, y: cache[1:2].copy_(y),
    "setitem": lambda cache, pos, y: operator.setitem(cache, pos, y),
    "index_put_": lambda cache, pos, y: cache.index_put_((pos,), y),
    "add_": lambda cache, pos, y: cache.add_(y.expand_as(cache)),
    "augmented assignment": lambda cache, pos, y: operator.iadd(cache, y.expand_as(cache)),
    "out=": lambda cache, pos, y: torch.add(cache, y.expand_as(cache), out=cache),
}


class Writer(nn.Module):
    """The repro of a static KV cache: a buffer written in place, the write's result unused."""

    def __init__(self, write):
        super().__init__()
        self.register_buffer("cache", torch.zeros(4, D))
        self.fc = nn.Linear(D, D)
        self.write = write

    def forward(self, x, pos):  # x: [1, D]
        self.write(self.cache, pos, self.fc(x))
        return self.cache.sum(0)


@pytest.mark.parametrize("spelling", list(WRITES))
def test_every_spelling_of_a_write_survives_the_backend(spelling):
    x, pos = torch.randn(1, D), torch.tensor([1])
    expected = Writer(WRITES[spelling])
    with torch.no_grad():
        want = expected(x, pos)
    model = Writer(WRITES[spelling])
    model.load_state_dict(expected.state_dict() | {"cache": torch.zeros(4, D)})
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(model, backend="fxquant", options={"include": ["^nothing$"], "inner": "eager"})(x, pos)
    assert model.cache.abs().sum() > 0
    torch.testing.assert_close(model.cache, expected.cache)
    torch.testing.assert_close(got, want)


def test_side_effects_come_from_schemas():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    pure = [graph.call_method("add", (x, x)), graph.call_function(torch.index_copy, (x, 0, x, x)),
            graph.call_function(operator.getitem, (x, 0)), graph.call_method("view", (x, -1))]
    impure = [graph.call_method("index_copy_", (x, 0, x, x)), graph.call_function(torch.Tensor.copy_, (x, x)),
              graph.call_function(operator.setitem, (x, 0, x)), graph.call_function(operator.iadd, (x, x)),
              graph.call_function(torch.add, (x, x), {"out": x}), graph.call_method("zero_", (x,)),
              graph.call_function(torch.ops.aten.index_put_.default, (x, [x], x))]
    assert [has_side_effects(n) for n in pure] == [False] * len(pure)
    assert [has_side_effects(n) for n in impure] == [True] * len(impure)


def test_a_write_between_two_nodes_counts_where_it_may_reach_the_memory_read():
    """Writes.reaches follows in-place results and views back to the memory they alias: k's own write through a
    view reaches k; v's write does not; an assert (effectful, writing nothing by its aten schema) does not."""
    graph = torch.fx.Graph()
    k, v, x = graph.placeholder("k"), graph.placeholder("v"), graph.placeholder("x")
    written_k = graph.call_method("index_copy_", (k, 2, x, x))
    read = graph.call_method("expand", (written_k, 2, -1))
    graph.call_method("index_copy_", (v, 2, x, x))
    graph.call_function(torch.ops.aten._assert_tensor_metadata.default, (x,))
    last = graph.call_function(torch.matmul, (read, x))
    assert not Writes(graph).reaches([written_k], read, last)
    assert Writes(graph).reaches([v], read, last)
    with graph.inserting_before(last):
        graph.call_function(operator.setitem, (graph.call_function(operator.getitem, (k, 0)), 0, x))
    assert Writes(graph).reaches([written_k], read, last)  # k[0][0] = x
    # a call aten has no op for may return its input itself (x.float() of an fp32 x); a product never does
    assert alias_root(graph.call_method("float", (read,))) is k
    assert alias_root(graph.call_function(torch.matmul, (read, x))).target is torch.matmul


class NormLinearsWrite(nn.Module):
    """A Llama attention's shape in small: residual add, norm, q/k/v on its output, k and v written to a cache."""

    def __init__(self):
        super().__init__()
        self.register_buffer("cache", torch.zeros(2, 4, 256, dtype=torch.bfloat16))
        self.norm = nn.RMSNorm(256, eps=1e-6)
        self.q, self.k, self.v = (nn.Linear(256, 256, bias=False) for _ in range(3))

    def forward(self, x, r, pos):  # x, r: [1, 256]
        h = x + r
        n = self.norm(h)
        self.cache[0].index_copy_(0, pos, self.k(n))
        self.cache[1][pos] = self.v(n)
        return self.q(n) + self.cache.float().sum((0, 1)), h


# The pipeline's passes in order, each made from the shared state and the captured inputs.
PASSES = [lambda state, inputs: FreezeParams(inputs), lambda state, inputs: Detect(),
          lambda state, inputs: Upcast(state), lambda state, inputs: QuantizeLinear(state),
          lambda state, inputs: FuseNorm(state), lambda state, inputs: MergeLinear(state),
          lambda state, inputs: FuseLinear(), lambda state, inputs: Cleanup()]


@pytest.mark.parametrize("recipe", ["fp8_block", "int8_wo"])
def test_every_pass_keeps_the_cache_writes(recipe):
    torch.manual_seed(0)
    model = NormLinearsWrite().to(torch.bfloat16).eval()
    x, r, pos = torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(1, 256, dtype=torch.bfloat16), torch.tensor([2])
    with torch.no_grad():
        model(x, r, pos)
    want = model.cache.clone()
    gm, inputs = dynamo_graph(model, x, r, pos, fullgraph=True)
    state = PipelineState(QuantConfig(recipe=recipe))
    for make in PASSES:
        one = make(state, inputs)
        gm = PassManager(passes=[one], steps=1)(gm).graph_module
        model.cache.zero_()
        with torch.no_grad():
            gm(*inputs)
        assert rel_err(model.cache, want) < 0.05, type(one).__name__


class ReadWriteRead(nn.Module):
    """Two linears read one buffer with a write between them: they are no siblings."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.randn(4, 256))
        self.q, self.k = nn.Linear(256, 256, bias=False), nn.Linear(256, 256, bias=False)

    def forward(self, x):  # x: [4, 256]
        a = self.q(self.state)
        self.state.add_(x)
        return a, self.k(self.state)


class NormWriteLinear(nn.Module):
    """A norm's output is read after a write to the norm's input: fusing the norm into the linear's quantizer would
    move the norm past the write."""

    def __init__(self):
        super().__init__()
        self.register_buffer("state", torch.randn(4, 256))
        self.norm, self.q = nn.RMSNorm(256, eps=1e-6), nn.Linear(256, 256, bias=False)

    def forward(self, x):  # x: [4, 256]
        n = self.norm(self.state)
        self.state.zero_()
        return self.q(n) + x


@pytest.mark.parametrize("recipe", ["fp8_row", "int8_wo"])
@pytest.mark.parametrize("module", [ReadWriteRead, NormWriteLinear])
def test_no_rewrite_moves_a_read_across_a_write(module, recipe):
    torch.manual_seed(0)
    expected, model = module().eval(), module().eval()
    model.load_state_dict(expected.state_dict())
    x = torch.randn(4, 256)
    torch._dynamo.reset()
    with torch.no_grad():
        want = expected(x)
        got = torch.compile(model, backend="fxquant", options={"recipe": recipe, "inner": "eager"})(x)
    for g, w in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want), strict=True):
        assert rel_err(g, w) < 0.05
    torch.testing.assert_close(model.state, expected.state)


def test_fuse_linear_keeps_a_quantizer_a_write_separates_from_its_gemm():
    """quantize_fp8(x); x.add_(1); scaled_mm_fp8(...): the fused op would quantize x after the write."""
    from fxquant.numerics import reference as R

    root, graph = nn.Module(), torch.fx.Graph()
    q = R.quantize(torch.randn(256, 256), "fp8_e4m3", "channel")
    root.register_buffer("w", q.data)
    root.register_buffer("w_scale", q.scale)
    x = graph.placeholder("x")
    quantized = graph.call_function(torch.ops.fxquant.quantize_fp8.default, (x, 0))
    codes, scales = (graph.call_function(operator.getitem, (quantized, i)) for i in (0, 1))
    graph.call_method("add_", (x, 1.0))
    w, w_scale = graph.get_attr("w"), graph.get_attr("w_scale")
    graph.output(graph.call_function(torch.ops.fxquant.scaled_mm_fp8.default,
                                     (codes, scales, w, w_scale, None, torch.float32)))
    gm = torch.fx.GraphModule(root, graph)
    x = torch.randn(4, 256)
    want = gm(x.clone())
    assert not FuseLinear()(gm).modified
    torch.testing.assert_close(gm(x.clone()), want, rtol=0, atol=0)

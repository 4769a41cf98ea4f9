"""pack_lanes: 4-bit linears a graph quantized get the mma.sync decode kernels' per-lane scales, one copy shared by
every graph and re-packed when the weight is re-quantized: int4, MXFP4 and NVFP4 unless the option fp4_lanes is off,
and int4_fp8's W4A8 linears under the option int4_fp8_lanes.

On the CPU the pass is made to run (`kernel_serves` patched) and the lanes ops run linear_weight_only's reference, so
outputs match the unpacked graph bit for bit; the GPU tests run the kernels in a decode."""

import copy
import warnings
from collections import Counter

import pytest
import torch
from hf_models import TOWARD_ZERO, compiled, decoder, fake_quantized, static_decode, traced, within_bound

import fxquant
from fxquant.compile.backend import fxquant as fxquant_backend
from fxquant.compile.pipeline import run_pipeline
from fxquant.config import RECIPES, QuantConfig
from fxquant.kernels import gemm_int4_mma
from fxquant.kernels.code_tiles import is_tiled, untile_codes
from fxquant.kernels.gemm_fp4_mma import pack_fp4_lanes
from fxquant.kernels.gemm_int4_mma import pack_lanes
from fxquant.ops import linear as linear_ops
from fxquant.passes import pack_lanes as lanes_pass
from fxquant.quantization.weight_store import LANES_KEY, tiles_chosen

INT4_WO_SCALES = RECIPES["int4_wo"].scale_mode  # how the recipe picks its group scales, to quantize as it does

LANES = torch.ops.fxquant.linear_int4_lanes.default
FP4_LANES = torch.ops.fxquant.linear_fp4_lanes.default
W4A8 = torch.ops.fxquant.scaled_mm_int4_fp8.default
W4A8_LANES = torch.ops.fxquant.scaled_mm_int4_fp8_lanes.default
WEIGHT_ONLY = torch.ops.fxquant.linear_weight_only.default
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROMPT = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
# the linears of one Llama layer after merge_linear: q/k/v and gate/up merged, o and down alone; NVFP4's per-weight
# global scales keep all seven apart
LINEARS = {"int4_wo": 4, "int4_sym_wo": 4, "mxfp4_wo": 4, "nvfp4_wo": 7, "int4_fp8": 4}


@pytest.fixture
def serves(monkeypatch):
    """The pass runs on the CPU too: its rewrite and bookkeeping are device-independent."""
    monkeypatch.setattr(lanes_pass, "kernel_serves", lambda scale, e4m3=False: True)


def compile_collecting(model, recipe="int4_wo", **options):
    """The model under the fxquant backend, and the list of its compiled callables (one per graph)."""
    callables = []

    def backend(gm, inputs):
        callables.append(fxquant_backend(gm, inputs, options={"recipe": recipe, "inner": "eager", **options}))
        return callables[-1]

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, fullgraph=True), callables


def lanes_buffers(gm):
    """(scale, zero point, their per-lane copies) of each packed weight of gm; None for a symmetric weight's zero
    point and its copy."""
    attr = lambda name: getattr(gm, name) if name else None
    return [(attr(s), attr(z), attr(f"{s}_lanes"), attr(z and f"{z}_lanes")) for s, z, _ in gm.meta[LANES_KEY]]


def packed_as_lanes(scale, zero, lane_scale, lane_zero, fmt="int4") -> bool:
    """Whether the per-lane copies hold the format's packing of the scales and zero points as they are now."""
    want_scale, want_zero = pack_lanes(scale, zero) if fmt == "int4" else (pack_fp4_lanes(scale, fmt), None)
    return torch.equal(lane_scale, want_scale) and (
        lane_zero is want_zero is None or torch.equal(lane_zero, want_zero))


def formats(gm):
    """The format of each packed weight of gm, in lanes_buffers' order."""
    return [fmt for _, _, fmt in gm.meta[LANES_KEY]]


def test_int4_linears_take_the_lanes_op_with_the_same_numbers(serves, monkeypatch):
    model = decoder("llama", num_hidden_layers=1)
    fn, callables = compile_collecting(model)
    with torch.no_grad():
        logits = fn(PROMPT, use_cache=False).logits
    gm = callables[0].result.gm
    counts = Counter(node.target for node in gm.graph.nodes)
    assert counts[LANES] == 4 and counts[WEIGHT_ONLY] == 0  # q/k/v and gate/up merged, o and down alone
    for scale, zero, lane_scale, lane_zero in lanes_buffers(gm):
        packed = pack_lanes(scale, zero)
        assert torch.equal(lane_scale, packed[0]) and torch.equal(lane_zero, packed[1])

    monkeypatch.setattr(lanes_pass, "kernel_serves", lambda scale, e4m3=False: False)
    fn, callables = compile_collecting(model)
    with torch.no_grad():
        assert torch.equal(fn(PROMPT, use_cache=False).logits, logits)
    assert Counter(node.target for node in callables[0].result.gm.graph.nodes)[WEIGHT_ONLY] == 4


@pytest.mark.parametrize("recipe", ["mxfp4_wo", "nvfp4_wo"])
def test_fp4_linears_take_their_lanes_op_unless_told_not_to_with_the_same_numbers(serves, recipe):
    model = decoder("llama", num_hidden_layers=1)
    fn, callables = compile_collecting(model, recipe, fp4_lanes=False)
    with torch.no_grad():
        logits = fn(PROMPT, use_cache=False).logits
    counts = Counter(node.target for node in callables[0].result.gm.graph.nodes)
    assert counts[FP4_LANES] == 0 and counts[WEIGHT_ONLY] == LINEARS[recipe]  # the in-register GEMM

    fn, callables = compile_collecting(model, recipe)  # fp4_lanes by default
    with torch.no_grad():
        assert torch.equal(fn(PROMPT, use_cache=False).logits, logits)
    gm = callables[0].result.gm
    counts = Counter(node.target for node in gm.graph.nodes)
    assert counts[FP4_LANES] == LINEARS[recipe] and counts[WEIGHT_ONLY] == 0
    fmt = recipe.removesuffix("_wo")
    assert formats(gm) == [fmt] * LINEARS[recipe]
    assert all(zero is None and packed_as_lanes(*buffers, fmt) for buffers in lanes_buffers(gm)
               for zero in [buffers[1]])


def test_w4a8_linears_take_their_lanes_op_under_its_option_with_the_same_numbers(serves):
    model = decoder("llama", num_hidden_layers=1)
    fn, callables = compile_collecting(model, "int4_fp8", int4_fp8_lanes=False)
    with torch.no_grad():
        logits = fn(PROMPT, use_cache=False).logits
    counts = Counter(node.target for node in callables[0].result.gm.graph.nodes)
    assert counts[W4A8_LANES] == 0 and counts[W4A8] == 4

    fn, callables = compile_collecting(model, "int4_fp8")  # int4_fp8_lanes on by default
    with torch.no_grad():
        assert torch.equal(fn(PROMPT, use_cache=False).logits, logits)
    gm = callables[0].result.gm
    counts = Counter(node.target for node in gm.graph.nodes)
    assert counts[W4A8_LANES] == 4 and counts[W4A8] == 0
    assert formats(gm) == ["int4"] * 4
    assert all(packed_as_lanes(*buffers) for buffers in lanes_buffers(gm))


def test_a_second_graph_shares_the_lanes_and_a_changed_weight_repacks_them(serves):
    model = decoder("llama", num_hidden_layers=1)
    fn, callables = compile_collecting(model)
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    saved = k_proj.detach().clone()
    try:
        with torch.no_grad():
            fn(PROMPT, use_cache=False)
            fn(PROMPT[:, :5], use_cache=False)  # another static shape: a second graph
            assert len(callables) == 2
            first, second = (lanes_buffers(c.result.gm) for c in callables)
            assert [t.data_ptr() for entry in first for t in entry[2:]] == [
                t.data_ptr() for entry in second for t in entry[2:]]
            k_proj.mul_(-3.0)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                fn(PROMPT, use_cache=False)
    finally:
        with torch.no_grad():
            k_proj.copy_(saved)
    assert any("k_proj changed after compile" in str(w.message) for w in caught)
    for scale, zero, lane_scale, lane_zero in lanes_buffers(callables[0].result.gm):
        packed = pack_lanes(scale, zero)
        assert torch.equal(lane_scale, packed[0]) and torch.equal(lane_zero, packed[1])
    fresh = fxquant.quantize(saved.mul(-3.0), "int4", ("group", 128), scale_mode=INT4_WO_SCALES)  # rows 256..384
    qkv_scale = lanes_buffers(callables[1].result.gm)[0][0]
    assert torch.equal(qkv_scale[256:384], fresh.scale)


def test_int4_codes_in_tiles_are_the_graphs_one_copy_give_the_same_numbers_and_take_a_re_quantization(serves):
    model = decoder("llama", num_hidden_layers=1)
    fn, callables = compile_collecting(model, int4_code_tiles=False)
    with torch.no_grad():
        logits = fn(PROMPT, use_cache=False).logits
    fn, callables = compile_collecting(model, int4_code_tiles=True)
    k_proj = model.model.layers[0].self_attn.k_proj.weight
    saved = k_proj.detach().clone()
    try:
        with torch.no_grad():
            assert torch.equal(fn(PROMPT, use_cache=False).logits, logits)
            gm = callables[0].result.gm
            codes = [getattr(gm, node.args[1].target) for node in gm.graph.nodes if node.target is LANES]
            assert len(codes) == 4 and all(is_tiled(c) for c in codes)  # q/k/v and gate/up merged as tiles
            assert all(is_tiled(t) for name, t in gm.named_buffers() if "qdata" in name)  # no codes in rows beside
            k_proj.mul_(-3.0)  # the backend re-quantizes it into its rows of the merged tiles
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                fn(PROMPT, use_cache=False)
    finally:
        with torch.no_grad():
            k_proj.copy_(saved)
    fresh = fxquant.quantize(saved.mul(-3.0), "int4", ("group", 128), scale_mode=INT4_WO_SCALES)  # k_proj's rows
    assert torch.equal(untile_codes(codes[0])[256:384], fresh.data)
    q_proj = fxquant.quantize(model.model.layers[0].self_attn.q_proj.weight, "int4", ("group", 128),
                              scale_mode=INT4_WO_SCALES)
    assert torch.equal(untile_codes(codes[0])[:256], q_proj.data)


@pytest.mark.parametrize(("option", "recipe", "shape", "expected"), [
    (None, "int4_wo", (128, 256), False),  # the CPU: the reference would only untile them
    (True, "int4_wo", (128, 256), True),
    (True, "int4_sym_wo", (128, 256), True),
    (True, "int4_wo", (96, 256), False),  # N not a multiple of a tile's 64 rows
    (True, "int4_fp8", (128, 256), True),  # W4A8's kernels read tiles too
    (None, "int4_fp8", (128, 256), False),
    (True, "int8_wo", (128, 256), False),
    (False, "int4_wo", (128, 256), False),
])
def test_tiles_are_chosen_for_int4_codes_whose_shape_tiles_where_the_option_asks(option, recipe, shape, expected):
    assert tiles_chosen(QuantConfig(int4_code_tiles=option), RECIPES[recipe], torch.zeros(shape)) is expected


def test_w4a8_codes_in_tiles_give_the_same_numbers_through_both_its_ops(serves):
    """int4_fp8's codes tiled: its lanes op (one row) and its W4A8 op (the prompt's rows) read them, the reference
    untiling them on the CPU."""
    model = decoder("llama", num_hidden_layers=1)
    fn, _ = compile_collecting(model, "int4_fp8", int4_code_tiles=False)
    ids = PROMPT[:, :1]  # one row: the lanes op's kernel case
    with torch.no_grad():
        logits, one = fn(PROMPT, use_cache=False).logits, fn(ids, use_cache=False).logits
    fn, callables = compile_collecting(model, "int4_fp8", int4_code_tiles=True)
    with torch.no_grad():
        assert torch.equal(fn(PROMPT, use_cache=False).logits, logits)
        assert torch.equal(fn(ids, use_cache=False).logits, one)
    codes = [getattr(gm, node.args[2].target) for gm in (c.result.gm for c in callables) for node in gm.graph.nodes
             if node.target is W4A8_LANES]
    assert len(codes) >= 4 and all(is_tiled(c) for c in codes)


@pytest.mark.parametrize(("option", "fp4_lanes", "recipe", "expected"), [
    (True, True, "mxfp4_wo", True), (True, True, "nvfp4_wo", True), (None, True, "nvfp4_wo", False),
    (False, True, "mxfp4_wo", False), (True, True, "mxfp8", False),
    (True, False, "mxfp4_wo", False),  # FP4's codes tile only where their mma.sync kernel serves them
])
def test_fp4_codes_are_tiled_as_int4_s_under_fp4_lanes(option, fp4_lanes, recipe, expected):
    config = QuantConfig(int4_code_tiles=option, fp4_lanes=fp4_lanes)
    assert tiles_chosen(config, RECIPES[recipe], torch.zeros(128, 256)) is expected


@pytest.mark.parametrize("recipe", ["mxfp4_wo", "nvfp4_wo"])
def test_fp4_codes_in_tiles_give_the_same_numbers_through_their_lanes_op(serves, recipe):
    model = decoder("llama", num_hidden_layers=1)
    fn, _ = compile_collecting(model, recipe, int4_code_tiles=False)
    with torch.no_grad():
        logits = fn(PROMPT, use_cache=False).logits
    fn, callables = compile_collecting(model, recipe, int4_code_tiles=True)
    with torch.no_grad():
        assert torch.equal(fn(PROMPT, use_cache=False).logits, logits)
    gm = callables[0].result.gm
    codes = [getattr(gm, node.args[1].target) for node in gm.graph.nodes if node.target is FP4_LANES]
    assert len(codes) == LINEARS[recipe] and all(is_tiled(c) for c in codes)


@pytest.mark.parametrize("recipe", ["int4_wo", "int4_sym_wo", "mxfp4_wo", "nvfp4_wo", "int4_fp8"])
def test_quantize_inplace_weights_take_the_lanes_op_and_a_loaded_state_re_packs_their_lanes(serves, recipe):
    """quantize_'s parameters (a loaded checkpoint's) are the model's state: the per-lane copy follows them, re-packed
    on the first call after a load_state_dict, with no recompile."""
    model = fxquant.quantize_(decoder("llama", num_hidden_layers=1), {"recipe": recipe})
    fn, callables = compile_collecting(model, recipe)
    with torch.no_grad():
        fn(PROMPT, use_cache=False)
    gm = callables[0].result.gm
    counts = Counter(node.target for node in gm.graph.nodes)
    lanes_op = FP4_LANES if "fp4" in recipe else W4A8_LANES if recipe == "int4_fp8" else LANES
    assert counts[lanes_op] == LINEARS[recipe] and counts[WEIGHT_ONLY] == counts[W4A8] == 0
    other = fxquant.quantize_(decoder("llama", num_hidden_layers=1, seed=1), {"recipe": recipe})
    model.load_state_dict(other.state_dict())
    with torch.no_grad():
        logits = fn(PROMPT, use_cache=False).logits
    assert len(callables) == 1  # the same graph, its parameters changed in place
    fresh, _ = compile_collecting(other, recipe)
    with torch.no_grad():
        assert torch.equal(logits, fresh(PROMPT, use_cache=False).logits)  # a graph compiled over the loaded weights
    assert all(packed_as_lanes(*buffers, fmt) for buffers, fmt in zip(lanes_buffers(gm), formats(gm), strict=True))
    qkv_scale = lanes_buffers(gm)[0][0]
    assert torch.equal(qkv_scale[:256], other.model.layers[0].self_attn.q_proj.weight_scale)  # q's 256 rows


def test_the_kernel_is_asked_to_serve_one_to_eight_rows_and_refuses_others_by_name():
    with gemm_int4_mma.serving_up_to(8):
        assert gemm_int4_mma.serves_rows() == 8
    assert gemm_int4_mma.serves_rows() == 1
    with pytest.raises(ValueError, match="serves 1 to 8 rows, not 16"):
        gemm_int4_mma.serving_up_to(16)


def test_a_weight_whose_source_the_graph_does_not_know_keeps_the_row_major_kernel(serves):
    """An exported program's parameters: nothing would tell a per-lane copy stale."""
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    model = fxquant.quantize_(torch.nn.Sequential(torch.nn.Linear(256, 256)).to(torch.bfloat16), "int4_wo")
    result = run_pipeline(torch.export.export(model, (x,)).module(), QuantConfig(recipe="int4_wo"), (x,))
    counts = Counter(node.target for node in result.gm.graph.nodes)
    assert counts[LANES] == 0 and counts[WEIGHT_ONLY] == 1


def counted(monkeypatch, kernel: str) -> list:
    """A list that gains an entry each time linear_ops calls its kernel `kernel` (the kernel still runs)."""
    calls, original = [], getattr(linear_ops, kernel)
    monkeypatch.setattr(linear_ops, kernel, lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs))
    return calls


def small_decode(batch: int = 1):
    """A 2-layer Llama on the device, a prompt of 8 tokens and 3 decode steps for `batch` sequences."""
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 64, (batch, 8), generator=generator).to(DEVICE)
    steps = torch.randint(0, 64, (batch, 3), generator=generator).to(DEVICE)
    return decoder("llama", num_hidden_layers=2).to(DEVICE), prompt, steps


def bounded_by_fake_quantized(got, model, recipe, prompt, steps, plain=False) -> bool:
    """Whether a compiled decode's logits lie within the bound of the model's fake-quantized copies (hf_models)."""
    copies = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=plain), model
    return not within_bound(got, *(static_decode(m, traced(m), prompt, steps) for m in copies))


@pytest.mark.gpu
@pytest.mark.parametrize(("in_place", "batch"), [(False, 1), (True, 1), (False, 4)],
                         ids=["backend", "quantize_", "backend, 4 rows inside serving_up_to(8)"])
def test_a_small_batch_decode_runs_the_kernel_within_the_bound_of_its_fake_quantized_copy(monkeypatch, in_place,
                                                                                         batch):
    """Over the backend's codes (tiles on the GPU) and over quantize_'s (rows, the model's state); one row, or four
    where the kernel is asked to serve up to eight."""
    calls = counted(monkeypatch, "int4_mma_mm")
    model, prompt, steps = small_decode(batch)
    run = fxquant.quantize_(copy.deepcopy(model), "int4_wo") if in_place else model
    with gemm_int4_mma.serving_up_to(8 if batch > 1 else 1):
        got = static_decode(run, compiled(run, recipe="int4_wo"), prompt, steps)
    assert len(calls) >= 3 * 8  # every decode step's 8 int4 GEMMs (2 layers) on the kernel
    assert bounded_by_fake_quantized(got, model, "int4_wo", prompt, steps)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["mxfp4_wo", "nvfp4_wo"])
def test_an_fp4_decode_runs_the_kernel_within_the_bound_of_its_fake_quantized_copy(monkeypatch, recipe):
    """MXFP4's values and scales are exact in bf16, so its plain copy is the exact one and bounds nothing (the H100
    put two of the kernel's decode steps 5.3e-3 and 5.8e-3 rad from both): its bound is the exact sums each rounded
    toward zero, the other rounding of every output that the kernel's once-rounded fp32 sums may take."""
    calls = counted(monkeypatch, "fp4_mma_mm")
    model, prompt, steps = small_decode()
    got = static_decode(model, compiled(model, recipe=recipe), prompt, steps)
    assert len(calls) >= 3 * 2 * LINEARS[recipe]  # every decode step's FP4 GEMMs (2 layers) on the kernel
    plain = TOWARD_ZERO if recipe == "mxfp4_wo" else False
    assert bounded_by_fake_quantized(got, model, recipe, prompt, steps, plain)


@pytest.mark.gpu
def test_a_w4a8_decode_under_int4_fp8_lanes_runs_the_kernel_within_the_bound_of_its_fake_quantized_copy(monkeypatch):
    """int4_fp8's one-row GEMMs on the int4 kernel over their e4m3 activations (the option int4_fp8_lanes, on by
    default)."""
    calls = counted(monkeypatch, "int4_mma_mm")
    model, prompt, steps = small_decode()
    got = static_decode(model, compiled(model, recipe="int4_fp8"), prompt, steps)
    assert len(calls) >= 3 * 8  # every decode step's 8 W4A8 GEMMs (2 layers) on the kernel
    assert bounded_by_fake_quantized(got, model, "int4_fp8", prompt, steps)

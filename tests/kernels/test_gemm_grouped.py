"""The grouped GEMMs over rows sorted by expert, against the reference grouped product (TRITON_INTERPRET=1 on the
CPU): empty experts, one row, uneven groups, rows past the last expert, split K; every weight scheme."""

import pytest
import torch

import fxquant.kernels.gemm_grouped as G
from fxquant.kernels.gemm_grouped import grouped_fp8_mm, grouped_int4_fp8_mm, grouped_weight_only_mm
from fxquant.kernels.gemm_grouped_tma import launch_grouped_tma
from fxquant.numerics import reference as R
from fxquant.ops import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, N, K = 4, 256, 256
# rows per expert, then rows that belong to no expert (past offs[-1])
ROUTINGS = {
    "uneven with an empty expert": ([5, 0, 19, 2], 0),
    "one row": ([0, 1, 0, 0], 0),
    "no expert has rows": ([0, 0, 0, 0], 3),
    "rows past the last expert": ([3, 4, 0, 6], 5),
    "a long group (several row tiles)": ([40, 1, 0, 2], 0),
}
# past 128 rows an active expert (570 over 4: 143 each on average), where some grouped GEMMs change route; uneven row
# counts, as routing gives them (W4A8 experts' once failed in cuBLAS on the H200, which counts is not established)
MANY_ROWS = {"past 128 rows an active expert, rows past the last": ([301, 0, 179, 90], 7)}
WEIGHT_ONLY = {"int8": ("channel", 0), "int4": (None, 128), "mxfp4": (None, 32), "nvfp4": (None, 16),
               "mxfp8": (None, 32)}
FP8 = {"per channel, per token": ("channel", 0), "128x128 blocks, 1x128 groups": (("block", 128, 128), 128),
       "per tensor": ("tensor", -1)}
# The kernels multiply the reference's operands exactly and accumulate in fp32 in another order, then round once
# to bf16: a few bf16 ulps on a few elements at most.
REL_ERROR = 2e-3


def routing(name):
    counts, tail = {**ROUTINGS, **MANY_ROWS}[name]
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    return offs, sum(counts) + tail


def rel_error(got, ref):
    return float((got.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30))


def check(got, ref, offs):
    end = int(offs[-1])
    assert got.shape == ref.shape and got.dtype == ref.dtype
    assert torch.equal(got[end:], torch.zeros_like(got[end:]))  # rows no expert owns
    if end:
        assert rel_error(got[:end], ref[:end]) < REL_ERROR


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("fmt", list(WEIGHT_ONLY))
def test_grouped_weight_only(fmt, name):
    torch.manual_seed(0)
    offs, m = routing(name)
    granularity, group = WEIGHT_ONLY[fmt]
    x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
    if fmt == "mxfp8":  # the op hands the kernel activations already rounded to their MXFP8 values
        x = R.dequantize(R.quantize(x, "mxfp8"), torch.bfloat16)
    q = R.quantize_experts(torch.randn(E, N, K, device=DEVICE), fmt, granularity)
    got = grouped_weight_only_mm(x, offs, q.data, q.scale, fmt, group, N, zero_point=q.zero_point,
                                 global_scale=q.global_scale)
    check(got, R.grouped_linear(x, offs, q), offs)


@pytest.mark.parametrize("blocks", [True, False], ids=["column_blocks", "every_column_at_once"])
@pytest.mark.parametrize("tail", [0, 7], ids=["every_row_owned", "rows_past_the_last_expert"])
@pytest.mark.parametrize("fmt", list(WEIGHT_ONLY))
def test_many_rows_take_the_experts_dequantized(fmt, tail, blocks, monkeypatch):
    """Past DEQUANTIZE_ABOVE_M rows per active expert the experts are dequantized to bf16, each weight rounded once
    (half a bf16 ulp), for torch._grouped_mm, in column blocks when they are large: each row is its expert's fp64
    product of the dequantized operands within that rounding, fp32 accumulation's error and one ulp at the store
    (the dense dequantized product's bound, tests/kernels/test_gemm_weight_only.py); an empty expert among them, and
    rows no expert owns zero, which grouped_mm leaves unwritten."""
    from fxquant.kernels import gemm_grouped

    if blocks:  # column blocks of 96, 96 and 64: their seams
        monkeypatch.setattr(gemm_grouped, "EXPERTS_AT_ONCE_ELEMENTS", E * K * 96)
    gen = torch.Generator().manual_seed(1)
    counts = [300, 0, 180, 90]  # 570 rows over 4 experts: 143 each on average, past 128
    offs = torch.tensor(counts).cumsum(0).to(torch.int32).to(DEVICE)
    granularity, group = WEIGHT_ONLY[fmt]
    x = torch.randn(sum(counts) + tail, K, generator=gen).to(DEVICE, torch.bfloat16)
    if fmt == "mxfp8":
        x = R.dequantize(R.quantize(x, "mxfp8"), torch.bfloat16)
    q = R.quantize_experts(torch.randn(E, N, K, generator=gen).to(DEVICE), fmt, granularity)
    got = grouped_weight_only_mm(x, offs, q.data, q.scale, fmt, group, N, zero_point=q.zero_point,
                                 global_scale=q.global_scale)
    exact, bound = torch.zeros(x.shape[0], N, dtype=torch.float64), torch.zeros(x.shape[0], N, dtype=torch.float64)
    for e, rows in R.expert_rows(offs.cpu()):
        w_hp = R.dequantize(R.expert(q, e), torch.float64).cpu()
        exact[rows], bound[rows] = x[rows].double().cpu() @ w_hp.T, x[rows].double().abs().cpu() @ w_hp.abs().T
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))) * torch.finfo(torch.bfloat16).eps
    assert got.shape == (x.shape[0], N) and got.dtype == torch.bfloat16
    assert torch.equal(got[sum(counts):], torch.zeros_like(got[sum(counts):]))  # rows no expert owns
    assert ((got.double().cpu() - exact).abs() <= ulp + (2**-20 + 2**-8) * bound).all()


@pytest.mark.parametrize("name", list(ROUTINGS))
@pytest.mark.parametrize("scheme", list(FP8))
def test_grouped_fp8(scheme, name):
    torch.manual_seed(0)
    offs, m = routing(name)
    granularity, group = FP8[scheme]
    x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
    a, a_scale = quantize_fp8(x, group)
    q = R.quantize_experts(torch.randn(E, N, K, device=DEVICE), "fp8_e4m3", granularity)
    got = grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, torch.bfloat16)
    qa = R.quantize(x, "fp8_e4m3", {0: "token", -1: "tensor"}.get(group, ("group", group)))
    check(got, R.grouped_linear(R.dequantize(qa, torch.float32), offs, q, torch.bfloat16), offs)


@pytest.mark.parametrize("name", list(ROUTINGS) + list(MANY_ROWS))
def test_grouped_order_of_row_tiles_changes_no_bit(name):
    """Row tiles taken GROUP_M at a time (grouped order, for the weight's reuse in L2) are the same tiles as taken
    one at a time: the output is bit for bit the same at every group size, 3 leaving a short last group, and the
    exact product's to the kernel's bound."""
    torch.manual_seed(0)
    offs, m = routing(name)
    x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
    a, a_scale = quantize_fp8(x, 0)
    q = R.quantize_experts(torch.randn(E, N, K, device=DEVICE), "fp8_e4m3", "channel")
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2)
    got = {g: grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, torch.bfloat16, config={**tiles, "GROUP_M": g})
           for g in (1, 3, 8)}
    assert torch.equal(got[1], got[3]) and torch.equal(got[1], got[8])
    qa = R.quantize(x, "fp8_e4m3", "token")
    check(got[8], R.grouped_linear(R.dequantize(qa, torch.float32), offs, q, torch.bfloat16), offs)


@pytest.fixture
def tma_launches(monkeypatch):
    """The launches of the TMA grouped kernel (`gemm_grouped_tma`), which still run."""
    launches = []
    monkeypatch.setattr(G, "launch_grouped_tma", lambda *a, **k: launches.append(1) or launch_grouped_tma(*a, **k))
    return launches


def row_scaled_experts(name, n):
    """(offs, per-token e4m3 activations, their scales, per-channel e4m3 experts [E, n, K], the reference product)."""
    torch.manual_seed(0)
    offs, m = routing(name)
    x = torch.randn(m, K, device=DEVICE, dtype=torch.bfloat16)
    a, a_scale = quantize_fp8(x, 0)
    q = R.quantize_experts(torch.randn(E, n, K, device=DEVICE), "fp8_e4m3", "channel")
    qa = R.quantize(x, "fp8_e4m3", "token")
    return offs, a, a_scale, q, R.grouped_linear(R.dequantize(qa, torch.float32), offs, q, torch.bfloat16)


@pytest.mark.parametrize("n", [N, 200], ids=["N 256", "N 200 (tiles reach the next expert's rows)"])
@pytest.mark.parametrize("name", list(ROUTINGS) + list(MANY_ROWS))
def test_grouped_fp8_through_tensor_descriptors(name, n, tma_launches):
    """Row scales through TMA (`gemm_grouped_tma`): a tile's rows run on past its expert's last, and its weight
    rows past N into the next expert's, and neither is stored; every owned row is the reference's, the others zero."""
    offs, a, a_scale, q, reference = row_scaled_experts(name, n)
    tiles = dict(TMA=True, BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=2, num_warps=4, num_stages=3)
    got = grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, torch.bfloat16, config=tiles)
    assert tma_launches == [1]
    check(got, reference, offs)


@pytest.mark.parametrize("rows, tma, tiles", [(1024, False, None), (2048, True, (128, 4)), (8192, True, (256, 3))],
                         ids=["128 an expert: pointers", "256 an expert: TMA 128x128", "1024 an expert: TMA 256x128"])
def test_the_plan_feeds_row_scales_through_tma_past_128_rows_an_expert(rows, tma, tiles):
    """Mixtral's gate/up over 8 experts: row scales past 128 rows an expert take the TMA kernel, 256 rows a tile past
    512 an expert; W4A8's channel groups take it at 128x128 past 128 rows an expert; block scales keep pointers at
    every size."""
    grid, split, got_tma, meta = G._fp8_plan(rows, 28672, 4096, 8, False, False, ())
    assert (got_tma, split) == (tma, 1)
    if tiles:
        assert (meta["BLOCK_M"], meta["num_stages"], meta["BLOCK_N"], meta["num_warps"]) == (*tiles, 128, 8)
    _, split, got_tma, meta = G._fp8_plan(rows, 28672, 4096, 8, True, True, ())
    assert (got_tma, split) == (tma, 1)
    if tiles:
        assert (meta["BLOCK_M"], meta["BLOCK_N"], meta["num_warps"], meta["num_stages"]) == (128, 128, 8, 4)
    assert not G._fp8_plan(rows, 28672, 4096, 8, True, False, ())[2]
    assert not G._fp8_plan(rows, 28672, 4096, 8, False, False, (("TMA", False),))[2]


@pytest.mark.parametrize("name", list(MANY_ROWS))
def test_grouped_fp8_past_128_rows_an_expert_as_planned(name, tma_launches, monkeypatch):
    """No config, where torch's CUTLASS route does not take the product (it does on sm_90: test_cutlass_grouped.py):
    the row-scaled product past 128 rows an active expert runs the TMA kernel at the plan's tiles and is the
    reference's, as the pointer kernel's is."""
    monkeypatch.setattr(G, "cutlass_supports", lambda *args: "the Triton kernels' plan under test")
    offs, a, a_scale, q, reference = row_scaled_experts(name, N)
    got = grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, torch.bfloat16)
    assert tma_launches == [1]
    check(got, reference, offs)
    on_pointers = grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, torch.bfloat16, config=dict(TMA=False))
    assert tma_launches == [1] and rel_error(got, on_pointers) < REL_ERROR


# The W4A8 experts' output width: half of N, and half the interpreter's work, yet two blocks of 64 columns, so that
# the column-blocked routes still write more than one
W4A8_N = 128


def unwritten(m):
    """The W4A8 routes' output before they write it: NaN, so that a row left unwritten shows."""
    return torch.full((m, W4A8_N), float("nan"), dtype=torch.bfloat16, device=DEVICE)


def w4a8_experts(name, symmetric, k, scale_mode=None):
    """(offs, rows, quantized activations, each expert's quantized weight, the experts stacked) for a routing."""
    gen = torch.Generator().manual_seed(len(name) + k)
    offs, m = routing(name)
    x = torch.randn(m, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(E, W4A8_N, k, generator=gen) + 0.3).to(DEVICE)
    experts = [R.quantize(w[e], "int4", ("group", 128), symmetric=symmetric, scale_mode=scale_mode)
               for e in range(E)]
    return offs, m, R.quantize(x, "fp8_e4m3", "token"), experts, R.stack_experts(experts)


def assert_w4a8_product(got, offs, qa, experts):
    """Each owned row is its expert's fp64 product of the dequantized operands, to the fp32 accumulation's error
    and one bf16 rounding; rows no expert owns are zero."""
    m, end = qa.data.shape[0], int(offs[-1])
    a_hp = R.dequantize(qa, torch.float64)
    exact, bound = (torch.zeros(m, W4A8_N, dtype=torch.float64, device=DEVICE) for _ in range(2))
    for e, rows in R.expert_rows(offs):
        w_hp = R.dequantize(experts[e], torch.float64)
        exact[rows], bound[rows] = a_hp[rows] @ w_hp.T, a_hp[rows].abs() @ w_hp.abs().T
    ulp = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(1e-30)))) * torch.finfo(torch.bfloat16).eps
    tolerance = ulp + (2**-10 if DEVICE == "cuda" else 2**-20) * bound
    assert got.shape == (m, W4A8_N) and got.dtype == torch.bfloat16
    assert torch.equal(got[end:], torch.zeros_like(got[end:]))  # rows no expert owns
    assert ((got.double() - exact).abs() <= tolerance).all()
    assert end == 0 or got[:end].abs().max() > 0


@pytest.mark.parametrize("name", list(MANY_ROWS))
def test_w4a8_codes_made_e4m3_through_tensor_descriptors(name, tma_launches):
    """W4A8's codes made e4m3 with a `config` of TMA=True run the TMA kernel's channel groups (each group's partial
    scaled, the token's scale after the loop): the exact product to the fp32 accumulation's error, as on pointers."""
    offs, m, qa, experts, qw = w4a8_experts(name, False, K)
    codes = G.int4_as_e4m3(qw.data, qw.zero_point)
    tiles = dict(TMA=True, BLOCK_M=16, BLOCK_N=64, GROUP_M=2, num_warps=4, num_stages=3)
    got = grouped_fp8_mm(qa.data, qa.scale, offs, codes, qw.scale, torch.bfloat16, config=tiles)
    assert tma_launches == [1]
    assert_w4a8_product(got, offs, qa, experts)


@pytest.mark.parametrize("route", ["product", "codes made e4m3", "expert by expert"])
@pytest.mark.parametrize("k", [K, 2048], ids=["k256", "k2048_split"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
@pytest.mark.parametrize("name", list(ROUTINGS) + list(MANY_ROWS))
def test_grouped_int4_fp8_is_the_exact_product_rounded_at_the_store(name, symmetric, k, route, monkeypatch):
    """W4A8 experts (int4_fp8): every e4m3 code times an int4 code less its zero point is exact, so each row is its
    expert's fp64 product of the dequantized operands to the fp32 accumulation's error and one bf16 rounding, as
    the dense kernel's (tests/kernels/test_gemm_int4_fp8.py states the bound); K = 2048 over few rows splits K.
    Past 128 rows an active expert the product takes the codes made e4m3 and the grouped fp8 kernel (here also in
    blocks of 64 columns, so that every block is written where it belongs), and past 512 each expert's rows through
    the dense product (on a GPU cuBLAS's, past 128 rows), both also run here on every routing."""
    offs, m, qa, experts, qw = w4a8_experts(name, symmetric, k)
    if route == "product":
        got = grouped_int4_fp8_mm(qa.data, qa.scale, offs, qw.data, qw.scale, qw.zero_point)
    elif route == "expert by expert":
        got = G.grouped_int4_fp8_by_expert(unwritten(m), qa.data, qa.scale, offs, qw.data, qw.scale, qw.zero_point)
    else:
        monkeypatch.setattr(G, "CHUNK_ELEMENTS", E * k * 64)
        got = G.grouped_int4_fp8_over_e4m3(unwritten(m), qa.data, qa.scale, offs, qw.data, qw.scale, qw.zero_point)
    assert_w4a8_product(got, offs, qa, experts)


@pytest.mark.parametrize("route", ["product", "codes made e4m3", "codes in blocks of 64 columns", "expert by expert"])
def test_grouped_int4_fp8_row_scaled_is_the_exact_product_rounded_at_the_store(route, monkeypatch):
    """Group scales in the row-scaled form (numerics/row_powers_of_two.py), given with their row scales: past 128
    rows an active expert the codes take their groups' powers of two and the product is row-scaled (CUTLASS's grouped
    GEMM on sm_90, else the grouped fp8 kernel), over every column at once up to EXPERTS_AT_ONCE_ELEMENTS codes and
    in blocks of columns past it (each written where it belongs); past 512 each expert's rows take the dense route
    (cuBLAS's rowwise GEMM on a GPU). Every product is exact and summed in fp32 over K, not a group at a time: the
    same bound as the channel groups'."""
    offs, m, qa, experts, qw = w4a8_experts(next(iter(MANY_ROWS)), True, K, "row_powers_of_two")
    args = (qa.data, qa.scale, offs, qw.data, qw.scale, None)
    if route == "product":
        got = grouped_int4_fp8_mm(*args, row_scale=qw.row_scale)
    elif route == "expert by expert":
        got = G.grouped_int4_fp8_by_expert(unwritten(m), *args, qw.row_scale)
    else:
        if route == "codes in blocks of 64 columns":
            monkeypatch.setattr(G, "EXPERTS_AT_ONCE_ELEMENTS", E * K * 64)
        got = G.grouped_int4_fp8_over_e4m3(unwritten(m), *args, qw.row_scale)
    assert_w4a8_product(got, offs, qa, experts)


@pytest.mark.gpu
@pytest.mark.parametrize("symmetric", [True, False], ids=["symmetric", "zero_point"])
def test_grouped_int4_fp8_in_a_cuda_graph_past_128_rows_an_expert(symmetric):
    """A CUDA graph cannot read the expert offsets on the host: captured past 128 rows an expert, the product takes
    the codes made e4m3 and the grouped fp8 kernel, and a replay after new activations is their exact product."""
    offs, m, qa, experts, qw = w4a8_experts(next(iter(MANY_ROWS)), symmetric, 2048)
    codes, scales = qa.data.clone(), qa.scale.clone()
    grouped_int4_fp8_mm(codes, scales, offs, qw.data, qw.scale, qw.zero_point)  # warm: compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = grouped_int4_fp8_mm(codes, scales, offs, qw.data, qw.scale, qw.zero_point)
    qa = R.quantize(torch.randn(m, 2048, device=DEVICE, dtype=torch.bfloat16), "fp8_e4m3", "token")
    codes.copy_(qa.data)
    scales.copy_(qa.scale)
    graph.replay()
    torch.cuda.synchronize()
    assert_w4a8_product(got, offs, qa, experts)


@pytest.mark.parametrize("fmt", ["int4", "nvfp4"])
def test_grouped_weight_only_split_k(fmt):
    """Few rows and a long K: K is split across programs and the partials reduced."""
    torch.manual_seed(0)
    offs = torch.tensor([1, 1, 2, 2], device=DEVICE, dtype=torch.int32)
    x = torch.randn(3, 2048, device=DEVICE, dtype=torch.bfloat16)
    q = R.quantize_experts(torch.randn(E, 64, 2048, device=DEVICE), fmt)
    group = {"int4": 128, "nvfp4": 16}[fmt]
    got = grouped_weight_only_mm(x, offs, q.data, q.scale, fmt, group, 64, zero_point=q.zero_point,
                                 global_scale=q.global_scale, config=dict(programs=64))
    check(got, R.grouped_linear(x, offs, q), offs)


def test_grouped_fp8_split_k():
    torch.manual_seed(0)
    offs = torch.tensor([1, 1, 2, 2], device=DEVICE, dtype=torch.int32)
    x = torch.randn(3, 2048, device=DEVICE, dtype=torch.bfloat16)
    a, a_scale = quantize_fp8(x, 128)
    q = R.quantize_experts(torch.randn(E, 128, 2048, device=DEVICE), "fp8_e4m3", ("block", 128, 128))
    got = grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, torch.bfloat16, config=dict(programs=64))
    qa = R.dequantize(R.quantize(x, "fp8_e4m3", ("group", 128)), torch.float32)
    check(got, R.grouped_linear(qa, offs, q, torch.bfloat16), offs)


def test_grouped_gemm_refuses_bad_offsets():
    x = torch.randn(4, K, device=DEVICE, dtype=torch.bfloat16)
    q = R.quantize_experts(torch.randn(E, N, K, device=DEVICE), "int8", "channel")
    with pytest.raises(ValueError, match=r"offsets must be int32 \[E=4\]"):
        grouped_weight_only_mm(x, torch.tensor([1, 2, 3, 4], device=DEVICE), q.data, q.scale, "int8", 0, N)

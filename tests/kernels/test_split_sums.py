"""Split-K GEMMs summed by each tile's last slice: the reduce kernel's bits for every GEMM that splits, the tile
counters left zero after each call, kept per stream, and the reduce kernel where a package traces the GEMM."""

import pytest
import torch

from fxquant.kernels import splitk
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.gemm_int4_fp8 import GROUP, int4_fp8_mm
from fxquant.kernels.gemm_weight_only import weight_only_mm, wo_gemm_config
from fxquant.kernels.launch import kernels_inlined
from fxquant.numerics import reference as R

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def fp8_product(gen, M, N, K, split):
    a = torch.randn(M, K, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    b = torch.randn(N, K, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    a_scale, b_scale = (torch.rand(n, 1, generator=gen).add(0.5).to(DEVICE) for n in (M, N))
    bias = torch.randn(N, generator=gen).to(DEVICE, torch.bfloat16)
    return lambda: fp8_scaled_mm(a, a_scale, b, b_scale, bias, config=dict(SPLIT_K=split))


def weight_only_product(gen, M, N, K, fmt):
    x = torch.randn(M, K, generator=gen).to(DEVICE, torch.bfloat16)
    q = R.quantize((torch.randn(N, K, generator=gen) * 0.05).to(DEVICE), fmt,
                   "channel" if fmt == "int8" else ("group", 128))
    bias = torch.randn(N, generator=gen).to(DEVICE, torch.bfloat16)
    return lambda: weight_only_mm(x, q.data, q.scale, fmt, 0 if fmt == "int8" else 128, N, zero_point=q.zero_point,
                                  bias=bias, config=wo_gemm_config(M, K, fmt))


def int4_fp8_product(gen, M, N, K):
    qa = R.quantize(torch.randn(M, K, generator=gen).to(DEVICE, torch.bfloat16), "fp8_e4m3", "token")
    qw = R.quantize(torch.randn(N, K, generator=gen).to(DEVICE, torch.bfloat16), "int4", ("group", GROUP))
    bias = torch.randn(N, generator=gen).to(DEVICE, torch.bfloat16)
    return lambda: int4_fp8_mm(qa.data, qa.scale, qw.data, qw.scale, qw.zero_point, bias, torch.bfloat16)


PRODUCTS = {  # decode shapes whose plan splits K; an N tail (200, 80) and M = 1 and 5
    "fp8 split 4": lambda gen: fp8_product(gen, 3, 200, 2048, 4),
    "fp8 split 3, one row": lambda gen: fp8_product(gen, 1, 64, 1536, 3),
    "int8 weight-only": lambda gen: weight_only_product(gen, 5, 80, 2048, "int8"),
    "int4 weight-only": lambda gen: weight_only_product(gen, 1, 128, 2048, "int4"),
    "int4 x fp8": lambda gen: int4_fp8_product(gen, 3, 64, 1024),
}


@pytest.mark.parametrize("name", PRODUCTS)
def test_the_last_slice_sums_the_reduce_kernel_s_bits_and_leaves_the_counters_zero(name, monkeypatch):
    product = PRODUCTS[name](torch.Generator().manual_seed(len(name)))
    launched = []
    launch = splitk.visible
    monkeypatch.setattr(splitk, "visible", lambda kernel: launched.append(kernel) or launch(kernel))
    with splitk.reduce_in_gemm(False):
        want = product()
    assert launched == [splitk._splitk_reduce_kernel]  # the plan splits K
    got, again = product(), product()  # a second call finds the counters zero again
    assert len(launched) == 1  # no reduce kernel ran since
    assert torch.isfinite(want).all() and want.abs().max() > 0
    assert torch.equal(got, want) and torch.equal(again, want)
    assert not splitk.counters(want.device, 1).any()  # the buffer the GEMM counted on (cuda:0, not "cuda")


def test_counters_are_one_zeroed_buffer_a_device_and_a_traced_gemm_launches_the_reduce_kernel():
    device = torch.device(DEVICE)
    first = splitk.counters(device, 64)
    assert first is not None and first.dtype == torch.int32 and first.numel() == splitk.COUNTERS
    assert splitk.counters(device, 64) is first
    assert splitk.counters(device, splitk.COUNTERS + 1) is None  # more tiles than counters
    with kernels_inlined():  # a kept buffer is not an input a traced program sees
        assert splitk.counters(device, 64) is None
    with splitk.reduce_in_gemm(False):
        assert splitk.counters(device, 64) is None


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="the int4 mma.sync kernel and CUDA graphs run on the GPU")
def test_int4_mma_and_a_captured_graph_sum_the_same_bits(monkeypatch):
    from fxquant.kernels.gemm_int4_mma import int4_mma_mm, pack_lanes

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 4096, generator=gen).to(DEVICE, torch.bfloat16)
    q = R.quantize((torch.randn(4096, 4096, generator=gen) * 0.05).to(DEVICE), "int4", ("group", 128))
    lane_scale, lane_zero = pack_lanes(q.scale, q.zero_point)
    bias = torch.randn(4096, generator=gen).to(DEVICE, torch.bfloat16)
    product = lambda: int4_mma_mm(x, q.data, lane_scale, lane_zero, 128, bias)
    with splitk.reduce_in_gemm(False):
        want = product()
    assert torch.equal(product(), want)
    fp8 = fp8_product(gen, 4, 4096, 4096, 8)
    with splitk.reduce_in_gemm(False):
        fp8_want = fp8()
    # Each kernel warmed up as a graph's user does: its first launch compiles and loads a module, which a capture
    # refuses (and a failed capture leaves the worker's RNG refusing every later random tensor).
    assert torch.equal(fp8(), fp8_want)
    with monkeypatch.context() as patch:
        patch.setattr(splitk, "_counters", {})
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            assert splitk.counters(x.device, 64) is None  # never made inside a capture, whose pool would own them
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the counters made by the eager calls above
        got, fp8_got = product(), fp8()
    for _ in range(3):
        got.zero_(), fp8_got.zero_()
        graph.replay()
        assert torch.equal(got, want) and torch.equal(fp8_got, fp8_want)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE == "cpu", reason="torch.compile's CUDA graphs run on the GPU")
def test_counters_made_while_compiled_cuda_graphs_warm_up_stay_out_of_their_pool(monkeypatch):
    """mode="reduce-overhead" warms up with every allocation of the thread in its graphs' pool, and refuses to record
    where the pool holds a tensor the graph does not output: the counters are made outside it."""
    import fxquant.ops  # noqa: F401  (registers torch.ops.fxquant)

    monkeypatch.setattr(splitk, "_counters", {})
    gen = torch.Generator().manual_seed(11)
    a = torch.randn(4, 4096, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    w = torch.randn(4096, 4096, generator=gen).to(torch.float8_e4m3fn).to(DEVICE)
    a_scale, w_scale = torch.full((4, 1), 0.5, device=DEVICE), torch.full((4096, 1), 2**-6, device=DEVICE)
    with splitk.reduce_in_gemm(False):
        want = fp8_scaled_mm(a, a_scale, w, w_scale)
    step = torch.compile(lambda a: torch.ops.fxquant.scaled_mm_fp8(a, a_scale, w, w_scale, None, torch.bfloat16),
                         mode="reduce-overhead")
    for _ in range(3):  # warm-up (the counters made), record, replay
        got = step(a).clone()
        assert torch.equal(got, want)
    assert torch.device(DEVICE, 0) in splitk._counters

"""Programmatic dependent launch: on where the GPU has it (sm_90+) and nowhere else, and a chain of dependent
kernels gives the serial launch's bits, eagerly and replayed from a CUDA graph, with the GEMMs' weights prefetched
before their wait or not."""

import pytest
import torch

import fxquant
from fxquant.kernels.cast import capability
from fxquant.kernels.dependent_launch import OFF, ON, launch_options, prefetching, weights_prefetched
from fxquant.kernels.gemm_fp8 import fp8_scaled_mm
from fxquant.kernels.launch import kernels_inlined
from fxquant.kernels.quant_fp8 import quantize_fp8_rows
from fxquant.kernels.silu_mul_quant import silu_mul_quantize_fp8_rows

HOPPER = torch.cuda.is_available() and capability(torch.device("cuda")) >= (9, 0)


def test_it_is_off_on_the_cpu_while_inlined_and_when_turned_off():
    assert launch_options(torch.device("cpu")) == OFF
    if HOPPER:
        cuda = torch.device("cuda")
        assert launch_options(cuda) == ON
        with kernels_inlined():  # Inductor's launcher would take the launch option for a kernel argument
            assert launch_options(cuda) == OFF
        with fxquant.dependent_launches(False):  # the public switch
            assert launch_options(cuda) == OFF
        assert launch_options(cuda) == ON


def test_a_kernel_prefetches_by_its_default_or_the_switch_and_only_when_launched_dependent():
    """The fp8 GEMM prefetches by default (decision 0030), the 4-bit GEMMs do not; the switch sets both."""
    assert prefetching(ON, by_default=True) and not prefetching(ON) and not prefetching(OFF, by_default=True)
    with weights_prefetched(True):
        assert prefetching(ON) and not prefetching(OFF)  # without the wait there is nothing to overlap
    with weights_prefetched(False):
        assert not prefetching(ON, by_default=True)
    assert prefetching(ON, by_default=True) and not prefetching(ON)


def chain(h, weights):
    """Layers of quantize -> split-K fp8 GEMM -> reduce -> silu(gate) * up quantized -> GEMM -> reduce: each kernel
    reads what the one before it wrote."""
    for w_gate_up, s_gate_up, w_down, s_down in weights:
        codes, scale = quantize_fp8_rows(h, h.shape[-1])
        gate_up = fp8_scaled_mm(codes, scale, w_gate_up, s_gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        codes, scale = silu_mul_quantize_fp8_rows(gate, up, gate.shape[-1])
        h = h + fp8_scaled_mm(codes, scale, w_down, s_down)
    return h


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs sm_90 or later")
@pytest.mark.parametrize("prefetch", [False, True], ids=["waits first", "weights prefetched before the wait"])
def test_a_dependent_chain_gives_the_serial_launch_s_bits_eagerly_and_in_a_cuda_graph(prefetch):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dim, inner = 1024, 2048

    def weight(n, k):  # fp8 codes of N(0, 1) with per-channel scales of 1 / sqrt(k): activations keep their size
        return (torch.randn(n, k, device="cuda", generator=gen).to(torch.float8_e4m3fn),
                torch.full((n, 1), k ** -0.5, device="cuda"))

    weights = [(*weight(2 * inner, dim), *weight(dim, inner)) for _ in range(6)]
    x = torch.randn(4, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    with fxquant.dependent_launches(False):
        want = chain(x, weights)
    assert torch.isfinite(want).all() and want.abs().max() > 0
    with weights_prefetched(prefetch):
        assert torch.equal(chain(x, weights), want)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(x, weights)  # compiled and planned before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(x, weights)
    for _ in range(3):
        got.zero_()
        graph.replay()
        assert torch.equal(got, want)

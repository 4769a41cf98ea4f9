"""The row-scaled grouped fp8 GEMM's CUTLASS route (`cutlass_grouped`): which products it takes, the rows past the
last expert zeroed on the device (the kernel under Triton's interpreter on the CPU), and on sm_90 the route's product
against the reference and the Triton kernel's."""

import pytest
import torch

from fxquant.kernels import gemm_grouped as G
from fxquant.kernels.cutlass_grouped import CUTLASS_ABOVE_M, layout_refusal, supports
from fxquant.kernels.unowned_rows import zero_unowned_rows
from fxquant.numerics import reference as R
from fxquant.ops import quantize_fp8

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E, K, N = 4, 256, 256
SM90 = DEVICE == "cuda" and torch.cuda.get_device_capability() == (9, 0)


def experts(counts, unowned, n=N):
    """(offs, e4m3 activations and per-token scales, per-channel e4m3 experts, the reference product) for rows
    routed `counts` an expert and `unowned` rows past the last expert's end."""
    torch.manual_seed(0)
    offs = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    x = torch.randn(sum(counts) + unowned, K, device=DEVICE, dtype=torch.bfloat16)
    a, a_scale = quantize_fp8(x, 0)
    q = R.quantize_experts(torch.randn(E, n, K, device=DEVICE), "fp8_e4m3", "channel")
    reference = R.grouped_linear(R.dequantize(R.quantize(x, "fp8_e4m3", "token"), torch.float32), offs, q,
                                 torch.bfloat16)
    return offs, a, a_scale, q, reference


@pytest.mark.parametrize("end", [45, 70, 0], ids=["rows past the end", "every row owned", "no row owned"])
def test_rows_past_the_last_experts_end_are_zeroed_and_the_others_kept(end):
    out = torch.randn(70, 300, device=DEVICE).to(torch.bfloat16)  # 300 columns: a column block's tail
    before = out.clone()
    offs = torch.tensor([end // 3, end // 2, end // 2, end], device=DEVICE, dtype=torch.int32)
    zero_unowned_rows(out, offs)
    assert torch.equal(out[:end], before[:end])
    assert torch.equal(out[end:], torch.zeros_like(out[end:]))


def test_the_route_refuses_what_it_was_not_measured_on_and_says_why():
    offs, a, a_scale, q, _ = experts([301, 0, 179, 90], 7)
    assert layout_refusal(a, a_scale, q.data, q.scale, torch.bfloat16) is None
    few = a[: CUTLASS_ABOVE_M * E]
    assert "rows an expert" in layout_refusal(few, a_scale[: few.shape[0]], q.data, q.scale, torch.bfloat16)
    assert "to bf16" in layout_refusal(a, a_scale, q.data, q.scale, torch.float16)
    assert "multiples of 16" in layout_refusal(a, a_scale, q.data[:, :200], q.scale[:, :200], torch.bfloat16)
    blocks = torch.ones(E, N // 128, K // 128, device=DEVICE)
    assert "per token and channel" in layout_refusal(a, a_scale, q.data, blocks, torch.bfloat16)
    if not SM90:
        assert "sm_90" in supports(a, a_scale, q.data, q.scale, torch.bfloat16)


def test_only_a_row_scaled_product_without_a_config_or_an_output_takes_the_route(monkeypatch):
    """The route's choice in `grouped_fp8_mm`, its availability stood in for: a config (a benchmark's tiles), an
    output view (columns of a wider output) and block scales keep the Triton kernels."""
    taken = []
    monkeypatch.setattr(G, "cutlass_supports", lambda *args: None)
    monkeypatch.setattr(G, "cutlass_grouped_fp8", lambda a, *args: taken.append(1) or a.new_zeros(()))
    offs, a, a_scale, q, _ = experts([5, 0, 19, 2], 0)
    G.grouped_fp8_mm(a, a_scale, offs, q.data, q.scale)
    assert taken == [1]
    tiles = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=2)
    G.grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, config=tiles)
    G.grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, out=torch.empty(a.shape[0], N, device=DEVICE,
                                                                          dtype=torch.bfloat16))
    blocks = R.quantize_experts(q.data.float(), "fp8_e4m3", ("block", 128, 128))
    a_blocks = torch.ones(a.shape[0], K // 128, device=DEVICE)
    G.grouped_fp8_mm(a, a_blocks, offs, blocks.data, blocks.scale)
    assert taken == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="torch's CUTLASS grouped fp8 GEMM runs on sm_90")
def test_on_sm90_the_route_gives_the_reference_and_the_triton_kernels_product(monkeypatch):
    routed = []
    real = G.cutlass_grouped_fp8
    monkeypatch.setattr(G, "cutlass_grouped_fp8", lambda *args: routed.append(1) or real(*args))
    offs, a, a_scale, q, reference = experts([301, 0, 179, 90], 7)
    got = G.grouped_fp8_mm(a, a_scale, offs, q.data, q.scale)
    assert routed == [1]
    end = int(offs[-1])
    assert torch.equal(got[end:], torch.zeros_like(got[end:]))
    error = (got[:end].float() - reference[:end].float()).norm() / reference[:end].float().norm()
    assert error < 2e-3  # the same fp32 sums in another order, one bf16 rounding
    triton_kernel = G.grouped_fp8_mm(a, a_scale, offs, q.data, q.scale, config=dict(TMA=True))
    assert (got.float() - triton_kernel.float()).norm() <= 2e-3 * triton_kernel.float().norm()

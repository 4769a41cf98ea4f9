"""Property tests over every format and granularity: round trip within half a step, zeros, poison."""

import hypothesis.strategies as st
import torch
from hypothesis import given, settings

from fxquant.numerics import reference as R
from fxquant.numerics.formats import E2M1, E4M3, E5M2
from fxquant.numerics.granularity import Granularity
from fxquant.numerics.minifloat import floor_log2, pow2

ELEMENT = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "mxfp8": E4M3, "mxfp4": E2M1, "nvfp4": E2M1}
CASES = [(f, g) for f in ("fp8_e4m3", "fp8_e5m2", "int8", "int4")
         for g in ("tensor", "token", ("group", 32), ("block", 2, 32))] + [
         ("mxfp8", None), ("mxfp4", None), ("nvfp4", None)]


def effective_scale(q) -> torch.Tensor:
    """The fp32 scale of every element, in the input's shape."""
    scale = q.scale.float() * (q.global_scale if q.global_scale is not None else 1.0)
    blocks = q.granularity.to_blocks(torch.empty(q.shape))
    return q.granularity.from_blocks(scale[..., None].expand(blocks.shape), q.shape)


def half_step(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """Half the grid spacing at |value| v (in units of the scale)."""
    if fmt not in ELEMENT:
        return torch.full_like(v, 0.5)
    elem = ELEMENT[fmt]
    exp = floor_log2(torch.where(v > 0, v, 1.0)).clamp_min(1 - elem.bias)
    return pow2(exp - elem.mbits) / 2


@st.composite
def tensors(draw):
    rows = draw(st.sampled_from([2, 4]))
    cols = draw(st.sampled_from([32, 64, 128]))
    seed = draw(st.integers(0, 2**31 - 1))
    log_scale = draw(st.floats(-12, 12))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * 2.0**log_scale
    outliers = torch.rand(rows, cols, generator=gen) < 0.05
    return torch.where(outliers, x * 50, x)


@settings(max_examples=25, deadline=None)
@given(x=tensors(), case=st.sampled_from(CASES))
def test_round_trip_within_half_a_step(x, case):
    fmt, gran = case
    q = R.quantize(x, fmt, gran)
    out = R.dequantize(q, torch.float32)
    scale = effective_scale(q)
    if q.zero_point is not None:  # asymmetric int4: the grid is offset by the zero point, same step
        in_range = torch.ones_like(x, dtype=torch.bool)
        v = torch.zeros_like(x)
    else:
        v = x.abs() / scale
        in_range = v <= {"int8": 127.0, "int4": 7.0}.get(fmt, ELEMENT.get(fmt, E4M3).max)
    bound = half_step(v, fmt) * scale * (1 + 2.0**-20)  # slack: x / scale is itself rounded in fp32
    assert ((out - x).abs() <= bound)[in_range].all()
    assert in_range.float().mean() > 0.9  # only saturating outliers may leave the grid


@settings(max_examples=10, deadline=None)
@given(case=st.sampled_from(CASES), rows=st.sampled_from([2, 4]))
def test_all_zero_input_gives_zeros(case, rows):
    x = torch.zeros(rows, 64)
    assert torch.equal(R.dequantize(R.quantize(x, *case)), x)


@settings(max_examples=25, deadline=None)
@given(x=tensors(), case=st.sampled_from(CASES), where=st.integers(0, 10**6))
def test_nan_poisons_its_own_block_only(x, case, where):
    fmt, gran = case
    x = x.clone()
    x.view(-1)[where % x.numel()] = float("nan")
    q = R.quantize(x, fmt, gran)
    block = q.granularity if gran is not None else R.default_granularity(fmt)
    nan_blocks = block.to_blocks(torch.isnan(R.dequantize(q)))
    poisoned = block.to_blocks(torch.isnan(x)).any(-1)
    assert nan_blocks[poisoned].all()
    assert not nan_blocks[~poisoned].any()
    assert isinstance(block, Granularity)

import ml_dtypes
import numpy as np
import pytest
import torch
from fp8_cases import rounding_cases, same_bits

from fxquant.numerics.formats import E2M1, E4M3, E5M2, E8M0
from fxquant.numerics.minifloat import decode, encode, pack_nibbles, pow2, round_to_format, unpack_nibbles


@pytest.mark.parametrize("fmt", [E4M3, E5M2], ids=lambda f: f.name)
def test_generic_rounding_matches_torch_cast_bit_for_bit(fmt):
    x = rounding_cases(fmt)
    finite = torch.isfinite(x)
    clamped = x.clamp(-fmt.max, fmt.max)
    ours = encode(round_to_format(clamped, fmt), fmt).to(torch.uint8).view(fmt.torch_dtype)
    theirs = clamped.to(fmt.torch_dtype)
    assert same_bits(ours[finite | torch.isnan(x)], theirs[finite | torch.isnan(x)]) == 0


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E2M1], ids=lambda f: f.name)
def test_generic_rounding_matches_ml_dtypes(fmt):
    np_dtype = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2, E2M1: ml_dtypes.float4_e2m1fn}[fmt]
    x = rounding_cases(fmt)
    x = x[torch.isfinite(x)].clamp(-fmt.max, fmt.max)
    theirs = torch.from_numpy(x.numpy().astype(np_dtype).astype(np.float32))
    ours = round_to_format(x, fmt)
    assert torch.equal(ours, theirs)
    assert torch.equal(torch.signbit(ours), torch.signbit(theirs))


@pytest.mark.parametrize("fmt", [E4M3, E5M2, E8M0], ids=lambda f: f.name)
def test_decode_matches_torch_on_every_code(fmt):
    codes = torch.arange(256, dtype=torch.int32)
    theirs = codes.to(torch.uint8).view(fmt.torch_dtype).float()
    ours = decode(codes, fmt)
    assert torch.equal(torch.isnan(ours), torch.isnan(theirs))
    ok = ~torch.isnan(theirs)
    assert torch.equal(ours[ok], theirs[ok])


def test_e2m1_code_table_and_roundtrip():
    values = decode(torch.arange(16), E2M1)
    assert values.tolist() == [0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    assert torch.equal(encode(values, E2M1), torch.arange(16, dtype=torch.int32))


def test_e8m0_decode_matches_torch():
    codes = torch.arange(256, dtype=torch.int32)
    theirs = codes.to(torch.uint8).view(E8M0.torch_dtype).float()
    ours = torch.where(codes == 255, torch.nan, pow2(codes - 127))
    assert torch.equal(ours.nan_to_num(-1), theirs.nan_to_num(-1))


def test_pow2_is_exact_across_normal_and_subnormal_range():
    e = torch.arange(-149, 128)
    assert torch.equal(pow2(e).double(), torch.pow(2.0, e.double()))


def test_nibble_packing_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]])
    packed = pack_nibbles(codes)
    assert packed.tolist() == [[0x21, 0x0F]]
    assert torch.equal(unpack_nibbles(packed), codes.to(torch.uint8))
    with pytest.raises(ValueError, match="even last dim"):
        pack_nibbles(torch.zeros(3))

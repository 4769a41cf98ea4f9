import ml_dtypes
import numpy as np
import pytest
import torch

from fxquant.numerics.formats import BF16, E2M1, E4M3, E5M2, E8M0, FP16, INT4, INT8, UE4M3, UINT4

TORCH_KNOWN = [E4M3, E5M2, E8M0, BF16, FP16]
ML_DTYPES = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2, E2M1: ml_dtypes.float4_e2m1fn,
             E8M0: ml_dtypes.float8_e8m0fnu, BF16: ml_dtypes.bfloat16, FP16: np.float16}


@pytest.mark.parametrize("fmt", TORCH_KNOWN, ids=lambda f: f.name)
def test_float_limits_match_torch_finfo(fmt):
    fi = torch.finfo(fmt.torch_dtype)
    assert fmt.max == fi.max
    assert fmt.min_normal == fi.smallest_normal
    assert fmt.eps == fi.eps
    assert fmt.bits == fi.bits


@pytest.mark.parametrize("fmt", list(ML_DTYPES), ids=lambda f: f.name)
def test_float_limits_match_ml_dtypes(fmt):
    fi = ml_dtypes.finfo(ML_DTYPES[fmt])
    assert fmt.max == float(fi.max)
    assert fmt.min_normal == float(fi.smallest_normal)
    assert fmt.eps == float(fi.eps)
    if not fmt.exponent_only:
        assert fmt.min_subnormal == float(fi.smallest_subnormal)
        assert fmt.emax == fi.maxexp - 1
        assert 1 - fmt.bias == fi.minexp


def test_exponent_bias_and_specials():
    assert (E4M3.bias, E5M2.bias, E2M1.bias, E8M0.bias) == (7, 15, 1, 127)
    assert (E4M3.max, E5M2.max, E2M1.max, E8M0.max) == (448.0, 57344.0, 6.0, 2.0**127)
    assert E4M3.nan_code == 0x7F and E2M1.nan_code is None and E8M0.nan_code == 0xFF
    assert UE4M3.max == E4M3.max and not UE4M3.signed and UE4M3.bits == 7
    assert E8M0.min_normal == 2.0**-127 and E8M0.exponent_only


def test_int_ranges():
    assert (INT8.qmin, INT8.qmax) == (torch.iinfo(torch.int8).min, torch.iinfo(torch.int8).max)
    assert (INT4.qmin, INT4.qmax, UINT4.qmin, UINT4.qmax) == (-8, 7, 0, 15)
    assert (int(ml_dtypes.iinfo(ml_dtypes.int4).min), int(ml_dtypes.iinfo(ml_dtypes.int4).max)) == (-8, 7)

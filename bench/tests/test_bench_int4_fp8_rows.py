"""bench.int4_fp8_rows' harness at a small shape (on the CPU the kernels run under Triton's interpreter and
torch._scaled_mm its CPU form): each W4A8 route it times is within its ceiling of the fp64 product of its own
dequantized operands, the check catches a product of the wrong weight, and the row-scaled weight it builds is in the
row-scaled form."""

import torch

from bench.int4_fp8_rows import CEILING, dense_routes, exact_product, int4_weight, rel_error
from fxquant.numerics import reference as R
from fxquant.numerics.row_powers_of_two import row_scale_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_the_routes_it_times_are_checked_against_their_own_exact_product():
    torch.manual_seed(0)
    m, n, k = 144, 64, 256  # past 128 rows: the routes the bench compares
    w = torch.randn(n, k, device=DEVICE) * 0.02
    qa = R.quantize(torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16), "fp8_e4m3", "token")
    amax, rows = int4_weight(w, False), int4_weight(w, True)
    assert row_scale_of(rows.scale) is not None and torch.equal(row_scale_of(rows.scale), rows.row_scale)
    routes = dense_routes(qa, amax, rows, R.quantize(w, "fp8_e4m3", "channel"))
    for name, qw in (("W4A8 block-scaled", amax), ("W4A8 row-scaled", rows)):
        got = routes[name]()
        assert rel_error(got, exact_product(qa, qw)) < CEILING
        assert rel_error(got, exact_product(qa, qw).roll(1, 1)) > CEILING  # a column off: caught
    assert rel_error(routes["fp8_row (e4m3 weight)"](), exact_product(qa, amax)) < 0.2  # int4 against fp8 weights

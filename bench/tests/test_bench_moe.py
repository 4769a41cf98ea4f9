"""bench.moe's chunked paths: the weight-only experts dequantized 2**N elements at a time only while they run."""

import torch

from bench.moe import Chunked
from fxquant.kernels import gemm_grouped


class Recorder(torch.nn.Module):
    def forward(self, x):
        return x + gemm_grouped.EXPERTS_AT_ONCE_ELEMENTS


def test_a_chunked_path_runs_at_its_chunk_and_leaves_the_products_after_it():
    shipped = gemm_grouped.EXPERTS_AT_ONCE_ELEMENTS
    out = Chunked(Recorder(), 2**20)(torch.zeros(()))
    assert out.item() == 2**20 and gemm_grouped.EXPERTS_AT_ONCE_ELEMENTS == shipped != 2**20

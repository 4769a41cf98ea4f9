"""Faults of torch's own that the suite meets, each with a minimal reproduction under plain torch.compile and the
setting that avoids it on the versions affected (tests/test_torch_faults.py checks both)."""

import contextlib

import torch

TORCH = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])

# Inductor's CPU code for an indexed read whose indices are an arange over another dynamic size (transformers'
# padding mask at decode: padding[0, arange(n)]) checks the index against the size before it defines the index
# ("'tmp2' was not declared in this scope"). Seen on torch 2.11.0; not on 2.13.0 or 2.14.1; 2.12 not tried.
INDIRECT_INDEX_CHECK_FAULT = TORCH < (2, 13)


def padding_mask(padding: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The reproduction: padding [1, L] bool (True: attend), positions [n] the cache positions so far; the
    additive mask over the first n keys."""
    kv = torch.arange(positions.shape[0])
    keep = (kv <= positions[-1]) & padding[0, kv]  # an indexed read of size L at indices < n: bounds-checked
    return torch.where(keep, 0.0, float("-inf")).to(torch.bfloat16)


def avoid_indirect_index_check_fault():
    """Inductor without its indirect-index bounds checks where the fault is; elsewhere nothing changes."""
    if not INDIRECT_INDEX_CHECK_FAULT:
        return contextlib.nullcontext()
    return torch._inductor.config.patch(assert_indirect_indexing=False)

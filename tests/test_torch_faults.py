"""torch's own faults (tests/torch_faults.py): each reproduces where it is declared, and its avoidance works. When a
torch release fixes one, the first test fails and the avoidance can go."""

import pytest
import torch
from torch_faults import INDIRECT_INDEX_CHECK_FAULT, avoid_indirect_index_check_fault, padding_mask


def _inputs():
    padding, positions = torch.ones(1, 40, dtype=torch.bool), torch.arange(37)
    padding[0, :3] = False  # left-padded
    torch._dynamo.mark_dynamic(padding, 1)
    torch._dynamo.mark_dynamic(positions, 0)
    return padding, positions


def test_the_indirect_index_check_fault_shows_where_declared():
    torch._dynamo.reset()
    compiled = torch.compile(padding_mask)
    if INDIRECT_INDEX_CHECK_FAULT:
        with pytest.raises(Exception, match="was not declared in this scope"):
            compiled(*_inputs())
    else:
        torch.testing.assert_close(compiled(*_inputs()), padding_mask(*_inputs()), rtol=0, atol=0)


def test_the_indirect_index_check_fault_is_avoided():
    torch._dynamo.reset()
    with avoid_indirect_index_check_fault():
        got = torch.compile(padding_mask)(*_inputs())
    torch.testing.assert_close(got, padding_mask(*_inputs()), rtol=0, atol=0)

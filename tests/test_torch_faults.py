"""torch's own faults (tests/torch_faults.py): each reproduces where it is declared, and its avoidance works. When a
torch release fixes one, the first test fails and the avoidance can go."""

import pytest
import torch
from torch_faults import INDIRECT_INDEX_CHECK_FAULT, avoid_indirect_index_check_fault, padding_mask

pytestmark = pytest.mark.cpu_only  # each compiles on the CPU: where the fault is


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


def test_fxquant_generate_avoids_it_in_a_left_padded_prefill_on_the_cpu():
    """Where users meet the fault: transformers' padding mask in fxquant.generate's dynamic-length prefill, compiled
    by Inductor on the CPU (fxquant.generation._inductor_faults_avoided)."""
    from hf_models import VOCAB, decoder

    import fxquant

    torch._dynamo.reset()
    model = decoder("llama", dtype=torch.float32, num_hidden_layers=1)  # fp32: argmax ties are not a rounding apart
    ids = torch.randint(1, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=3, do_sample=False, pad_token_id=0)
    want = model.generate(ids, cache_implementation="static", **kwargs)
    got = fxquant.generate(model, ids, options={"skip": [".*"]}, **kwargs)  # nothing quantized, Inductor inside
    torch._dynamo.reset()
    assert torch.equal(got, want)

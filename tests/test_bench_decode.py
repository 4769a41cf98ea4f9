"""bench.decode's host breakdown on the CPU: timing fxquant's wrapper alone leaves the compiled step as it was."""
import torch
from hf_models import VOCAB, decoder

from bench.decode import Decoder, compiled_forward
from fxquant.backend import QuantizedCallable


def test_timing_the_wrapper_alone_restores_the_compiled_step():
    """wrapper_us replaces the compiled graph by a no-op and the callable's __call__ by a recorder while it times;
    afterwards the step runs the real graph again and gives the logits it gave before."""
    call = QuantizedCallable.__call__
    model = decoder("llama", dtype=torch.float32)
    runner, forward, callables = compiled_forward(model, "fxquant:fp8_row", "default")
    generator = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (1, 6), generator=generator)
    tokens = torch.randint(0, VOCAB, (1, 6), generator=generator)
    step = Decoder(runner, forward, "cpu", 16, callables=callables)
    with torch.no_grad():
        before = step.steps(prompt, tokens)[0]
        assert callables and step.wrapper_us(prompt, tokens, calls=5, repeats=2) > 0
        after = step.steps(prompt, tokens)[0]
    assert QuantizedCallable.__call__ is call
    torch.testing.assert_close(after, before, rtol=0, atol=0)

"""The README's "Fast decode" recipe: a static cache allocated outside the compiled step (its tensors marked static by
transformers), the step compiled under backend="fxquant", and the decode steps after the first ones run under
torch.compiler.set_stance(skip_guard_eval_unsafe=True). Greedy tokens equal those of the same loop with every guard
checked."""

import torch
import transformers as T
from hf_models import VOCAB, compiled, decoder

PROMPT = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(12))
WARM_STEPS = 3  # compile (and record CUDA graphs) with every guard checked


def greedy(model, forward, steps: int, skip_guards: bool, max_len=32) -> list[int]:
    cache = T.StaticCache(config=model.config, max_cache_len=max_len)
    with torch.no_grad():
        logits = model(input_ids=PROMPT, past_key_values=cache, use_cache=True).logits  # eager prefill allocates
        tokens = [int(logits[0, -1].argmax())]
        for i in range(steps):
            position = torch.tensor([PROMPT.shape[1] + i])
            stance = torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards and i >= WARM_STEPS)
            with stance:
                logits = forward(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache,
                                 cache_position=position, use_cache=True).logits
            tokens.append(int(logits[0, -1].argmax()))
    return tokens


def test_skipping_guard_evaluation_decodes_the_same_tokens():
    model = decoder("llama")
    checked = greedy(model, compiled(model, recipe="fp8_row"), 10, skip_guards=False)
    skipped = greedy(model, compiled(model, recipe="fp8_row"), 10, skip_guards=True)
    assert skipped == checked

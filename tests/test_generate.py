"""fxquant.generate, and the same loop as transformers' custom_generate, against transformers' own generate(): the
same tokens with nothing quantized, the same sampling distribution, quantized logits within the fake-quantized
bound, refusals by name. On the CPU the step runs without a graph; on a GPU the compiled step is captured in a CUDA
graph and replayed (asserted through last_run)."""

import copy
import functools
import math
import warnings

import pytest
import route_ties
import torch
import transformers as T
from hf_models import VOCAB, decoder, fake_quantized, static_decode

import fxquant
from fxquant.generation import cache_length, kept, last_run

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NOTHING = {"inner": "eager", "skip": [".*"]}  # compiled by the fxquant backend, no layer quantized
ENTRIES = {
    "fxquant.generate": lambda model, ids, **kwargs: fxquant.generate(model, ids, **kwargs),
    "custom_generate": lambda model, ids, **kwargs: model.generate(ids, custom_generate=fxquant.generate, **kwargs),
}


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Every test compiles the same forward methods anew (dynamo's recompile limit is per method), and leaves no
    automatic dynamic shapes behind for the next test in its worker."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_forward_past_dynamo_s_recompile_limit_is_refused_not_run_unquantized():
    model = model_of("llama")
    ids, _ = prompts(1)
    # the prompt's graph and the step's are two of one forward: a limit of 1 is hit in the first call
    with torch._dynamo.config.patch(recompile_limit=1), pytest.raises(RuntimeError, match="recompile limit"):
        fxquant.generate(model, ids, max_new_tokens=4, options=NOTHING)


def test_prompt_and_max_new_tokens_lengths_up_to_a_power_of_two_share_one_decode_graph():
    """Each cache length is a graph of its own; before, each prompt length plus max_new_tokens compiled the step anew
    (the ninth was refused at dynamo's recompile limit). Now lengths up to 256, and then within each power of two,
    share one cache length: after the first call (the prompt's graph and the step's), the others compile nothing,
    and each gives transformers' tokens."""
    from torch._dynamo.utils import counters

    model = model_of("llama")
    graphs = []
    for width, max_new_tokens in ((8, 4), (8, 5), (11, 7)):
        ids, mask = prompts(2, width=width, seed=width)
        before = counters["stats"]["unique_graphs"]
        got = fxquant.generate(model, ids, attention_mask=mask, max_new_tokens=max_new_tokens, options=NOTHING)
        graphs.append(counters["stats"]["unique_graphs"] - before)
        assert torch.equal(got, model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                                               do_sample=False))
    assert graphs == [2, 0, 0]
    assert [layer.max_cache_len for layer in next(iter(kept(model).caches.values())).layers] == [256, 256]


def prompts(batch: int, width: int = 8, seed: int = 0):
    """Token ids [B, width] and their attention mask, sequence i left-padded by 3 * i tokens (pad id 0)."""
    ids = torch.randint(1, VOCAB, (batch, width), generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(width)[None, :] >= 3 * torch.arange(batch)[:, None]).long()
    return ids.masked_fill(mask == 0, 0).to(DEVICE), mask.to(DEVICE)


def model_of(arch: str, **overrides):
    """fp32, so that argmax ties are not a rounding apart. "mixtral_grouped_mm": Mixtral in bf16 with its experts
    run as grouped_mm, whose routing stays on the device: transformers' default experts loop copies from the host,
    and so does its grouped_mm under torch.compile in any dtype but bf16 (a loop over offs.tolist())."""
    grouped = arch.endswith("_grouped_mm")
    dtype = torch.bfloat16 if grouped else torch.float32
    model = decoder(arch.removesuffix("_grouped_mm"), dtype=dtype, **overrides).to(DEVICE)
    if grouped:
        model.set_experts_implementation("grouped_mm")
    return model


def assert_graph_loop(model, options, caught, arch: str = "llama") -> None:
    """On a GPU a compiled step runs as a CUDA graph; an MoE model's may not be capturable (its routing, outside
    the compiled graph, copies from the host), and then says so. Elsewhere the step runs without a graph."""
    graphed = last_run(model).graph
    if options is None or DEVICE != "cuda":
        assert not graphed
    elif arch == "mixtral":
        assert graphed or any("could not be captured in a CUDA graph" in str(w.message) for w in caught)
    else:
        assert graphed


def options_for_device():
    """On a GPU, a compiled step (its graph loop); on the CPU also the model as it is (the loop without a graph)."""
    return [NOTHING] if DEVICE == "cuda" else [None, NOTHING]


@pytest.mark.parametrize("arch, entry", [  # full attention, a sliding window, MoE; both entries run the one loop
    pytest.param(arch, entry, marks=pytest.mark.slow if arch == "mixtral_grouped_mm" or (
        entry == "custom_generate" and arch != "llama") else ())  # 25-40 s each on CI's cores: one entry there
    for arch in ("llama", "gemma2", "mixtral", "mixtral_grouped_mm") for entry in ENTRIES])
def test_with_nothing_quantized_greedy_tokens_equal_transformers_generate(arch, entry):
    model = model_of(arch)
    ids, mask = prompts(3)
    want_one = model.generate(ids[:1], max_new_tokens=7, do_sample=False, cache_implementation="static")
    want = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0,
                          cache_implementation="static")
    eos = int(want[1, ids.shape[1] + 2])  # sequence 1 ends mid-way, the others go on
    want_eos = model.generate(ids, attention_mask=mask, max_new_tokens=7, do_sample=False, pad_token_id=0,
                              eos_token_id=eos, cache_implementation="static")
    for options in options_for_device():
        run = functools.partial(ENTRIES[entry], model, max_new_tokens=7, do_sample=False, options=options)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert torch.equal(run(ids[:1]), want_one)
        assert_graph_loop(model, options, caught, arch)
        assert torch.equal(run(ids, attention_mask=mask, pad_token_id=0), want)
        got = run(ids, attention_mask=mask, pad_token_id=0, eos_token_id=eos)
        assert torch.equal(got, want_eos) and (got[1, ids.shape[1] + 3:] == 0).all()


def test_generation_stops_when_every_sequence_has_ended():
    """The loop runs steps past the last end-of-sequence (read back a chunk late) and cuts them: the output is as
    long as generate()'s."""
    model = model_of("llama")
    ids, _ = prompts(1)
    eos = int(model.generate(ids, max_new_tokens=20, do_sample=False)[0, ids.shape[1] + 4])
    want = model.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=eos, cache_implementation="static")
    got = fxquant.generate(model, ids, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                           options=options_for_device()[-1])
    assert torch.equal(got, want) and got.shape[1] == ids.shape[1] + 5
    assert last_run(model).tokens == 5 and last_run(model).steps > 4


def test_a_streamer_gets_the_tokens_transformers_gives_it():
    class Recorder(T.generation.BaseStreamer):
        def __init__(self):
            self.put_, self.ended = [], False

        def put(self, value):
            self.put_.append(value.reshape(-1).tolist())

        def end(self):
            self.ended = True

    model = model_of("llama")
    ids, _ = prompts(1)
    eos = int(model.generate(ids, max_new_tokens=30, do_sample=False)[0, ids.shape[1] + 13])
    ours, theirs = Recorder(), Recorder()
    fxquant.generate(model, ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, streamer=ours,
                     options=options_for_device()[-1])
    model.generate(ids, max_new_tokens=30, do_sample=False, eos_token_id=eos, streamer=theirs)
    assert ours.put_ == theirs.put_ and ours.ended
    assert 1 + 1 < len(ours.put_) <= 1 + 14  # the prompt, then the new tokens one by one until the end-of-sequence


def test_a_streamer_gets_the_prefill_s_token_before_any_decode_step_runs():
    """The user's first token is the prompt's time alone, as generate()'s is, not that of the first chunk of steps."""
    model, forwards, at_first_token = model_of("llama"), [], []

    class FirstToken(T.generation.BaseStreamer):
        def put(self, value):
            at_first_token.append(len(forwards))

        def end(self):
            pass

    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    fxquant.generate(model, prompts(1)[0], max_new_tokens=12, do_sample=False, streamer=FirstToken())
    assert at_first_token[:2] == [0, 1] and len(forwards) == 12  # the prompt put before any forward; then the prefill's


def chi_square_limit(dof: int, z: float = 4.26) -> float:
    """The chi-square statistic that a true null exceeds with probability ~1e-5 (z), by Wilson and Hilferty's
    normal approximation of the distribution."""
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def two_sample_chi_square(a: torch.Tensor, b: torch.Tensor) -> tuple[float, int]:
    """For two histograms of equal totals: the statistic and its degrees of freedom over the bins either hit."""
    hit = (a + b) > 0
    a, b = a[hit].double(), b[hit].double()
    return float(((a - b) ** 2 / (a + b)).sum()), int(hit.sum()) - 1


def test_seeded_sampling_repeats_and_draws_as_transformers_sampling_does():
    """A small vocabulary, one prompt repeated over a batch of 4000: the first new token's histogram against the
    exact probabilities of transformers' processors, and the fourth's (drawn by the replayed graph on a GPU)
    against transformers' own sampling, each by a chi-square test at p ~ 1e-5."""
    model = model_of("llama", vocab_size=32)
    prompt = torch.randint(1, 32, (1, 6), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = prompt.expand(4000, -1)
    settings = dict(max_new_tokens=4, do_sample=True, temperature=0.7, top_k=12, top_p=0.9, pad_token_id=0)
    options = options_for_device()[-1]
    torch.manual_seed(11)
    ours = fxquant.generate(model, ids, options=options, **settings)[:, 6:]
    torch.manual_seed(11)
    assert torch.equal(fxquant.generate(model, ids, options=options, **settings)[:, 6:], ours)
    generator = torch.Generator(DEVICE).manual_seed(5)
    once = fxquant.generate(model, ids[:8], options=options, generator=generator, **settings)
    generator.manual_seed(5)
    assert torch.equal(fxquant.generate(model, ids[:8], options=options, generator=generator, **settings), once)
    theirs = model.generate(ids, **settings)[:, 6:]

    with torch.no_grad():
        scores = model(prompt).logits[:, -1].float()
    for warper in (T.TemperatureLogitsWarper(0.7), T.TopKLogitsWarper(12), T.TopPLogitsWarper(0.9)):
        scores = warper(prompt, scores)
    probs = torch.softmax(scores, dim=-1)[0].double().cpu()
    first = torch.bincount(ours[:, 0].cpu(), minlength=32).double()
    assert first[probs == 0].sum() == 0  # never a token the processors filtered out
    kept = probs > 0
    statistic = float(((first[kept] - 4000 * probs[kept]) ** 2 / (4000 * probs[kept])).sum())
    assert statistic < chi_square_limit(int(kept.sum()) - 1), (statistic, first[kept], 4000 * probs[kept])
    statistic, dof = two_sample_chi_square(torch.bincount(ours[:, 3].cpu(), minlength=32),
                                           torch.bincount(theirs[:, 3].cpu(), minlength=32))
    assert dof > 2 and statistic < chi_square_limit(dof), statistic


def test_num_return_sequences_and_min_p_run_on_the_device():
    """min_p=1.0 keeps only the likeliest token, so sampling must give the greedy tokens, for each of the returned
    sequences (transformers repeats each prompt before calling the loop)."""
    model = model_of("llama")
    ids, mask = prompts(2)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    sampled = fxquant.generate(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=True, min_p=1.0,
                               top_k=0, num_return_sequences=3, pad_token_id=0, options=options_for_device()[-1])
    assert torch.equal(sampled, greedy.repeat_interleave(3, dim=0))


@pytest.mark.parametrize("recipe", ["fp8_row", "int4_wo"])
@pytest.mark.parametrize("arch", ["llama", "gemma2", "mixtral"])
def test_quantized_logits_stay_within_the_fake_quantized_bound(arch, recipe):
    """The logits of every step (output_logits), the prompt's included (the prefill is compiled by the backend
    too), bound by independent fake-quantized copies fed the same tokens over a cache of the same length."""
    model = decoder(arch).to(DEVICE)
    ids, mask = prompts(2)
    options = {"recipe": recipe, "inner": "eager"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fxquant.generate(model, ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                               options=options, return_dict_in_generate=True, output_logits=True)
    got = torch.stack(out.logits)  # [steps, B, V]
    fed, length = out.sequences[:, ids.shape[1]:-1], out.sequences.shape[1] - 1
    exact_model, plain_model = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)
    # over a cache as long as fxquant.generate's: the same keys, masked the same, summed in the same order
    decode = lambda m: static_decode(m, m, ids, fed, max_len=cache_length(model.config, length), padding=mask)
    copies = decode(exact_model), decode(plain_model), decode(model)
    assert not route_ties.within_bound(got, *copies, decode, exact_model, plain_model)  # MoE routing ties too
    assert_graph_loop(model, options, caught, arch)


def test_an_fp8_cache_gives_the_tokens_of_generate_over_the_same_cache():
    model = model_of("llama")
    ids, mask = prompts(2)
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    want = model.generate(ids, past_key_values=fxquant.FP8StaticCache(config=model.config, max_cache_len=13), **kwargs)
    cache = fxquant.FP8StaticCache(config=model.config, max_cache_len=13)
    got = fxquant.generate(model, ids, past_key_values=cache, options=options_for_device()[-1], **kwargs)
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:  # compiled: its cache read is fused into decode attention, a rounding apart from the eager dequantize
        assert (got == want).float().mean() > 0.8
    with pytest.raises(ValueError, match=r"already holds tokens.*cache\.reset\(\)"):
        fxquant.generate(model, ids, past_key_values=cache, **kwargs)
    assert last_run(copy.deepcopy(model)) is None  # what generate keeps for its next call (a CUDA graph) stays


@pytest.mark.parametrize("settings, refused", [
    (dict(num_beams=2), "beam search"),
    (dict(repetition_penalty=1.2), "RepetitionPenaltyLogitsProcessor"),
    (dict(min_new_tokens=3), "MinLengthLogitsProcessor|MinNewTokensLengthLogitsProcessor"),
    (dict(return_dict_in_generate=True, output_scores=True), "output_logits only"),
    (dict(max_new_tokens=20), "layer 0's sliding window holds 16 tokens"),
])
def test_what_the_device_loop_cannot_run_is_refused_by_name_with_the_fix(settings, refused):
    model = model_of("gemma2")  # sliding window 16
    ids, _ = prompts(1)
    with pytest.raises(ValueError, match=rf"fxquant\.generate: .*({refused}).*model\.generate"):
        fxquant.generate(model, ids, **{"max_new_tokens": 4, **settings})

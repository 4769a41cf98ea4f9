"""transformers models built from small configs, used as people use them: a static KV cache written in place by the
compiled graph, generate(), tied embeddings, GPT-2's Conv1D, Gemma2, and MoE routers."""

import re

import pytest
import route_ties
import torch
import transformers as T
from hf_models import (
    ARCHITECTURES,
    VOCAB,
    compiled,
    cosine,
    decoder,
    fake_quantized,
    static_decode,
    traced,
    within_bound,
)
from reports import layer_rows

import fxquant
from fxquant.passes.pack_gqa import MIN_KV_GROUPS

GENERATOR = torch.Generator().manual_seed(1)
PROMPT = torch.randint(0, VOCAB, (2, 8), generator=GENERATOR)
STEPS = torch.randint(0, VOCAB, (2, 4), generator=GENERATOR)


@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_static_cache_decode_with_nothing_quantized_equals_eager(arch):
    """The cache's index_copy_ has no users; dropping it made every step after the prefill wrong."""
    model = decoder(arch)
    eager = static_decode(model, model, PROMPT, STEPS)
    got = static_decode(model, compiled(model, include=["^nothing$"]), PROMPT, STEPS)
    torch.testing.assert_close(got, eager, rtol=0, atol=1e-2)  # bf16 logits: a rounding apart at most


@pytest.mark.parametrize("recipe", ["fp8_block", "int8_wo", "int4_wo"])
@pytest.mark.parametrize("arch", list(ARCHITECTURES))
def test_static_cache_decode_stays_within_the_fake_quantized_bound(arch, recipe):
    """Bound by independent copies of the model whose linears the reference fake-quantizes in eager PyTorch: an
    exact one (fp32 products from the dequantized operands) and a plain bf16 one (hf_models.within_bound)."""
    model = decoder(arch)
    exact_model, plain_model = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)
    decode = lambda m: static_decode(m, m, PROMPT, STEPS)
    exact, plain, eager = decode(exact_model), decode(plain_model), decode(model)
    got = static_decode(model, compiled(model, recipe=recipe), PROMPT, STEPS)
    assert not route_ties.within_bound(got, exact, plain, eager, decode, exact_model, plain_model)  # ties too
    assert route_ties.within_bound(eager, exact, plain, eager, decode, exact_model, plain_model)  # unquantized fails


@pytest.mark.parametrize("recipe", ["fp8_row", "fp8_tensor", "int4_wo"])
def test_a_left_padded_batch_stays_within_the_fake_quantized_bound(recipe):
    """Prompts of different lengths, left-padded, with their attention mask, as batched generate() runs them; a batch
    of enough sequences that decode attention is packed on the KV heads. fp8_tensor's one activation scale per
    tensor spans the padding too, in the compiled model as in the fake-quantized copies."""
    model = decoder("llama")
    batch, width = MIN_KV_GROUPS // model.config.num_key_value_heads, 8
    generator = torch.Generator().manual_seed(4)
    prompt = torch.randint(1, VOCAB, (batch, width), generator=generator)
    steps = torch.randint(1, VOCAB, (batch, 4), generator=generator)
    lengths = 1 + torch.arange(batch) * 5 % width  # 1 to 8 real tokens
    padding = (torch.arange(width)[None, :] >= (width - lengths)[:, None]).long()
    prompt = prompt.masked_fill(padding == 0, 0)
    exact_model, plain_model = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)
    exact = static_decode(exact_model, exact_model, prompt, steps, padding=padding)
    plain = static_decode(plain_model, plain_model, prompt, steps, padding=padding)
    eager = static_decode(model, model, prompt, steps, padding=padding)
    got = static_decode(model, compiled(model, recipe=recipe), prompt, steps, padding=padding)
    assert not within_bound(got, exact, plain, eager)
    unpadded = static_decode(model, model, prompt, steps)
    assert (eager - unpadded).abs().amax() > 0.1  # the mask matters: the padding is not attended


def test_generate_compiles_no_more_graphs_than_dynamo_alone():
    """The graphs are dynamo's (breaks and recompiles): against its eager backend, with fxquant's passes run as is
    (a backend cannot add graphs; Inductor under either would only add a minute of compiling)."""
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    graphs = {}
    for backend, options in (("eager", None), ("fxquant", {"recipe": "int8_wo", "inner": "eager"})):
        model = decoder("qwen2")
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        model.forward = torch.compile(model.forward, backend=backend, options=options)
        with torch.no_grad():
            model.generate(ids, max_new_tokens=6, do_sample=False)
        graphs[backend] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert graphs["fxquant"] <= graphs["eager"], graphs


@pytest.mark.cpu_only
def test_generate_with_a_compile_config_naming_fxquant_decodes_as_quantize_does():
    """generate(cache_implementation="static", compile_config=...) as users call it: one graph for every decode
    step, and the tokens of the same recipe applied in place by quantize_ and run eagerly."""
    ids = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(2))
    config = T.CompileConfig(backend="fxquant", mode=None, options={"recipe": "int8_wo"})
    config._compile_all_devices = True  # generate() compiles on CUDA only, unless told
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    kwargs = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
    with torch.no_grad():
        got = decoder("llama").generate(ids, compile_config=config, **kwargs)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        want = fxquant.quantize_(decoder("llama"), {"recipe": "int8_wo"}).generate(ids, **kwargs)
    assert graphs == 1
    assert torch.equal(got, want)


def report_of(model, capsys, *args, **options):
    with torch.no_grad():
        out = compiled(model, report=True, **options)(*args)
    return out, capsys.readouterr().out


def row(report: str, layer: str) -> str:
    return layer_rows(report)[layer]


@pytest.mark.parametrize("default_skip", [None, ()])
def test_tied_lm_head_stays_in_high_precision_and_is_named_lm_head(capsys, default_skip):
    """With tied embeddings the lm_head reads the embedding's weight; it was quantized and named model.embed_tokens.
    Without the default lm_head exclusion, sharing alone keeps it, naming the embedding."""
    model = decoder("qwen2", tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    options = {"recipe": "int8_wo"} | ({} if default_skip is None else {"default_skip": default_skip})
    out, report = report_of(model, capsys, PROMPT, **options)
    lm_head = row(report, "lm_head")
    assert "kept in high precision" in lm_head and "model.embed_tokens (embedding)" in lm_head
    assert not re.search(r"^model\.embed_tokens\b", report, re.M)
    assert "int8_wo" in row(report, "model.layers.0.mlp.down_proj")


def test_naming_the_lm_head_in_layer_recipes_quantizes_it_within_its_bound(capsys):
    """The LM head stays in high precision by default (DEFAULT_SKIP); a layer_recipes entry naming it lifts that,
    in the backend and in quantize_, and the logits then lie within the bound of copies whose LM head is
    fake-quantized too."""
    model = decoder("llama")
    options = {"recipe": "int8_wo", "layer_recipes": {"lm_head": "int8_wo"}}
    got = static_decode(model, compiled(model, report=True, **options), PROMPT, STEPS)
    assert "int8_wo" in row(capsys.readouterr().out, "lm_head")
    copies = (fake_quantized(model, "int8_wo", exact=True, skip=()), fake_quantized(model, "int8_wo", exact=False,
                                                                                      skip=()), model)
    assert not within_bound(got, *(static_decode(m, traced(m), PROMPT, STEPS) for m in copies))
    assert isinstance(fxquant.quantize_(decoder("llama"), options).lm_head, fxquant.QuantizedLinear)


class GatedMlp(torch.nn.Module):
    """A block whose projection is called `gate` but selects nothing: it is no router."""

    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(256, 256, bias=False)
        self.out = torch.nn.Linear(256, 256, bias=False)

    def forward(self, x):
        return self.out(torch.sigmoid(self.gate(x)) * x)


class Router(torch.nn.Module):
    """An MoE router under an unremarkable name: its output feeds a top-k."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(256, 128, bias=False)
        self.block = GatedMlp()

    def forward(self, x):
        weights, experts = torch.topk(torch.softmax(self.proj(x).float(), -1), 2, dim=-1)
        return self.block(x), weights, experts


def test_routers_are_found_by_structure_not_by_name(capsys):
    model = Router().to(torch.bfloat16).eval()
    _, report = report_of(model, capsys, torch.randn(4, 256, dtype=torch.bfloat16), recipe="fp8_row")
    assert "fp8_row" in row(report, "block.gate") and "fp8_row" in row(report, "block.out")
    assert "router: its output selects experts" in row(report, "proj")


def gpt2():
    torch.manual_seed(0)
    config = T.GPT2Config(n_embd=256, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    return T.GPT2LMHeadModel(config).to(torch.bfloat16).eval()


@pytest.mark.parametrize("recipe", ["fp8_row", "int4_wo"])
def test_gpt2_conv1d_is_quantized_and_every_weight_byte_counted(capsys, recipe):
    """Conv1D is addmm(bias, x, W [in, out]): 85% of GPT-2's weights, which were silently left in bf16."""
    model = gpt2()
    logits, report = report_of(model, capsys, PROMPT, recipe=recipe)
    for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
        assert recipe in row(report, f"transformer.h.1.{layer}")
    assert row(report, "transformer.h.0.mlp.c_fc").split()[1] == "1024x256"  # [N, K] from W [K, N]
    total = sum(p.numel() * p.element_size() for p in model.parameters())  # the tied lm_head once
    conv = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, T.pytorch_utils.Conv1D))
    assert f"weights: quantized {conv:,} of {total:,} bytes" in report
    with torch.no_grad():
        exact, plain, eager = (m(PROMPT).logits.float() for m in (
            fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False), model))
    assert not within_bound(logits.logits.float()[None], exact[None], plain[None], eager[None])


def test_gemma2_compiles_and_runs():
    """Gemma2's graph holds getitems with slices; merge_linear used them as dict keys and crashed."""
    torch.manual_seed(0)
    config = T.Gemma2Config(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=64, num_hidden_layers=2, vocab_size=VOCAB, sliding_window=16)
    model = T.Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        got = compiled(model, recipe="int8_wo")(PROMPT, use_cache=False).logits
        eager = model(PROMPT, use_cache=False).logits
    assert cosine(got, eager) > 0.999


def _whisper():
    """A convolutional front end, cross-attention whose k projections of every layer read the same encoder output
    (merge_linear stacks them across layers), and an output projection tied to the decoder's embedding."""
    config = T.WhisperConfig(vocab_size=VOCAB, d_model=256, encoder_layers=2, decoder_layers=2,
                             encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=512,
                             decoder_ffn_dim=512, num_mel_bins=80, max_source_positions=32, max_target_positions=32,
                             pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    features = torch.randn(2, 80, 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    return T.WhisperForConditionalGeneration(config), dict(input_features=features, decoder_input_ids=STEPS)


def _t5():
    """Relative position biases, no linear biases, an lm_head of its own."""
    config = T.T5Config(vocab_size=VOCAB, d_model=256, d_kv=64, d_ff=512, num_layers=2, num_heads=4,
                        decoder_start_token_id=0, tie_word_embeddings=False)
    return T.T5ForConditionalGeneration(config), dict(input_ids=PROMPT, decoder_input_ids=STEPS)


@pytest.mark.parametrize("build", [_whisper, _t5])
def test_encoder_decoder_models_stay_within_the_fake_quantized_bound(build):
    torch.manual_seed(0)
    model, inputs = build()
    model = model.to(torch.bfloat16).eval()
    skip = ("lm_head", "proj_out")  # Whisper's proj_out is tied to the embedding: kept, as fxquant keeps it
    with torch.no_grad():
        logits = lambda m: m(**inputs, use_cache=False).logits.float()[:, -1]
        exact, plain = (logits(fake_quantized(model, "int4_wo", exact, skip)) for exact in (True, False))
        eager, got = logits(model), logits(compiled(model, recipe="int4_wo"))
    assert not within_bound([got], [exact], [plain], [eager])

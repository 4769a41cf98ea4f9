"""Small transformers models built from configs (random weights, nothing downloaded), a static-cache decode loop,
and an independent fake-quantized copy to bound a quantized model's outputs by."""

import copy
import functools
import inspect
import math

import torch
import transformers as T

from fxquant.compile.backend import fxquant as fxquant_backend
from fxquant.config import RECIPES
from fxquant.numerics import reference as R

VOCAB = 512
# hidden 256 with 64-wide heads: q/k/v/o, gate/up/down and lm_head are all multiples of 128, so every recipe,
# fp8_block's 128x128 blocks included, quantizes every linear.
DECODER = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, vocab_size=VOCAB, max_position_embeddings=128)
ARCHITECTURES = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, {}),
    "qwen2": (T.Qwen2Config, T.Qwen2ForCausalLM, {}),
    "mistral": (T.MistralConfig, T.MistralForCausalLM, {}),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                       shared_expert_intermediate_size=512)),
    "qwen3_moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, head_dim=64)),
    # a sliding-window cache layer, logit soft-capping and tied embeddings
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM, dict(sliding_window=16, head_dim=64)),
    # q/k/v and gate/up fused into one linear each
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(pad_token_id=0)),
    # fused QKV with bias, LayerNorm, parallel attention and MLP
    "gpt_neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, {}),
    # experts stored transposed ([E, K, N]) with biases and a clamped, interleaved gate; attention sinks
    "gpt_oss": (T.GptOssConfig, T.GptOssForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2, head_dim=64, sliding_window=16)),
}
# A wider sweep of decoder families (tests/test_architectures.py), from the same small sizes.
SWEEP = {
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(head_dim=64)),
    # alternating sliding layers, q/k norms, tied embeddings
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM, dict(head_dim=64, sliding_window=16)),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, {}),
    # LayerNorm with bias, partial rotary
    "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, {}),
    # parallel attention and MLP: two LayerNorms of one residual sum, then their linears
    "falcon": (T.FalconConfig, T.FalconForCausalLM, dict(new_decoder_architecture=True, num_kv_heads=2)),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, {}),
    # multi-head latent attention, a dense first layer, grouped top-k routing over an fp32 router
    "deepseek_v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                    dict(moe_intermediate_size=128, first_k_dense_replace=1, num_key_value_heads=4,
                         n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1, q_lora_rank=128,
                         kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64)),
    # experts stored [E, H, 2I], run densely over every token (bmm), and a shared expert
    "llama4": (T.Llama4TextConfig, T.Llama4ForCausalLM,
               dict(head_dim=64, num_local_experts=4, num_experts_per_tok=1, intermediate_size_mlp=512,
                    interleave_moe_layer_step=1, attention_chunk_size=64)),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, {}),
    "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM, {}),
    "phi": (T.PhiConfig, T.PhiForCausalLM, {}),
    "glm4": (T.Glm4Config, T.Glm4ForCausalLM, dict(head_dim=64)),
    "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, {}),
    "granitemoe": (T.GraniteMoeConfig, T.GraniteMoeForCausalLM, dict(num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": ARCHITECTURES["qwen3_moe"],
}


def decoder(arch: str, dtype=torch.bfloat16, seed=0, **overrides):
    config_cls, model_cls, extra = ARCHITECTURES[arch] if arch in ARCHITECTURES else SWEEP[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**DECODER, **extra, **overrides})
    return model_cls(config).to(dtype).eval()


def compiled(model, **options):
    """The model under backend="fxquant" with the eager inner compiler (the passes' graph, run as is)."""
    torch._dynamo.reset()
    return torch.compile(model, backend="fxquant", options={"inner": "eager", **options})


def skeleton(model):
    """The same architecture on the meta device; the rotary frequencies (a non-persistent buffer, in no checkpoint)
    are built for real, as a loader must."""
    with torch.device("meta"):
        empty = type(model)(model.config).to(torch.bfloat16)
    empty.model.rotary_emb = type(model.model.rotary_emb)(model.config).to(torch.bfloat16)
    return empty


def _cache_keyword(model) -> str:
    """transformers renamed past_key_values to cache; take whichever this version's forward has."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


NOTHING = {"inner": "eager", "skip": [".*"]}  # no layer quantized: only the graph rewrites differ from eager


def compiled_results(model, options=NOTHING, keep=lambda result: result, **kwargs):
    """The model compiled under backend="fxquant" with `options`, and the list in which each graph's PipelineResult
    (its graph, layers, pass timings), or keep(result), lands."""
    kept = []

    def backend(gm, inputs):
        compiled = fxquant_backend(gm, inputs, options=options)
        kept.append(keep(compiled.result))
        return compiled

    torch._dynamo.reset()
    return torch.compile(model, backend=backend, **kwargs), kept


def dynamo_graph(model, *inputs, **kwargs) -> tuple[torch.fx.GraphModule, list]:
    """The first graph dynamo hands a backend for model(*inputs), and its example inputs; the graph is not run."""
    captured = []

    def backend(gm, example_inputs):
        captured.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=backend, **kwargs)(*inputs)
    return captured[0]


def compiled_graphs(model, **kwargs):
    """The model compiled under backend="fxquant" with nothing quantized, and the list its graphs land in."""
    return compiled_results(model, keep=lambda result: result.gm, **kwargs)


def traced(model):
    """The model run by dynamo with no compiler behind it: the code path a compiled model takes (transformers picks
    other mask and attention code while dynamo traces; on torch 2.11 its logits differ from eager's by ~5e-3 rad),
    computed by the same eager ops. A fake-quantized copy run so bounds a compiled model on any torch version."""
    torch._dynamo.reset()
    return torch.compile(model, backend="eager")


def static_decode(model, forward, prompt, steps, max_len=32, allocate_eagerly=False, padding=None,
                  cache_class=T.StaticCache) -> torch.Tensor:
    """Logits of the last position for a prefill of `prompt` [B, S], then one step per column of `steps` [B, n]
    (teacher-forced, so every path sees the same tokens), on a transformers StaticCache. `forward` is the model
    or its compiled form. allocate_eagerly: the cache's tensors are allocated by an eager prefill, then emptied,
    as CUDA graphs need (a cache allocated inside dynamo's trace gets no static addresses). padding: the prompt's
    attention mask [B, S] (0 where left-padded), passed as generate() passes it, grown by each step. cache_class:
    StaticCache or a subclass with its constructor. Returns [n + 1, B, vocab]."""
    cache = cache_class(config=model.config, max_cache_len=max_len)
    keyword, length = _cache_keyword(model), prompt.shape[1]
    positions = torch.arange(length, device=prompt.device)
    mask = None if padding is None else torch.cat([padding, padding.new_ones(steps.shape)], dim=1)

    def call(ids, cache_position):
        seen = {} if mask is None else {"attention_mask": mask[:, :int(cache_position[-1]) + 1]}
        return forward(input_ids=ids, cache_position=cache_position, use_cache=True, **{keyword: cache}, **seen)

    outs = []
    with torch.no_grad():
        if allocate_eagerly:
            model(input_ids=prompt, cache_position=positions, use_cache=True, **{keyword: cache})
            cache.reset()
        outs.append(call(prompt, positions).logits[:, -1].float())
        for i in range(steps.shape[1]):
            position = torch.tensor([length + i], device=steps.device)
            outs.append(call(steps[:, i:i + 1], position).logits[:, -1].float())
    return torch.stack(outs)


TOWARD_ZERO = "toward zero"  # fake_quantized's exact=: the exact sums, each rounded toward zero


class FakeQuantizedLinear(torch.nn.Module):
    """nn.Linear with its weight, and for fp8 and MXFP8 recipes its input, through the reference's quantize ->
    dequantize. exact: products and sums in fp32 from the fp32 dequantized operands, one rounding to the input's
    dtype, as a quantized GEMM computes; else the dequantized operands are rounded to the input's dtype and
    multiplied there, as a plain fake-quantized copy in that dtype would. exact == TOWARD_ZERO: the exact sums
    rounded toward zero (bf16), the other rounding of every output that a once-rounded implementation may give."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, exact: bool | str,
                 k_shards: int = 1):
        super().__init__()
        self.scheme, self.exact, self.width = RECIPES[recipe], exact, weight.shape[1] // k_shards
        quantized = lambda w: R.quantize(w.float(), self.scheme.weight_fmt, self.scheme.weight_granularity,
                                         symmetric=self.scheme.symmetric, scale_mode=self.scheme.scale_mode)
        self.dequantized = torch.cat([R.dequantize(quantized(w), torch.float32)  # [N, K]
                                      for w in weight.detach().split(self.width, dim=1)], dim=1)
        self.weight = self.dequantized.to(weight.dtype)  # the model's dtype: T5 casts its input to wo.weight's
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x):
        """k_shards > 1: a row-parallel layer's numerics, weight and input quantized per slice of K, one per rank."""
        return self.multiply(torch.cat([fake_quantized_input(part, self.scheme)
                                        for part in x.split(self.width, dim=-1)], dim=-1), x.dtype)

    def multiply(self, x, dtype):
        """x (already the values the GEMM multiplies) @ W.T + b, rounded to dtype. Not exact, with K in slices: each
        slice's product rounded to dtype and the partials summed in dtype, as row-parallel ranks and their
        all-reduce compute it."""
        if self.exact:
            out = torch.nn.functional.linear(x.float(), self.dequantized, self.bias)
            if self.exact == TOWARD_ZERO:
                if dtype != torch.bfloat16:
                    raise ValueError(f"hf_models: sums rounded toward zero are bf16's, not {dtype}'s")
                out = (out.view(torch.int32) & -65536).view(torch.float32)  # fp32 bits past bf16's dropped
            return out.to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        if self.width == self.weight.shape[1]:
            return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)
        slices = zip(x.to(dtype).split(self.width, dim=-1), self.weight.to(dtype).split(self.width, dim=1), strict=True)
        out = functools.reduce(torch.add, [torch.nn.functional.linear(*pair) for pair in slices])
        return out if bias is None else out + bias


def fake_quantized_input(x, scheme):
    """The values an fp8, W4A8 or MXFP8 GEMM multiplies x by (fp32), or x for weight-only schemes."""
    if scheme.kind in ("fp8", "int4_fp8"):
        group = scheme.act_group
        granularity = "tensor" if group < 0 else "token" if group == 0 else ("group", group)
        return R.dequantize(R.quantize(x, "fp8_e4m3", granularity), torch.float32)
    if scheme.kind == "mxfp8":
        return R.dequantize(R.quantize(x, "mxfp8"), torch.float32)
    return x


def _act_times_up(act_fn, h):
    """transformers' default gate: act_fn(gate) * up, gate rows first."""
    gate, up = h.chunk(2, dim=-1)
    return act_fn(gate) * up


class FakeQuantizedExperts(torch.nn.Module):
    """transformers' experts (gate_up_proj [E, 2I, H], down_proj [E, H, I], or both transposed, with or without
    biases) with every expert's weights, and for fp8 and MXFP8 recipes the rows each projection multiplies, through
    the reference's quantize -> dequantize, in a loop over experts that dynamo traces whole; the experts' own gating
    function (GPT-OSS interleaves and clamps) and the routing weights applied and summed per token as transformers
    does it."""

    def __init__(self, experts, recipe: str, exact: bool):
        super().__init__()
        self.scheme = RECIPES[recipe]
        self.gate = getattr(experts, "_apply_gate", None) or (lambda h: _act_times_up(experts.act_fn, h))
        # Llama4's experts take the hidden states alone, [E * T, H], every expert over its own T rows, and store
        # their weights [E, H, 2I] and [E, I, H]
        self.dense = len(inspect.signature(type(experts).forward).parameters) == 2
        transposed = getattr(experts, "is_transposed", False) or self.dense
        linears = lambda name: [FakeQuantizedLinear(w.T if transposed else w, None if b is None else b, recipe, exact)
                                for w, b in zip(getattr(experts, name), self._biases(experts, name), strict=True)]
        self.gate_up, self.down = linears("gate_up_proj"), linears("down_proj")

    @staticmethod
    def _biases(experts, name):
        bias = getattr(experts, name + "_bias", None)
        return [None] * getattr(experts, name).shape[0] if bias is None else list(bias)

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None):
        if self.dense:
            rows, dtype = hidden_states.reshape(-1, hidden_states.shape[-1]), hidden_states.dtype
            ids = torch.arange(len(self.down), device=rows.device).repeat_interleave(rows.shape[0] // len(self.down))
            h = self.project(self.gate_up, rows, ids, self.gate_up[0].weight.shape[0], dtype)
            return self.project(self.down, self.gate(h), ids, rows.shape[-1], dtype)
        k, dtype = top_k_index.shape[-1], hidden_states.dtype
        ids = top_k_index.reshape(-1)
        rows = hidden_states.repeat_interleave(k, dim=0)  # one row per (token, expert) pair
        h = self.project(self.gate_up, rows, ids, self.gate_up[0].weight.shape[0], dtype)
        out = self.project(self.down, self.gate(h), ids, hidden_states.shape[-1], dtype)
        weighted = out * top_k_weights.reshape(-1, 1)
        return weighted.view(-1, k, hidden_states.shape[-1]).sum(dim=1).to(dtype)

    def project(self, linears, rows, ids, n, dtype):
        """Each row times its expert's fake-quantized weight; activations quantized over all rows at once, as one
        tensor, like the grouped GEMM's input. Every expert multiplies every row and each row keeps its own
        expert's product: no shape depends on the routing, so dynamo traces it whole, without a graph break."""
        x = fake_quantized_input(rows, self.scheme)
        out = rows.new_zeros((rows.shape[0], n), dtype=dtype)
        for e, linear in enumerate(linears):
            out = torch.where((ids == e)[:, None], linear.multiply(x, dtype), out)
        return out


def fake_quantized(model, recipe: str, exact: bool | str, skip=("lm_head",), k_shards=None):
    """A copy of `model` whose nn.Linear and Conv1D (weight [K, N]) layers are FakeQuantizedLinear, and whose
    experts are FakeQuantizedExperts, under `recipe`: the reference's numerics in eager PyTorch, independent of
    the passes. Skipped: names ending in `skip`, routers (transformers' routers are not nn.Linear), and linears
    whose shape the recipe's blocks do not tile (Qwen2-MoE's [1, H] shared-expert gate). k_shards: {name ending:
    slices of K}, the row-parallel layers of a tensor-parallel model, quantized per slice as each rank does."""
    copied, scheme = copy.deepcopy(model), RECIPES[recipe]
    tiles = lambda w: w.shape[-1] % scheme.k_multiple == 0 and w.shape[-2] % scheme.n_multiple == 0
    for name, module in list(copied.named_modules()):
        if name.endswith(skip):
            continue
        if isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            replacement = FakeQuantizedExperts(module, recipe, exact)
        elif isinstance(module, torch.nn.Linear) and tiles(module.weight):
            shards = next((n for end, n in (k_shards or {}).items() if name.endswith(end)), 1)
            replacement = FakeQuantizedLinear(module.weight, module.bias, recipe, exact, shards)
        elif isinstance(module, T.pytorch_utils.Conv1D) and tiles(module.weight.T):
            replacement = FakeQuantizedLinear(module.weight.T, module.bias, recipe, exact)
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(copied.get_submodule(parent), attr, replacement)
    return copied


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.acos(max(-1.0, min(1.0, cosine(a, b))))


def within_bound(got, exact, plain, eager, alternatives=()) -> list[str]:
    """Per step, a message for each failed check (an empty list passes).

    The bound: the angle between a plain fake-quantized copy's logits and the exact copy's, the rounding a bf16
    implementation of the quantized model may add. The compiled model's logits must lie at most that angle from
    the exact copy's; by the triangle inequality their cosine to eager then lies within that angle of the exact
    copy's. And they must lie nearer the exact copy than eager's do: where quantization moves the logits less than
    bf16 rounding can (int8 on an MoE model, whose routing a rounding flips), the bound alone would pass an
    unquantized model too. alternatives: the exact copy's decodes with its MoE routing ties flipped
    (route_ties.alternatives): a step may lie that near any of them instead, a tie's other choice being as correct."""
    failed = []
    for step in range(len(got)):
        bound = angle(plain[step], exact[step])
        distance = min([angle(got[step], exact[step])] + [angle(got[step], alt[step]) for alt in alternatives])
        if distance > bound:
            nearest = "the exact copy" + (" or a tie flipped" if alternatives else "")
            failed.append(f"step {step}: {distance:.2e} rad from {nearest}, bound {bound:.2e}; cos to eager "
                          f"{cosine(got[step], eager[step]):.6f}, the exact copy's "
                          f"{cosine(exact[step], eager[step]):.6f}")
        if distance >= angle(eager[step], exact[step]):
            failed.append(f"step {step}: {distance:.2e} rad from the exact copy, no nearer than eager's "
                          f"{angle(eager[step], exact[step]):.2e}: not the quantized model")
    return failed



def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))

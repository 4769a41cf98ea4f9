"""Small transformers models built from configs (random weights, nothing downloaded), a static-cache decode loop,
and an independent fake-quantized copy to bound a quantized model's outputs by."""

import copy
import inspect
import math

import torch
import transformers as T

from fxquant import reference as R
from fxquant.config import RECIPES

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
}


def decoder(arch: str, dtype=torch.bfloat16, seed=0, **overrides):
    config_cls, model_cls, extra = ARCHITECTURES[arch]
    torch.manual_seed(seed)
    config = config_cls(**{**DECODER, **extra, **overrides})
    return model_cls(config).to(dtype).eval()


def _cache_keyword(model) -> str:
    """transformers renamed past_key_values to cache; take whichever this version's forward has."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def static_decode(model, forward, prompt, steps, max_len=32) -> torch.Tensor:
    """Logits of the last position for a prefill of `prompt` [B, S], then one step per column of `steps` [B, n]
    (teacher-forced, so every path sees the same tokens), on a transformers StaticCache. `forward` is the model
    or its compiled form. Returns [n + 1, B, vocab]."""
    cache = T.StaticCache(config=model.config, max_cache_len=max_len)
    keyword, length = _cache_keyword(model), prompt.shape[1]
    outs = []
    with torch.no_grad():
        logits = forward(input_ids=prompt, cache_position=torch.arange(length), use_cache=True,
                         **{keyword: cache}).logits
        outs.append(logits[:, -1].float())
        for i in range(steps.shape[1]):
            logits = forward(input_ids=steps[:, i:i + 1], cache_position=torch.tensor([length + i]), use_cache=True,
                             **{keyword: cache}).logits
            outs.append(logits[:, -1].float())
    return torch.stack(outs)


class FakeQuantizedLinear(torch.nn.Module):
    """nn.Linear with its weight, and for fp8 and MXFP8 recipes its input, through the reference's quantize ->
    dequantize. exact: products and sums in fp32 from the fp32 dequantized operands, one rounding to the input's
    dtype, as a quantized GEMM computes; else the dequantized operands are rounded to the input's dtype and
    multiplied there, as a plain fake-quantized copy in that dtype would."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, recipe: str, exact: bool):
        super().__init__()
        self.scheme, self.exact = RECIPES[recipe], exact
        q = R.quantize(weight.detach().float(), self.scheme.weight_fmt, self.scheme.weight_granularity)
        self.weight = R.dequantize(q, torch.float32)  # [N, K]
        self.bias = None if bias is None else bias.detach().float()

    def forward(self, x):
        dtype = x.dtype
        if self.scheme.kind == "fp8":
            group = self.scheme.act_group
            granularity = "tensor" if group < 0 else "token" if group == 0 else ("group", group)
            x = R.dequantize(R.quantize(x, "fp8_e4m3", granularity), torch.float32)
        elif self.scheme.kind == "mxfp8":
            x = R.dequantize(R.quantize(x, "mxfp8"), torch.float32)
        if self.exact:
            return torch.nn.functional.linear(x.float(), self.weight, self.bias).to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), self.weight.to(dtype), bias)


def fake_quantized(model, recipe: str, exact: bool, skip=("lm_head",)):
    """A copy of `model` whose nn.Linear and Conv1D (weight [K, N]) layers are FakeQuantizedLinear under `recipe`:
    the reference's numerics in eager PyTorch, independent of the passes. Skipped: names ending in `skip`, and
    routers (transformers' routers are not nn.Linear)."""
    copied = copy.deepcopy(model)
    for name, module in list(copied.named_modules()):
        if name.endswith(skip):
            continue
        if isinstance(module, torch.nn.Linear):
            weight = module.weight
        elif isinstance(module, T.pytorch_utils.Conv1D):
            weight = module.weight.T
        else:
            continue
        parent, _, attr = name.rpartition(".")
        setattr(copied.get_submodule(parent), attr, FakeQuantizedLinear(weight, module.bias, recipe, exact))
    return copied


def angle(a: torch.Tensor, b: torch.Tensor) -> float:
    return math.acos(max(-1.0, min(1.0, cosine(a, b))))


def within_bound(got, exact, plain, eager) -> list[str]:
    """Per step, a message for each failed check (an empty list passes).

    The bound: the angle between a plain fake-quantized copy's logits and the exact copy's, the rounding a bf16
    implementation of the quantized model may add. The compiled model's logits must lie at most that angle from
    the exact copy's; by the triangle inequality their cosine to eager then lies within that angle of the exact
    copy's. And they must lie nearer the exact copy than eager's do: where quantization moves the logits less than
    bf16 rounding can (int8 on an MoE model, whose routing a rounding flips), the bound alone would pass an
    unquantized model too."""
    failed = []
    for step in range(len(got)):
        bound, distance = angle(plain[step], exact[step]), angle(got[step], exact[step])
        if distance > bound:
            failed.append(f"step {step}: {distance:.2e} rad from the exact copy, bound {bound:.2e}; cos to eager "
                          f"{cosine(got[step], eager[step]):.6f}, the exact copy's "
                          f"{cosine(exact[step], eager[step]):.6f}")
        if distance >= angle(eager[step], exact[step]):
            failed.append(f"step {step}: {distance:.2e} rad from the exact copy, no nearer than eager's "
                          f"{angle(eager[step], exact[step]):.2e}: not the quantized model")
    return failed



def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))

"""A transformers LlamaForCausalLM built from a config (random weights, nothing downloaded), compiled with
backend="fxquant": the report, where the norms were fused, and the logits' error against eager per recipe.

Run: python examples/hf_llama.py [recipe ...]      (CPU by default; on a GPU with --cuda)
"""

from __future__ import annotations

import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxquant  # noqa: F401  (registers the backend)


def build(device: str) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=2,
                         num_hidden_layers=2, vocab_size=1000)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def main():
    device = "cuda" if "--cuda" in sys.argv else "cpu"
    recipes = [a for a in sys.argv[1:] if not a.startswith("--")] or ["fp8_block", "fp8_row", "int4_wo"]
    model = build(device)
    ids = torch.randint(0, 1000, (2, 64), device=device)
    with torch.no_grad():
        reference = model(ids, use_cache=False).logits.float()
        for i, recipe in enumerate(recipes):
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fxquant", options={"recipe": recipe, "report": i == 0})
            logits = compiled(ids, use_cache=False).logits.float()
            err = float((logits - reference).norm() / reference.norm())
            print(f"{recipe:>10}: logits relative error vs eager bf16 = {err:.4f}")


if __name__ == "__main__":
    main()

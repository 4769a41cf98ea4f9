"""Quantize a transformers Llama in place, save it as a compressed-tensors checkpoint, and load it into a skeleton
that allocates no weights, on the CPU. Run: python examples/checkpoint.py"""

import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

import fxquant


def main():
    config = LlamaConfig(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
                         num_hidden_layers=2, vocab_size=1000)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    tokens = torch.randint(0, 1000, (1, 16))
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    fxquant.quantize_(model, {"recipe": "int4_wo", "report": True}, example_inputs=(tokens,))
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"parameters: {before:,} -> {after:,} bytes")
    with torch.no_grad():
        want = model(tokens, use_cache=False).logits
    with tempfile.TemporaryDirectory() as folder:
        fxquant.save_quantized(model, folder)
        with torch.device("meta"):
            skeleton = LlamaForCausalLM(config).to(torch.bfloat16)
        skeleton.model.rotary_emb = LlamaRotaryEmbedding(config).to(torch.bfloat16)  # in no checkpoint
        fxquant.load_quantized(skeleton, folder)
    with torch.no_grad():
        got = skeleton.eval()(tokens, use_cache=False).logits
    print(f"loaded model's logits equal the saved model's: {torch.equal(got, want)}")


if __name__ == "__main__":
    main()

"""Quantize a transformers Llama in place, save it as a compressed-tensors checkpoint, then, in a fresh process, load
it into a skeleton whose parameters are on the meta device (no weight is ever allocated in high precision) and
generate a few tokens, which must be the tokens the original quantized model generates. On the CPU, about 20 s.
Run: python examples/load_quantized.py"""

import subprocess
import sys
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import fxquant

CONFIG = dict(hidden_size=512, intermediate_size=1536, num_attention_heads=8, num_key_value_heads=4,
              num_hidden_layers=2, vocab_size=1000)
PROMPT = torch.arange(16).reshape(1, 16) * 37 % 1000


def generated(model) -> list[int]:
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=8, do_sample=False)[0, PROMPT.shape[1]:].tolist()


def save(folder: str) -> list[int]:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.bfloat16).eval()
    before = sum(p.numel() * p.element_size() for p in model.parameters())
    fxquant.quantize_(model, {"recipe": "int4_wo", "report": True}, example_inputs=(PROMPT,))
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"parameters: {before:,} -> {after:,} bytes")
    fxquant.save_quantized(model, folder)
    return generated(model)


def load(folder: str) -> None:
    """In a fresh process: the class config.json names, built with its parameters on the meta device (its rotary
    frequencies, in no checkpoint, computed), filled from the checkpoint."""
    print(generated(fxquant.load_quantized(folder)))


def main():
    if sys.argv[1:2] == ["--load"]:
        load(sys.argv[2])
        return
    with tempfile.TemporaryDirectory() as folder:
        tokens = save(folder)
        fresh = subprocess.run([sys.executable, __file__, "--load", folder], capture_output=True, text=True,
                               check=True).stdout.strip().splitlines()[-1]
    print(f"generated before saving: {tokens}")
    print(f"generated after loading: {fresh}")
    if fresh != str(tokens):
        raise SystemExit("the loaded model generated other tokens")
    print("the same tokens")


if __name__ == "__main__":
    main()

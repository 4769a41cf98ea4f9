"""Quickstart: compile a small transformer block with backend="fxquant" on the CPU.

Prints the per-layer report and the error of every recipe against eager bf16. Run: python examples/quickstart.py
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import fxquant


class Block(nn.Module):
    def __init__(self, d=512, heads=8, hidden=1536, vocab=1000):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.gate, self.up = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, x):  # x: [B, S, D]
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / (d // self.heads) ** 0.5
        attn = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).reshape(b, s, d)
        x = x + self.o(attn)
        h = self.mlp_norm(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.lm_head(x)


def main():
    torch.manual_seed(0)
    model = Block().to(torch.bfloat16).eval()
    x = torch.randn(2, 64, 512, dtype=torch.bfloat16)
    with torch.no_grad():
        ref = model(x)
        for recipe in fxquant.RECIPES:
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="fxquant",
                                     options={"recipe": recipe, "report": recipe == "fp8_block"})
            out = compiled(x)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"{recipe:>10}: relative error vs eager bf16 = {err:.4f}")


if __name__ == "__main__":
    main()

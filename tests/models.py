"""Small models for pass and end-to-end tests."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class HandRMSNorm(nn.Module):
    """transformers' LlamaRMSNorm, spelled by hand: x.pow(2).mean(-1, keepdim=True) -> rsqrt -> mul."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class TinyBlock(nn.Module):
    """Attention-ish mixing, an MLP, and an lm_head: every node kind detect looks for."""

    def __init__(self, d=256, hidden=512, vocab=100):
        super().__init__()
        self.norm = nn.RMSNorm(d)
        self.hand_norm = HandRMSNorm(d)
        self.ln = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, x):  # x: [B, S, D]
        h = self.norm(x)
        scores = self.q(h) @ h.transpose(-1, -2) / 16  # [B, S, S]
        h = x + F.softmax(scores, dim=-1) @ h
        h = h + self.down(F.silu(self.up(self.hand_norm(h))))
        return self.lm_head(self.ln(h))


def tiny_block(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return TinyBlock().to(dtype).eval()


def rel_err(out, ref):
    return float((out.detach().float() - ref.detach().float()).norm() / ref.detach().float().norm())


class ResidualNormMlp(nn.Module):
    """A Llama MLP sub-block: residual add, RMSNorm, gate/up/down; fuse_norm makes add + norm + quantize one op."""

    def __init__(self, d=256, hidden=512):
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.gate = nn.Linear(d, hidden, bias=False)
        self.up = nn.Linear(d, hidden, bias=False)
        self.down = nn.Linear(hidden, d, bias=False)

    def forward(self, x, residual):  # x, residual: [B, S, D]
        h = x + residual
        n = self.norm(h)
        return h + self.down(F.silu(self.gate(n)) * self.up(n))


def residual_norm_mlp(dtype=torch.bfloat16, seed=0):
    torch.manual_seed(seed)
    return ResidualNormMlp().to(dtype).eval()

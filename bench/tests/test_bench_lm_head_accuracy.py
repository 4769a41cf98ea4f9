"""bench.lm_head_accuracy: its comparison says nothing changed where nothing did, and fp8_row's head lands where
two e4m3 operands put it (about 31 dB each) with its weight really quantized."""
import math

import torch

import fxquant
from bench.lm_head_accuracy import compare, hidden_states_and_embedding, tied_head


def test_identical_logits_compare_as_unchanged():
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    got = compare(logits, logits.clone())
    assert got["top-1"] == "1.0000" and got["top-5 overlap"] == "1.0000" and math.isinf(float(got["logits SQNR dB"]))


def test_an_fp8_row_head_over_minilm_keeps_about_29_db():
    hidden, embedding = hidden_states_and_embedding()
    assert embedding.shape[0] % 128 == 0 and hidden.shape[1] == embedding.shape[1]
    with torch.no_grad():
        head = fxquant.quantize_(tied_head(embedding), {"recipe": "fp8_row"})
        assert isinstance(head[0], fxquant.QuantizedLinear)
        got = compare(tied_head(embedding)(hidden), head(hidden))
    assert 25 < float(got["logits SQNR dB"]) < 33 and float(got["top-1"]) > 0.95

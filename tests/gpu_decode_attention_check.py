"""On a GPU: a Llama decode step (Llama-3-8B heads, 2 layers, a 4096-token static cache, left-padded batch) compiled
under backend="fxquant" with nothing quantized runs fxquant's decode attention in its graph and stays within twice
bf16's own distance of eager's logits from the fp32 model's.
Run: PYTHONPATH=. python tests/gpu_decode_attention_check.py"""

import copy
import sys

import torch
import transformers as T

sys.path.insert(0, "tests")
from hf_models import angle, static_decode  # noqa: E402

from fxquant.backend import fxquant as fxquant_backend  # noqa: E402

config = T.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
                       num_hidden_layers=2, vocab_size=32000, max_position_embeddings=8192)
torch.manual_seed(0)
with torch.device("cuda"):
    model = T.LlamaForCausalLM(config).to(torch.bfloat16).eval()
    prompt = torch.randint(0, 32000, (4, 64))
    steps = torch.randint(0, 32000, (4, 3))
padding = torch.ones(4, 64, dtype=torch.long, device="cuda")
padding[0, :9] = 0
graphs = []


def backend(gm, inputs):
    compiled = fxquant_backend(gm, inputs, options={"inner": "eager", "include": []})
    graphs.append(compiled.result.gm)
    return compiled


torch._dynamo.reset()
got = static_decode(model, torch.compile(model, backend=backend), prompt, steps, max_len=4096, padding=padding)
eager = static_decode(model, model, prompt, steps, max_len=4096, padding=padding)
wide = copy.deepcopy(model).float()
exact = static_decode(wide, wide, prompt, steps, max_len=4096, padding=padding)
calls = sum(str(n.target) == "fxquant.decode_attention.default" for n in graphs[-1].graph.nodes)
print(f"decode graph: {calls} fxquant.decode_attention calls for {config.num_hidden_layers} layers")
for step in range(len(got)):
    far, bound = angle(got[step], eager[step]), 2 * angle(eager[step], exact[step])
    print(f"step {step}: {far:.2e} rad from eager, bound {bound:.2e}: {'ok' if far <= bound else 'FAILED'}")

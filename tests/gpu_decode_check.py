"""GPU check of static-cache decode: python tests/gpu_decode_check.py ARCH BACKEND RECIPE MODE (RECIPE "none": nothing
quantized). Prints the distance of each step's logits to the exact fake-quantized copy (or to eager), and whether a
second loop on a fresh cache replays the same logits."""
import sys
import time

import torch
import transformers
from hf_models import VOCAB, cosine, decoder, fake_quantized, static_decode, within_bound

import fxquant  # noqa: F401

arch, backend, recipe, mode = sys.argv[1:5]
g = torch.Generator().manual_seed(1)
prompt, steps = torch.randint(0, VOCAB, (2, 8), generator=g).cuda(), torch.randint(0, VOCAB, (2, 6), generator=g).cuda()
model = decoder(arch).cuda()
eager = static_decode(model, model, prompt, steps)
torch._dynamo.reset()
if backend == "inductor":
    fn = torch.compile(model, mode=mode)
else:
    fn = torch.compile(model, backend="fxquant", options={"mode": mode} | (
        {"include": ["^nothing$"]} if recipe == "none" else {"recipe": recipe}))
start = time.time()
eagerly = mode == "reduce-overhead"  # the cache allocated outside dynamo: static addresses for CUDA graphs
got = static_decode(model, fn, prompt, steps, allocate_eagerly=eagerly)
again = static_decode(model, fn, prompt, steps, allocate_eagerly=eagerly)
line = f"{arch} {backend} {recipe} {mode} {time.time() - start:.1f}s replay equal {torch.equal(got, again)}"
if recipe == "none":
    print(line, "1-cos to eager:", " ".join(f"{1 - cosine(got[s], eager[s]):.1e}" for s in range(len(got))))
else:
    exact_model, plain_model = fake_quantized(model, recipe, exact=True), fake_quantized(model, recipe, exact=False)
    exact, plain = static_decode(exact_model, exact_model, prompt, steps), static_decode(plain_model, plain_model,
                                                                                         prompt, steps)
    print(line, f"bound failures {len(within_bound(got, exact, plain, eager))}; got/plain/eager 1-cos to exact:",
          " ".join(f"{1 - cosine(got[s], exact[s]):.1e}/{1 - cosine(plain[s], exact[s]):.1e}/"
                   f"{1 - cosine(eager[s], exact[s]):.1e}" for s in range(len(got))))
print("versions: torch", torch.__version__, "transformers", transformers.__version__)

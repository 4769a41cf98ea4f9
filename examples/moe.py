"""A small Mixtral on the CPU: its experts quantized in place to MXFP4 (E8M0 scales, even rounding), run eagerly and
compiled under backend="fxquant", then saved as a compressed-tensors checkpoint (one linear per expert, as Mixtral's
checkpoints hold them) and loaded into a skeleton that allocates no weights. Run: python examples/moe.py"""

import tempfile

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralRotaryEmbedding

import fxquant


def main():
    config = MixtralConfig(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                           num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000)
    torch.manual_seed(0)
    model = MixtralForCausalLM(config).to(torch.bfloat16).eval()
    tokens = torch.randint(0, 1000, (1, 16))
    with torch.no_grad():
        reference = model(tokens, use_cache=False).logits.float()
    fxquant.quantize_(model, {"recipe": "mxfp4_wo", "report": True}, example_inputs=(tokens,))
    print(model.model.layers[0].mlp.experts)
    with torch.no_grad():
        eager = model(tokens, use_cache=False).logits
        compiled = torch.compile(model, backend="fxquant")(tokens, use_cache=False).logits
    cosine = torch.nn.functional.cosine_similarity(eager.float().flatten(), reference.flatten(), dim=0)
    print(f"quantized logits' cosine to bf16: {float(cosine):.4f}; compiled equals eager within a rounding: "
          f"{torch.allclose(compiled, eager, rtol=0, atol=2e-2)}")
    with tempfile.TemporaryDirectory() as folder:
        fxquant.save_quantized(model, folder)
        with torch.device("meta"):
            skeleton = MixtralForCausalLM(config).to(torch.bfloat16)
        skeleton.model.rotary_emb = MixtralRotaryEmbedding(config).to(torch.bfloat16)  # in no checkpoint
        fxquant.load_quantized(skeleton, folder)
    with torch.no_grad():
        loaded = skeleton.eval()(tokens, use_cache=False).logits
    print(f"loaded model's logits equal the saved model's: {torch.equal(loaded, eager)}")


if __name__ == "__main__":
    main()

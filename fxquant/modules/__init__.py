"""The model's state: `quantize_` and the modules it installs (QuantizedLinear, QuantizedExperts, their sharded
forms), the FP8 KV cache, and weight-free skeletons."""

"""The fxquant passes, one per module, in the order `fxquant.pipeline.PASSES` runs them: freeze_params,
localize_shards, detect, upcast, quantize_linear, fuse_norm, merge_linear, fuse_linear, pack_int4_lanes,
decode_attention, pack_gqa, cleanup. What they match is declared in `spellings`, `patterns` and
`attention_patterns`; what writes memory is decided in `side_effects`; which pass needs which, in `order`; what
they hand each other, in `state` and `annotations`. The quantized weights every graph shares live below the passes,
in `fxquant.weight_store`; weight quantization itself in `fxquant.weight_quantization`."""

"""The fxquant passes, one per module; `fxquant.compile.pipeline.PASS_TYPES` is their one list, in the order they
run (a new pass is its module here and its place there). What they match is declared in `spellings`, `patterns` and
`attention_patterns`; what writes memory is decided in `side_effects`; which pass needs which, in `order`; what
they hand each other, in `state` and `annotations`. The quantized weights every graph shares live below the passes,
in `fxquant.quantization.weight_store`; weight quantization itself in `fxquant.quantization.weight_quantization`."""

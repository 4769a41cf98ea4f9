"""The numerics core: the formats, the bit-exact reference every kernel and op is tested against, granularities,
the `Quantized` tensor and the error metrics. Imports nothing else of fxquant but the recipes (`fxquant.config`)."""

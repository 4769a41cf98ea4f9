"""The fxquant passes, one per module: freeze_params, detect, upcast, quantize_linear, fuse_norm, merge_linear,
fuse_linear, cleanup. `fxquant.pipeline` runs them; what they match is declared in `spellings` and `patterns`,
what writes memory is decided in `side_effects`."""

"""The compile path: the pass pipeline, the `torch.compile` backend, the numerics lint, recipe="auto"'s
measurements, the report and `fxquant.inspect`. Only the pipeline imports the passes."""

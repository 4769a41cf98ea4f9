"""Out of the process and back: compressed-tensors checkpoints (sharded, MoE, MXFP4), checkpoint conversion, and
torch.export programs and AOTInductor packages."""

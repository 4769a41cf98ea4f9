"""Triton kernels, one family per file, and the bit-exact cast helper they share."""

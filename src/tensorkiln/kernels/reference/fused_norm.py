"""Reference kernels of the tensorkiln-domain fused ops: fused_norm (being written)."""

"""Reference kernels of the tensorkiln-domain fused ops: fused_attention (being written)."""

"""Reference kernels of the tensorkiln-domain fused ops: fused_conv (being written)."""

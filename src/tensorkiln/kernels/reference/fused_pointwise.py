"""Reference kernels of the tensorkiln-domain fused ops: fused_pointwise (being written)."""

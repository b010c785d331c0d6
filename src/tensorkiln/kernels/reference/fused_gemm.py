"""Reference kernels of the tensorkiln-domain fused ops: fused_gemm (being written)."""

"""Graph passes: fuse_gemm (being written)."""

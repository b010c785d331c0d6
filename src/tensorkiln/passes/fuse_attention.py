"""Graph passes: fuse_attention (being written)."""

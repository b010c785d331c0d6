"""Graph passes: fuse_norm (being written)."""

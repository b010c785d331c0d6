"""Graph passes: fuse_pointwise (being written)."""

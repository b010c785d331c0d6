"""Graph passes: fuse_conv (being written)."""

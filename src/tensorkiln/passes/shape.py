"""Graph passes: shape (being written)."""

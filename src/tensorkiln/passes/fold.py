"""Graph passes: fold (being written)."""

"""Graph passes: cleanup (being written)."""

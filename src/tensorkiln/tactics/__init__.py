"""Tactics (candidate implementations per op), the autotuner and the timing cache."""

from tensorkiln.kernels.tactics import LayerSpec, Tactic, get_tactic, tactic, tactics_for

__all__ = ["LayerSpec", "Tactic", "get_tactic", "tactic", "tactics_for"]

"""Graph optimization passes: clean-up, folding, shape simplification and fusion.

Rewrites are written in one pattern language (:mod:`~tensorkiln.passes.pattern`: Op, Var, Const,
Scalar, Alt) as :class:`Rule` objects run by one driver (:func:`apply_rules` / :func:`run_rules`).
"""

from tensorkiln.passes.manager import PASSES, PassManager, register_pass
from tensorkiln.passes.pattern import Alt, Const, Found, Op, Scalar, Var
from tensorkiln.passes.rewrite import Rewrite, add_constant, const_value, replace_uses
from tensorkiln.passes.rules import Rule, View, apply_rules, run_rules

__all__ = [
    "PASSES",
    "Alt",
    "Const",
    "Found",
    "Op",
    "PassManager",
    "Rewrite",
    "Rule",
    "Scalar",
    "Var",
    "View",
    "add_constant",
    "apply_rules",
    "const_value",
    "register_pass",
    "replace_uses",
    "run_rules",
]

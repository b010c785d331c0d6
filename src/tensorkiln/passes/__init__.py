"""Graph optimization passes: clean-up, folding, shape simplification and fusion."""

from tensorkiln.passes.manager import PASSES, PassManager, register_pass
from tensorkiln.passes.rewrite import Rewrite, add_constant, const_value, only_use, replace_uses

__all__ = [
    "PASSES",
    "PassManager",
    "Rewrite",
    "add_constant",
    "const_value",
    "only_use",
    "register_pass",
    "replace_uses",
]

"""The op facts the passes read, in one place.

Which ops are elementwise and which are random are traits of the op records
(:mod:`tensorkiln.ops`); the passes read them through this module. Which ops a Transpose is
pushed through is a choice of the transpose pass (a subset of the unary elementwise ops, chosen
for the layouts models use), kept here beside them.
"""

from __future__ import annotations

from tensorkiln.ops import ELEMENTWISE_OPS, RANDOM_OPS

__all__ = [
    "ELEMENTWISE",
    "RANDOM_OPS",
    "TRANSPOSABLE_BINARY",
    "TRANSPOSABLE_UNARY",
]

# Identity is left out: it renames (graph outputs), and cleanup removes the others.
ELEMENTWISE = ELEMENTWISE_OPS

# Ops that commute with a Transpose of their one tensor input (the binary ones when the other
# operand is a one-element constant): push_transpose_through_pointwise moves Transposes past them.
TRANSPOSABLE_UNARY = frozenset(
    [
        "Relu",
        "Sigmoid",
        "Tanh",
        "Erf",
        "Neg",
        "Abs",
        "Exp",
        "Log",
        "Sqrt",
        "Reciprocal",
        "Floor",
        "Ceil",
        "Round",
        "Sign",
        "Sin",
        "Cos",
        "Tan",
        "Softplus",
        "Softsign",
        "Elu",
        "Selu",
        "Celu",
        "LeakyRelu",
        "HardSigmoid",
        "HardSwish",
        "Gelu",
        "Mish",
        "ThresholdedRelu",
        "Identity",
        "Not",
        "Cast",
        "IsNaN",
        "IsInf",
    ]
)
TRANSPOSABLE_BINARY = frozenset(["Add", "Sub", "Mul", "Div", "Pow", "Max", "Min"])

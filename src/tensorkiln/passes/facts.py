"""The op facts the passes read, in one place.

Which ops are elementwise, which a Transpose can move through, which are random: facts about ops,
not about passes. They move to the op records of ``tensorkiln.ops`` (traits such as elementwise
and random); until then every pass imports them from here, and this module is the one place to
point at the new home.
"""

from __future__ import annotations

from tensorkiln.ir.infer import RANDOM_OPS

__all__ = [
    "ELEMENTWISE",
    "ELEMENTWISE_BINARY",
    "ELEMENTWISE_UNARY",
    "RANDOM_OPS",
    "TRANSPOSABLE_BINARY",
    "TRANSPOSABLE_UNARY",
]

# Elementwise ops fuse_pointwise puts in one Pointwise body (inputs broadcast, one output).
ELEMENTWISE_UNARY = frozenset(
    [
        "Abs",
        "Acos",
        "Acosh",
        "Asin",
        "Asinh",
        "Atan",
        "Atanh",
        "Ceil",
        "Cos",
        "Cosh",
        "Elu",
        "Celu",
        "Selu",
        "Erf",
        "Exp",
        "Floor",
        "Gelu",
        "HardSigmoid",
        "HardSwish",
        "IsInf",
        "IsNaN",
        "LeakyRelu",
        "Log",
        "Mish",
        "Neg",
        "Not",
        "Reciprocal",
        "Relu",
        "Round",
        "Sigmoid",
        "Sign",
        "Sin",
        "Sinh",
        "Softplus",
        "Softsign",
        "Sqrt",
        "Swish",
        "Tan",
        "Tanh",
        "ThresholdedRelu",
        "Shrink",
        "Cast",
        "Clip",
    ]
)
ELEMENTWISE_BINARY = frozenset(
    [
        "Add",
        "Sub",
        "Mul",
        "Div",
        "Pow",
        "Mod",
        "Max",
        "Min",
        "Sum",
        "Mean",
        "PRelu",
        "Where",
        "And",
        "Or",
        "Xor",
        "Equal",
        "Less",
        "Greater",
        "LessOrEqual",
        "GreaterOrEqual",
    ]
)
# Identity is left out: it renames (graph outputs), and cleanup removes the others.
ELEMENTWISE = ELEMENTWISE_UNARY | ELEMENTWISE_BINARY

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

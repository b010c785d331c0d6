"""Traits of the ONNX ops: the one place that says which ops are elementwise, reductions, random,
shape computations, control flow. Shape inference, constant folding, fusion and code generation
read these records (:func:`tensorkiln.ops.with_trait`) instead of keeping lists of their own."""

from __future__ import annotations

from tensorkiln.ops.records import BOUNDED, CONTROL, ELEMENTWISE, RANDOM, REDUCTION, SHAPE, define

# Elementwise ops of one input. Identity is left out (it renames; cleanup removes it), and so are
# the bitwise ops (integer-only; the pointwise code generator has no emitters for them): giving
# them the trait makes the pointwise fusion take them.
UNARY_ELEMENTWISE = (
    "Abs",
    "Acos",
    "Acosh",
    "Asin",
    "Asinh",
    "Atan",
    "Atanh",
    "Cast",
    "Ceil",
    "Celu",
    "Clip",
    "Cos",
    "Cosh",
    "Elu",
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
    "Selu",
    "Shrink",
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
)
# Elementwise ops of two or more inputs, which broadcast.
BINARY_ELEMENTWISE = (
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
)

define(UNARY_ELEMENTWISE + BINARY_ELEMENTWISE, traits=[ELEMENTWISE])
define(
    (
        "RandomNormal",
        "RandomUniform",
        "RandomNormalLike",
        "RandomUniformLike",
        "Bernoulli",
        "Multinomial",
        "Dropout",  # (random in training mode; its mask too)
    ),
    traits=[RANDOM],
)
define(("If", "Loop", "Scan", "SequenceMap"), traits=[CONTROL])
define(("NonZero", "Unique", "Compress"), traits=[BOUNDED])
define(
    (
        "ReduceL1",
        "ReduceL2",
        "ReduceLogSum",
        "ReduceLogSumExp",
        "ReduceMax",
        "ReduceMean",
        "ReduceMin",
        "ReduceProd",
        "ReduceSum",
        "ReduceSumSquare",
        "ArgMax",
        "ArgMin",
    ),
    traits=[REDUCTION],
)
define(
    ("Shape", "Size", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Expand", "ConstantOfShape"),
    traits=[SHAPE],
)

# Schema defaults that cannot be used as written.
# GRU-1's schema spells its default direction "foward".
define("GRU", overrides={"direction": "forward"})
# RNN's default activations list one per direction of a bidirectional RNN (["Tanh", "Tanh"]); the
# count must follow `direction`, so the kernel chooses it (None).
define("RNN", overrides={"activations": None})
# Clip before opset 11 bounds at -/+FLT_MAX by default, which would clip float64 values: no bound.
define("Clip", overrides={"min": None, "max": None})

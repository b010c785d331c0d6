"""Op records: what is known about each (domain, op), whatever backend runs it.

One record per (domain, op) holds the op's traits (elementwise, reduction, random, shape, control,
fused, ...), its native shape rule, and its attribute defaults per opset (read from ONNX's schemas;
the ``tensorkiln`` domain's fused ops declare theirs). Shape inference (:mod:`tensorkiln.ops.infer`),
the frontends, the passes and the kernel registry read them; nothing here knows a kernel.
"""

from __future__ import annotations

from tensorkiln.ops import fused as _fused  # noqa: F401  (declares the fused ops' records)
from tensorkiln.ops import onnx_ops as _onnx_ops  # noqa: F401  (declares the ONNX ops' traits)
from tensorkiln.ops.fused import ACTIVATION_DEFAULTS, ACTIVATIONS, check_activation
from tensorkiln.ops.records import (
    BOUNDED,
    CONTROL,
    DEFAULT_DOMAIN,
    ELEMENTWISE,
    FUSED,
    RANDOM,
    REDUCTION,
    SHAPE,
    OpRecord,
    define,
    get,
    has_trait,
    known,
    normalize_domain,
    rule,
    shape_rule,
    with_trait,
)
from tensorkiln.ops.schema import schema_defaults
from tensorkiln.ops.shape_rules import InferContext

# The elementwise ops of the default domain, and the random ones: the sets fusion, folding and
# the executor read.
ELEMENTWISE_OPS = with_trait(ELEMENTWISE)
RANDOM_OPS = with_trait(RANDOM)


def attribute_defaults(op: str, domain: str, opset: int) -> dict[str, object]:
    """The defaults of ``op``'s attributes at ``opset`` ({} for an op nothing defines)."""
    rec = get(op, domain)
    return {} if rec is None else rec.defaults(opset)


__all__ = [
    "ACTIVATIONS",
    "ACTIVATION_DEFAULTS",
    "BOUNDED",
    "CONTROL",
    "DEFAULT_DOMAIN",
    "ELEMENTWISE",
    "ELEMENTWISE_OPS",
    "FUSED",
    "RANDOM",
    "RANDOM_OPS",
    "REDUCTION",
    "SHAPE",
    "InferContext",
    "OpRecord",
    "attribute_defaults",
    "check_activation",
    "define",
    "get",
    "has_trait",
    "known",
    "normalize_domain",
    "rule",
    "schema_defaults",
    "shape_rule",
    "with_trait",
]

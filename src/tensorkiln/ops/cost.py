"""What a layer costs: its floating-point operations and the bytes it reads and writes.

An op fact, like a shape rule: :func:`node_cost` takes a node and the concrete types of its inputs
and outputs (the shapes it ran at) and returns a :class:`Cost`; the runtime's per-layer profile
divides it by the measured time (achieved TFLOP/s and GB/s) and places it on a roofline.

FLOPs, counted as the profilers people compare with count them (PyTorch's
``torch.utils.flop_counter``, fvcore):

* convolutions (Conv, ConvTranspose, ConvInteger, QLinearConv, ConvAct) and matrix products
  (MatMul, Gemm, GemmAct, MatMulInteger, QLinearMatMul, Einsum of two operands): 2 per
  multiply-accumulate. A bias, a fused activation or a residual add is not counted (it is one
  operation per output element, small beside the products);
* attention (tensorkiln Attention, ONNX Attention): the two products Q K^T and P V, 2 per
  multiply-accumulate; the softmax and the mask are not counted, and a causal mask does not halve
  the count (as PyTorch counts scaled_dot_product_attention);
* recurrent layers (RNN, GRU, LSTM): the input and recurrent products of every step;
* elementwise ops: 1 per output element, transcendental ones too (Exp, Tanh, Erf, Gelu and Sigmoid
  cost several instructions each; a count of 1 keeps them comparable across devices);
  Pointwise (a fused tree of them): 1 per output element per op of its body;
* reductions and pooling: 1 per element read (per input element, or per window tap);
* normalizations and softmax: a small constant per input element (:data:`PER_ELEMENT`: the
  arithmetic of the textbook formula, e.g. LayerNorm's mean, subtract, square, mean, rsqrt,
  multiply, scale and shift: 8);
* data movement (Reshape, Transpose, Concat, Gather, Slice, Cast, ...): 0;
* anything else: unknown (``None``).

Bytes: the sizes of the layer's distinct input and output tensors, weights included. That is a
lower bound of its memory traffic: each tensor read or written once, with no re-reads of what did
not stay in cache and no intermediate tensors of its kernels.

Any input or output of unknown (or symbolic) shape makes both counts ``None``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tensorkiln.ir import DType, Node, TensorType
from tensorkiln.ops.records import ELEMENTWISE, REDUCTION, SHAPE, get, has_trait, normalize_domain

FUSED_DOMAIN = "tensorkiln"

Shape = tuple[int, ...]
# (node, input shapes, output shapes, attribute reader) -> FLOPs, or None when they cannot be told
FlopRule = Callable[
    [Node, list[Shape | None], list[Shape | None], Callable[[str], Any]], int | None
]

# FLOPs per input element of normalizations and softmax (see the module's docstring)
PER_ELEMENT: dict[tuple[str, str], int] = {
    ("", "Softmax"): 5,  # max, subtract, exp, sum, divide
    ("", "LogSoftmax"): 5,
    ("", "Hardmax"): 1,
    ("", "LayerNormalization"): 8,
    (FUSED_DOMAIN, "LayerNorm"): 8,
    ("", "RMSNormalization"): 4,  # square, mean, rsqrt, scale
    (FUSED_DOMAIN, "RMSNorm"): 4,
    ("", "BatchNormalization"): 2,  # inference: a multiply and an add with folded statistics
    ("", "InstanceNormalization"): 8,
    ("", "GroupNormalization"): 8,
    ("", "MeanVarianceNormalization"): 8,
    ("", "LpNormalization"): 3,
    ("", "QuantizeLinear"): 2,  # scale and zero point
    ("", "DequantizeLinear"): 2,
    ("", "DynamicQuantizeLinear"): 4,
    ("", "CumSum"): 1,
    ("", "GlobalAveragePool"): 1,
    ("", "GlobalMaxPool"): 1,
    ("", "GlobalLpPool"): 2,
}
# ops that only move or reinterpret data (their SHAPE-trait ops count as such too)
MOVES_DATA = frozenset(
    {
        "Cast", "CastLike", "Concat", "Constant", "DepthToSpace", "Gather", "GatherElements",
        "GatherND", "Identity", "Pad", "ReverseSequence", "ScatterElements", "ScatterND", "Slice",
        "SpaceToDepth", "Split", "Tile", "Transpose", "Trilu", "OneHot", "EyeLike", "Range",
    }
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class Cost:
    """A layer's floating-point operations and the bytes of its tensors (None: unknown)."""

    flops: int | None
    bytes: int | None
    # the FLOPs are matrix products (convolutions, matmuls, attention): tensor-core work on a GPU
    products: bool = False


_RULES: dict[tuple[str, str], FlopRule] = {}
_PRODUCTS: set[tuple[str, str]] = set()  # the rules that count matrix products


def flop_rule(
    *ops: str, domain: str = "", products: bool = False
) -> Callable[[FlopRule], FlopRule]:
    """Decorator: ``fn`` counts the FLOPs of ``ops`` of ``domain`` (``products``: as matrix
    products, which a GPU runs on its tensor cores)."""

    def decorator(fn: FlopRule) -> FlopRule:
        for op in ops:
            _RULES[(domain, op)] = fn
            if products:
                _PRODUCTS.add((domain, op))
        return fn

    return decorator


def node_cost(
    node: Node,
    inputs: Sequence[TensorType | None],
    outputs: Sequence[TensorType | None],
    opset: int = 1000,
) -> Cost:
    """The cost of ``node`` run on tensors of types ``inputs`` and ``outputs`` (aligned with
    ``node.inputs`` and ``node.outputs``; entries of omitted optional tensors are ignored).
    ``opset`` selects the defaults of attributes the node does not set. Never raises for
    shapes it cannot read: the counts it cannot tell are None."""
    ins = [_shape(t) for v, t in zip(node.inputs, inputs) if v is not None]
    outs = [_shape(t) for v, t in zip(node.outputs, outputs) if v is not None]
    if len(ins) != sum(v is not None for v in node.inputs) or len(outs) != sum(
        v is not None for v in node.outputs
    ):
        return Cost(None, None)
    if any(s is None for s in (*ins, *outs)):
        return Cost(None, None)
    nbytes = _bytes(node, inputs, outputs)
    try:
        flops = _flops(node, _positional(node.inputs, inputs), ins, outs, opset)
    except (ValueError, TypeError, IndexError, KeyError, ZeroDivisionError, OverflowError):
        flops = None  # (attributes or shapes the rule cannot read: no count, never an error)
    products = (normalize_domain(node.domain), node.op) in _PRODUCTS
    return Cost(flops if flops is None or flops >= 0 else None, nbytes, products)


def _shape(t: TensorType | None) -> Shape | None:
    if not isinstance(t, TensorType) or t.shape is None or t.dtype is None:
        return None
    if t.dtype == DType.STRING or not all(isinstance(d, int) and d >= 0 for d in t.shape):
        return None
    return tuple(t.shape)  # type: ignore[arg-type]


def _positional(values: Sequence[Any], types: Sequence[TensorType | None]) -> list[Shape | None]:
    """Input shapes by position (None for omitted inputs), as the rules index them."""
    return [None if v is None else _shape(t) for v, t in zip(values, types)]


def _bytes(
    node: Node, inputs: Sequence[TensorType | None], outputs: Sequence[TensorType | None]
) -> int | None:
    """Bytes of the distinct tensors read and written (a tensor read twice counts once)."""
    seen: set[int] = set()
    total = 0
    for values, types in ((node.inputs, inputs), (node.outputs, outputs)):
        for v, t in zip(values, types):
            if v is None or id(v) in seen:
                continue
            seen.add(id(v))
            assert isinstance(t, TensorType) and t.dtype is not None  # (checked by _shape)
            total += (math.prod(t.shape or ()) * t.dtype.bits + 7) // 8
    return total


def _flops(
    node: Node, ins: list[Shape | None], present: list, outs: list, opset: int
) -> int | None:
    domain = normalize_domain(node.domain)

    def attr(name: str) -> Any:
        if name in node.attrs:
            return node.attrs[name]
        rec = get(node.op, domain)
        return None if rec is None else rec.defaults(opset).get(name)

    rule = _RULES.get((domain, node.op))
    if rule is not None:
        return rule(node, ins, outs, attr)
    per = PER_ELEMENT.get((domain, node.op))
    if per is not None:
        return per * math.prod(present[0]) if present else None
    if has_trait(node.op, domain, ELEMENTWISE):
        return math.prod(outs[0]) if outs else 0
    if has_trait(node.op, domain, REDUCTION):
        return math.prod(present[0]) if present else None
    if (domain == "" and node.op in MOVES_DATA) or has_trait(node.op, domain, SHAPE):
        return 0
    return None


# ---------------------------------------------------------------------------------------------
# Rules


@flop_rule("Conv", "ConvInteger", products=True)
@flop_rule("ConvAct", domain=FUSED_DOMAIN, products=True)
def _conv(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """2 * (output elements) * (input channels per group) * (kernel taps): W is [M, C/g, *k]."""
    return 2 * math.prod(outs[0]) * math.prod(ins[1][1:])


@flop_rule("QLinearConv", products=True)
def _qlinear_conv(node: Node, ins: list, outs: list, attr: Callable) -> int:
    return 2 * math.prod(outs[0]) * math.prod(ins[3][1:])  # (W is input 3)


@flop_rule("ConvTranspose", products=True)
def _conv_transpose(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """Each input element scatters into (output channels per group) * (kernel taps) outputs:
    W is [C, M/g, *k]."""
    return 2 * math.prod(ins[0]) * math.prod(ins[1][1:])


@flop_rule("MatMul", "MatMulInteger", "QLinearMatMul", products=True)
def _matmul(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """2 * (output elements) * K, K being A's last axis (batch axes broadcast)."""
    return 2 * math.prod(outs[0]) * ins[0][-1]


@flop_rule("Gemm", products=True)
@flop_rule("GemmAct", domain=FUSED_DOMAIN, products=True)
def _gemm(node: Node, ins: list, outs: list, attr: Callable) -> int:
    a = ins[0]
    k = a[0] if len(a) == 2 and attr("transA") else a[-1]
    return 2 * math.prod(outs[0]) * k


def _split_heads(shape: Shape, heads: int) -> tuple[int, int]:
    """(sequence length, head size) of a [B, H, S, D] or head-packed [B, S, H*D] tensor."""
    if len(shape) == 4:
        return shape[2], shape[3]
    if len(shape) == 3 and heads > 0 and shape[2] % heads == 0:
        return shape[1], shape[2] // heads
    raise ValueError(f"attention input of shape {shape} with {heads} heads")


def _attention_flops(q: Shape, k: Shape, v: Shape, q_heads: int, kv_heads: int, extra: int) -> int:
    """Q K^T and P V: 2 * B * Hq * Sq * Sk * (D + Dv), Sk including ``extra`` past keys."""
    sq, d = _split_heads(q, q_heads)
    sk, _ = _split_heads(k, kv_heads)
    _, dv = _split_heads(v, kv_heads)
    heads = q[1] if len(q) == 4 else q_heads
    return 2 * q[0] * heads * sq * (sk + extra) * (d + dv)


@flop_rule("Attention", domain=FUSED_DOMAIN, products=True)
def _fused_attention(node: Node, ins: list, outs: list, attr: Callable) -> int:
    heads = int(attr("num_heads") or 0) if attr("input_layout") == "bsd" else 0
    # (K and V may have fewer heads, broadcast: the query's heads are counted)
    return _attention_flops(ins[0], ins[1], ins[2], heads, heads, 0)


@flop_rule("Attention", products=True)
def _onnx_attention(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """ONNX Attention (opset 23): past keys (input 4, [B, Hkv, P, D]) add to the keys seen."""
    q_heads, kv_heads = int(attr("q_num_heads") or 0), int(attr("kv_num_heads") or 0)
    past = ins[4][2] if len(ins) > 4 and ins[4] is not None else 0
    return _attention_flops(ins[0], ins[1], ins[2], q_heads, kv_heads, past)


@flop_rule("RNN", "GRU", "LSTM", products=True)
def _recurrent(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """Each step multiplies its input by W [dirs, gates*H, I] and its state by R
    [dirs, gates*H, H]: 2 * (steps * batch) * (|W| + |R|)."""
    x, w, r = ins[0], ins[1], ins[2]
    return 2 * (math.prod(x) // x[-1]) * (math.prod(w) + math.prod(r))


@flop_rule("MaxPool", "AveragePool", "LpPool")
def _pool(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """1 per window tap per output element."""
    return math.prod(outs[0]) * math.prod(attr("kernel_shape"))


@flop_rule("SqueezeExcite", domain=FUSED_DOMAIN)
def _squeeze_excite(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """The spatial mean and the gate multiply (1 per element each), two 1x1 convolutions on the
    pooled [N, C] (2 per multiply-accumulate)."""
    x, w1, w2 = ins[0], ins[1], ins[3]
    return 2 * math.prod(x) + 2 * x[0] * (math.prod(w1) + math.prod(w2))


@flop_rule("Pointwise", domain=FUSED_DOMAIN)
def _pointwise(node: Node, ins: list, outs: list, attr: Callable) -> int:
    """1 per output element per arithmetic op of the body (its casts and shape ops are free)."""
    body = attr("body")
    ops = [n for n in body.nodes if n.op not in MOVES_DATA and not has_trait(n.op, "", SHAPE)]
    return math.prod(outs[0]) * len(ops)


@flop_rule("Einsum", products=True)
def _einsum(node: Node, ins: list, outs: list, attr: Callable) -> int | None:
    """One operand: 1 per input element. Two: 2 per multiply-accumulate of the product over
    every index (1 when no index is summed: an outer or elementwise product)."""
    equation = str(attr("equation")).replace(" ", "")
    lhs, _, rhs = equation.partition("->")
    terms = lhs.split(",")
    if len(terms) == 1:
        return math.prod(ins[0])
    if len(terms) != 2 or len(ins) != 2:
        return None
    sizes: dict[str, int] = {}
    for term, shape in zip(terms, ins):
        letters = term.replace("...", "")
        batch = len(shape) - len(letters)  # the axes the ellipsis stands for
        named = list(shape[:batch]) if "..." in term else []
        for i, size in enumerate(named):
            sizes[f"...{batch - i}"] = max(sizes.get(f"...{batch - i}", 1), size)
        rest = shape[batch:] if "..." in term else shape
        if "..." in term and term.index("...") != 0:
            return None  # (an ellipsis in the middle: not counted)
        for letter, size in zip(letters, rest):
            sizes[letter] = max(sizes.get(letter, 1), size)
    kept = set(rhs) if "->" in equation else {c for c in lhs if lhs.count(c) == 1}
    summed = any(c.isalpha() and c not in kept for c in sizes)
    return (2 if summed else 1) * math.prod(sizes.values())

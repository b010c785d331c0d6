"""Records of the ``tensorkiln`` domain's fused ops: attributes with their defaults, traits, shape
rules, and the activation table that ConvAct, GemmAct and SqueezeExcite share.

The optimizer's passes make these nodes; every backend's kernels implement them (the reference
kernels define their meaning).
"""

from __future__ import annotations

from tensorkiln.ir.dims import broadcast_shapes, dim_divide, dim_product, fresh_dim
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import Graph, Shape, TensorType, Type
from tensorkiln.ops.records import ELEMENTWISE, FUSED, define, rule
from tensorkiln.ops.shape_rules import InferContext
from tensorkiln.ops.window import geometry

DOMAIN = "tensorkiln"

# Activations a ConvAct/GemmAct epilogue applies ("" for none); parameters as on the ONNX op.
ACTIVATIONS = (
    "",
    "Relu",
    "LeakyRelu",
    "Clip",
    "Sigmoid",
    "Swish",
    "HardSigmoid",
    "HardSwish",
    "Gelu",
    "GeluTanh",
    "Tanh",
)
# ONNX's defaults of the activation parameters (alpha, beta), as float attributes store them
ACTIVATION_DEFAULTS: dict[str, tuple[float | None, float | None]] = {
    "LeakyRelu": (0.009999999776482582, None),
    "Swish": (1.0, None),
    "HardSigmoid": (0.20000000298023224, 0.5),
}


def check_activation(activation: str, what: str) -> None:
    """Raise ValueError when ``activation`` is not one :data:`ACTIVATIONS` names."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"{what}: unknown activation {activation!r}; known: {ACTIVATIONS[1:]}")


_EPILOGUE = {
    "activation": "",
    "activation_alpha": None,
    "activation_beta": None,
    "activation_min": None,
    "activation_max": None,
}
# MaxPool's attributes, as QConvPool carries them for its pool
_POOL = {
    "pool_auto_pad": "NOTSET",
    "pool_ceil_mode": 0,
    "pool_dilations": None,
    "pool_kernel_shape": None,
    "pool_pads": None,
    "pool_strides": None,
}
_CONV = {
    "auto_pad": "NOTSET",
    "dilations": None,
    "group": 1,
    "kernel_shape": None,
    "pads": None,
    "strides": None,
}

define(
    "ConvAct",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={**_CONV, **_EPILOGUE, "residual_order": "add_act"},
    doc="act(conv(X, W) + B + Z) ('add_act') or act(conv(X, W) + B) + Z ('act_add')",
)
define(
    "GemmAct",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0, **_EPILOGUE},
    doc="act(alpha * A' @ B' + beta * C) for a 2-D A, or A @ B' + C for a higher rank; an "
    "optional fourth input Z of the output's shape is added last (a residual: only without "
    "an activation)",
)
define(
    "QConvAct",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={**_CONV, **_EPILOGUE, "residual_order": "add_act", "out_dtype": 1},
    doc="ConvAct of a quantized X (int8 or float8, per-tensor scale) and W (per output channel): "
    "inputs X_q, X_scale, W_q, W_scale, B, Z, Y_scale, Z_scale; out in out_dtype (ONNX's code: "
    "float32, float16 or bfloat16; with Y_scale, int8 or float8 E4M3: the result quantized to "
    "Y_scale); with Z_scale the residual Z is quantized too (int8 or float8, read as "
    "Z * Z_scale in float32: its DequantizeLinear, fused)",
)
define(
    "QConvPool",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={**_CONV, **_EPILOGUE, "out_dtype": 1, **_POOL},
    doc="MaxPool(QConvAct(...)): QConvAct's inputs (no residual) and attributes, then a max "
    "pool with the pool_* attributes (MaxPool's: kernel_shape, strides, pads, dilations, "
    "ceil_mode, auto_pad) over its output; a network's stem and its pool in one layer, so that "
    "a kernel can pool the convolution's tiles before they are written",
)
define(
    "QGemmAct",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={"alpha": 1.0, "beta": 1.0, "transA": 0, "transB": 0, **_EPILOGUE, "out_dtype": 1},
    doc="GemmAct of a quantized A (per-tensor scale) and B (per output column): inputs A_q, "
    "A_scale, B_q, B_scale, C, Y_scale; out in out_dtype (with Y_scale: quantized to it)",
)
define(
    "LayerNorm",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={"axis": -1, "epsilon": 1e-5, "q_dtype": 0},
    doc="layer normalization of X (+ residual), with the pre-norm sum as optional 2nd output; "
    "with q_dtype (ONNX's code: int8 or float8 E4M3) and a fifth input Y_scale (per tensor), "
    "the outputs are Y, Y quantized to Y_scale as QuantizeLinear does, and the optional sum",
)
define(
    "RMSNorm",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={"axis": -1, "epsilon": 1e-5},
    doc="X / sqrt(mean(X^2) + epsilon) * scale",
)
define(
    "Gelu",
    domain=DOMAIN,
    traits=[FUSED, ELEMENTWISE],
    attributes={"approximate": "none"},
    doc="ONNX Gelu, for models below opset 20",
)
define("SiLU", domain=DOMAIN, traits=[FUSED, ELEMENTWISE], attributes={}, doc="X * sigmoid(X)")
define(
    "Attention",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={
        "scale": 0.0,
        "causal": 0,
        "mask_kind": "",
        "num_heads": 0,
        "input_layout": "bhsd",
        "output_layout": "bhsd",
        "q_dtype": 0,
    },
    doc="softmax(Q K^T * scale + mask) V; with q_dtype (ONNX's code: int8 or float8 E4M3) and a "
    "fifth input Y_scale (per tensor), the output quantized to Y_scale as QuantizeLinear does",
)
# Padding removal (passes/remove_padding.py): the tokens a key-padding mask keeps, packed.
define(
    "PackIndex",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={"padding": 0},
    doc="M [B, S] (nonzero: a token; with padding=1, nonzero: a pad) -> the kept tokens' flat "
    "indices, int64 [T] in row-major "
    "order, and one past each sequence's last packed row, int32 [B] (cumulative lengths)",
)
define(
    "PackTokens",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={},
    doc="X [B, S, ...], index [T] -> X's rows at the flat indices, [T, ...]",
)
define(
    "UnpackTokens",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={},
    doc="Y [T, ...], index [T], M [B, S] -> [B, S, ...]: Y's rows at their indices, zeros at the "
    "tokens M drops",
)
define(
    "PackedAttention",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={"scale": 0.0, "num_heads": 0, "causal": 0},
    doc="softmax(Q K^T * scale) V within each packed sequence (causal: each token sees the "
    "sequence's tokens up to itself): Q, K, V [T, H*D], cumulative lengths [B] (int32, "
    "PackIndex's) and M [B, S] (its S bounds every length) -> [T, H*Dv]",
)
define(
    "Pointwise",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={},
    doc="a tree of elementwise ops held as a body graph",
)
define(
    "SqueezeExcite",
    domain=DOMAIN,
    traits=[FUSED],
    attributes={},  # activation*/gate* attributes, read by prefix; absent means none
    doc="X * gate(conv1x1(act(conv1x1(mean(X)))))",
)


# ---------------------------------------------------------------------------------------------
# Shape rules


@rule("ConvAct", domain=DOMAIN)
def _conv_act_shape(ctx: InferContext) -> list[Type | None]:
    return [TensorType(ctx.dtype(0), _conv_out(ctx, ctx.shape(0), ctx.shape(1)))]


@rule("QConvAct", domain=DOMAIN)
def _qconv_act_shape(ctx: InferContext) -> list[Type | None]:
    return [TensorType(_out_dtype(ctx), _conv_out(ctx, ctx.shape(0), ctx.shape(2)))]


@rule("QConvPool", domain=DOMAIN)
def _qconv_pool_shape(ctx: InferContext) -> list[Type | None]:
    conv = _conv_out(ctx, ctx.shape(0), ctx.shape(2))
    return [TensorType(_out_dtype(ctx), _pool_out(ctx, conv))]


def pool_attrs(attrs: dict) -> dict:
    """QConvPool's pool as MaxPool's attributes (the ``pool_`` prefix dropped)."""
    return {k[5:]: v for k, v in attrs.items() if k.startswith("pool_") and v is not None}


def conv_attrs(attrs: dict) -> dict:
    """QConvPool's convolution as QConvAct's attributes (the pool's left out)."""
    return {k: v for k, v in attrs.items() if not k.startswith("pool_")}


def _pool_out(ctx: InferContext, conv: Shape | None) -> Shape | None:
    """(N, M, *out) of QConvPool's pool over the convolution's output ``conv``."""
    if conv is None:
        return None
    spatial = conv[2:]
    if not all(isinstance(d, int) for d in spatial):
        return (*conv[:2], *(fresh_dim() for _ in spatial))
    out = geometry(
        spatial,  # type: ignore[arg-type]
        ctx.attr("pool_kernel_shape"),
        ctx.attr("pool_strides"),
        ctx.attr("pool_dilations"),
        ctx.attr("pool_pads"),
        ctx.attr("pool_auto_pad", "NOTSET"),
        int(ctx.attr("pool_ceil_mode", 0) or 0),
    ).out
    return (*conv[:2], *out)


def _out_dtype(ctx: InferContext) -> DType:
    return DType(int(ctx.attr("out_dtype", DType.FLOAT.value)))


def _conv_out(ctx: InferContext, xs: Shape | None, ws: Shape | None) -> Shape | None:
    """(N, M, *out) with the conv geometry; symbolic spatial sizes give fresh symbols."""
    if xs is None or ws is None:
        return None
    spatial, kernel = xs[2:], ws[2:]
    if all(isinstance(d, int) for d in (*spatial, *kernel)):
        out: list = list(
            geometry(
                spatial,  # type: ignore[arg-type]
                kernel,  # type: ignore[arg-type]
                ctx.attr("strides"),
                ctx.attr("dilations"),
                ctx.attr("pads"),
                ctx.attr("auto_pad", "NOTSET"),
            ).out
        )
    else:
        out = [fresh_dim() for _ in spatial]
    return (xs[0], ws[0], *out)


@rule("GemmAct", domain=DOMAIN)
def _gemm_act_shape(ctx: InferContext) -> list[Type | None]:
    return [TensorType(ctx.dtype(0), _gemm_out(ctx, ctx.shape(0), ctx.shape(1)))]


@rule("QGemmAct", domain=DOMAIN)
def _qgemm_act_shape(ctx: InferContext) -> list[Type | None]:
    return [TensorType(_out_dtype(ctx), _gemm_out(ctx, ctx.shape(0), ctx.shape(2)))]


def _gemm_out(ctx: InferContext, a: Shape | None, b: Shape | None) -> Shape | None:
    """(M, N) for a 2-D A (transA applied), (*A[:-1], N) for a higher rank."""
    if a is None or b is None:
        return None
    n = b[0] if ctx.attr("transB", 0) else b[1]
    if len(a) == 2 and ctx.attr("transA", 0):
        return (a[1], n)
    return (*a[:-1], n)


@rule("LayerNorm", domain=DOMAIN)
def _layer_norm_shape(ctx: InferContext) -> list[Type | None]:
    shape = ctx.shape(0)
    if len(ctx.node.inputs) > 3 and ctx.node.inputs[3] is not None:
        res = ctx.shape(3)
        shape = None if shape is None or res is None else broadcast_shapes(shape, res)
    t = TensorType(ctx.dtype(0), shape)
    out = [t] * len(ctx.node.outputs)
    q_dtype = int(ctx.attr("q_dtype", 0) or 0)
    if q_dtype and len(out) > 1:
        out[1] = TensorType(DType(q_dtype), shape)
    return out


@rule("RMSNorm", "Gelu", "SiLU", "SqueezeExcite", domain=DOMAIN)
def _same_as_input_shape(ctx: InferContext) -> list[Type | None]:
    return [TensorType(ctx.dtype(0), ctx.shape(0))]


def _heads_view(shape: Shape | None, heads: int) -> Shape | None:
    """[B, S, H*D] -> [B, H, S, D] as a shape."""
    if shape is None or len(shape) != 3:
        return None
    d = dim_divide(shape[2], heads)
    return None if d is None else (shape[0], heads, shape[1], d)


@rule("Attention", domain=DOMAIN)
def _attention_shape(ctx: InferContext) -> list[Type | None]:
    q, k, v = ctx.shape(0), ctx.shape(1), ctx.shape(2)
    if ctx.attr("input_layout", "bhsd") == "bsd":
        heads = int(ctx.attr("num_heads", 0))
        q, k, v = (_heads_view(x, heads) for x in (q, k, v))
    q_dtype = int(ctx.attr("q_dtype", 0) or 0)
    dtype = DType(q_dtype) if q_dtype else ctx.dtype(0)
    if any(x is None or len(x) != 4 for x in (q, k, v)):
        return [TensorType(dtype, None)]
    b, h = broadcast_shapes(q[:2], k[:2], v[:2])  # type: ignore[index]
    s, dv = q[2], v[3]  # type: ignore[index]
    layout = ctx.attr("output_layout", "bhsd")
    shape = {"bhsd": (b, h, s, dv), "bshd": (b, s, h, dv), "bsd": (b, s, dim_product((h, dv)))}
    return [TensorType(dtype, shape[layout])]


@rule("PackIndex", domain=DOMAIN)
def _pack_index_shape(ctx: InferContext) -> list[Type | None]:
    """The packed length is data-dependent: its bound, B * S, is what the engine plans for."""
    m = ctx.shape(0)
    if m is None or len(m) != 2:
        return [TensorType(DType.INT64, (fresh_dim(),)), TensorType(DType.INT32, (fresh_dim(),))]
    return [TensorType(DType.INT64, (dim_product(m),)), TensorType(DType.INT32, (m[0],))]


@rule("PackTokens", domain=DOMAIN)
def _pack_tokens_shape(ctx: InferContext) -> list[Type | None]:
    x, index = ctx.shape(0), ctx.shape(1)
    if x is None or index is None or len(x) < 2:
        return [TensorType(ctx.dtype(0), None)]
    return [TensorType(ctx.dtype(0), (index[0], *x[2:]))]


@rule("UnpackTokens", domain=DOMAIN)
def _unpack_tokens_shape(ctx: InferContext) -> list[Type | None]:
    y, m = ctx.shape(0), ctx.shape(2)
    if y is None or m is None or len(m) != 2:
        return [TensorType(ctx.dtype(0), None)]
    return [TensorType(ctx.dtype(0), (*m, *y[1:]))]


@rule("PackedAttention", domain=DOMAIN)
def _packed_attention_shape(ctx: InferContext) -> list[Type | None]:
    q, v = ctx.shape(0), ctx.shape(2)
    if q is None or v is None or len(q) != 2 or len(v) != 2:
        return [TensorType(ctx.dtype(0), None)]
    return [TensorType(ctx.dtype(0), (q[0], v[1]))]


@rule("Pointwise", domain=DOMAIN)
def _pointwise_shape(ctx: InferContext) -> list[Type | None]:
    """The body's output types, inferred (by the inference that asked) with the node's input
    types bound to the body's inputs."""
    body: Graph = ctx.attr("body")
    for i, v in enumerate(body.inputs):
        t = ctx.type(i)
        if isinstance(t, TensorType):
            v.type = t
    if ctx.infer is not None:
        ctx.infer(body)
    return [v.type for v in body.outputs]

"""The cuda backend's kernels of the fused ops (tensorkiln domain) against the numpy reference.

Kernel tests call both kernels through the registry on fresh random inputs: float32 within 1e-5
relative (an absolute floor at the output's scale), float16/bfloat16 inputs against the reference run
on the same values in float32, within 1e-2 of the output's norm. Inputs must come back unchanged
(the epilogues run in place on fresh outputs only). Model tests build small graphs, run the graph
optimizer (which makes the fused ops) and the cuda backend, and compare with the reference backend
on the unoptimized graph; exported real models need the cuda kernels of every op they keep and skip,
naming the op, where one is missing.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import tensorkiln  # noqa: E402
from tensorkiln.builder.builder import optimize  # noqa: E402
from tensorkiln.errors import UnsupportedOpError  # noqa: E402
from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import has_kernel, invoke, lookup  # noqa: E402
from tensorkiln.runtime import Runner  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32 = TensorProto.FLOAT
RTOL = 1e-5
HALF_TOL = 1e-2


def _rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs on every run


def _rand(*shape: int) -> np.ndarray:
    return _rng().standard_normal(shape).astype(np.float32)


# ------------------------------------------------------------------------------ kernel checks


def _strided(a: np.ndarray) -> torch.Tensor:
    """``a`` as a tensor whose last two axes are a transposed (non-contiguous) view."""
    t = to_torch(np.ascontiguousarray(np.swapaxes(a, -1, -2)), DEVICE)
    return t.transpose(-1, -2)


def _device_args(args: list, strided: bool) -> list:
    out = []
    for a in args:
        if isinstance(a, np.ndarray) and strided and a.ndim >= 2 and min(a.shape[-2:]) > 1:
            out.append(_strided(a))
        else:
            out.append(to_torch(a, DEVICE))
    return out


def _narrow(a, dtype):
    return a.astype(dtype) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a


def _wide(a):
    return a.astype(np.float32) if isinstance(a, np.ndarray) and a.dtype.kind == "f" else a


def check(
    op: str,
    args: list,
    attrs: dict | None = None,
    *,
    n_outputs: int = 1,
    dtype=np.float32,
    strided: bool = False,
) -> list[np.ndarray]:
    """Run ``op``'s cuda and reference kernels on ``args``; assert they agree. Returns the cuda
    kernel's outputs. Non-float32 ``dtype``: float inputs are rounded to it, the reference runs on
    the rounded values in float32."""
    attrs = attrs or {}
    args = [_narrow(a, dtype) for a in args]
    ref = lookup(op, "tensorkiln", 1, "reference")
    cuda = lookup(op, "tensorkiln", 1, "cuda")
    half = np.dtype(dtype) != np.float32
    expected = invoke(ref, [_wide(a) for a in args] if half else args, attrs, n_outputs)
    device_args = _device_args(args, strided)
    before = [a.clone() if isinstance(a, torch.Tensor) else None for a in device_args]
    got = [to_numpy(g) for g in invoke(cuda, device_args, attrs, n_outputs)]
    for a, b in zip(device_args, before):
        if b is not None:
            assert torch.equal(a, b) or torch.isnan(a).any(), f"{op} modified an input in place"
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, f"{op} output {i}: shape {g.shape}, reference {e.shape}"
        if half:
            assert g.dtype == np.dtype(dtype), f"{op} output {i}: dtype {g.dtype}"
            err = np.linalg.norm(g.astype(np.float64) - e.astype(np.float64))
            assert err <= HALF_TOL * max(np.linalg.norm(e.astype(np.float64)), 1e-30), (
                f"{op} output {i}: error {err:.3g} against norm {np.linalg.norm(e):.3g}"
            )
        else:
            assert g.dtype == e.dtype, f"{op} output {i}: dtype {g.dtype}, reference {e.dtype}"
            scale = float(np.nanmax(np.abs(e))) if e.size else 0.0
            np.testing.assert_allclose(
                g, e, rtol=RTOL, atol=RTOL * scale, equal_nan=True, err_msg=f"{op} output {i}"
            )
    return got


ACTIVATIONS = {  # activation -> its parameters as the fusions write them
    "": {},
    "Relu": {},
    "LeakyRelu": {"activation_alpha": 0.2},
    "Clip": {"activation_min": -0.5, "activation_max": 2.0},
    "Sigmoid": {},
    "Swish": {"activation_alpha": 1.0},
    "HardSigmoid": {"activation_alpha": 0.3, "activation_beta": 0.4},
    "HardSwish": {},
    "Gelu": {},
    "GeluTanh": {},
    "Tanh": {},
}


def _act(name: str) -> dict:
    return {"activation": name, **ACTIVATIONS[name]} if name else {}


# ---------------------------------------------------------------------------------- ConvAct

_CONV_4D = {"strides": [2, 1, 1, 2], "dilations": [2, 1, 1, 1], "group": 2}
_CONV_4D["pads"] = [1, 0, 1, 0, 0, 1, 0, 1]
GEOMETRIES = [  # (C, M, spatial, kernel, attrs)
    (4, 6, (9, 9), (3, 3), {}),
    (4, 6, (10, 11), (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (4, 6, (9, 9), (3, 3), {"dilations": [2, 2], "pads": [2, 0, 1, 2]}),
    (4, 6, (8, 8), (3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    (4, 8, (8, 8), (3, 3), {"group": 4, "strides": [2, 1], "pads": [1, 1, 1, 1]}),  # depthwise
    (5, 7, (6, 6), (1, 1), {}),
    (3, 4, (7, 9), (2, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    (3, 4, (7, 8), (2, 2), {"auto_pad": "SAME_LOWER"}),
    (3, 4, (7, 8), (3, 2), {"auto_pad": "VALID", "kernel_shape": [3, 2]}),
    (3, 4, (12,), (3,), {"pads": [1, 1]}),
    (2, 3, (5, 4, 6), (2, 2, 3), {"strides": [1, 2, 1], "pads": [0, 1, 1, 1, 0, 1]}),
    (2, 4, (5, 4, 4, 5), (2, 3, 2, 2), _CONV_4D),  # tap by tap over 3-D convolutions
]


def _conv_args(c, m, spatial, kernel, attrs, bias=True, residual=False):
    g = attrs.get("group", 1)
    x, w = _rand(2, c, *spatial), _rand(m, c // g, *kernel)
    b = _rand(m) if bias else None
    z = None
    if residual:
        ref = lookup("ConvAct", "tensorkiln", 1, "reference")
        shape = invoke(ref, [x, w], attrs, 1)[0].shape
        z = _rand(*shape)
    return [x, w, b, z]


@pytest.mark.parametrize("geo", GEOMETRIES, ids=range(len(GEOMETRIES)))
@pytest.mark.parametrize("residual", [False, True])
def test_conv_act_geometries(geo, residual):
    c, m, spatial, kernel, attrs = geo
    args = _conv_args(c, m, spatial, kernel, attrs, residual=residual)
    check("ConvAct", args, {**attrs, "activation": "Relu"})


@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("order", ["add_act", "act_add"])
def test_conv_act_activations(act, order):
    args = _conv_args(4, 6, (7, 7), (3, 3), {"pads": [1, 1, 1, 1]}, residual=True)
    attrs = {"pads": [1, 1, 1, 1], "residual_order": order, **_act(act)}
    check("ConvAct", args, attrs)


def test_conv_act_without_bias_and_activation_defaults():
    args = _conv_args(3, 5, (6, 6), (3, 3), {}, bias=False)
    check("ConvAct", args)
    for act in ("LeakyRelu", "HardSigmoid", "Swish"):  # parameters left to the op's defaults
        check("ConvAct", args, {"activation": act})
    # nn.Hardsigmoid's constants as exported (alpha 1/6 in float32): torch's hardsigmoid on CPU
    check("ConvAct", args, {"activation": "HardSigmoid", "activation_alpha": 0.1666666716337204})
    check("ConvAct", args, {"activation": "Clip", "activation_max": 0.5})
    check("ConvAct", args, {"activation": "Clip"})


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_conv_act_half_precision(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    args = _conv_args(8, 16, (10, 10), (3, 3), {"pads": [1, 1, 1, 1]}, residual=True)
    check("ConvAct", args, {"pads": [1, 1, 1, 1], "activation": "Relu"}, dtype=dtype)
    check("ConvAct", args, {"pads": [1, 1, 1, 1], **_act("HardSwish")}, dtype=dtype)


def test_conv_act_strided_input_and_empty_batch():
    args = _conv_args(3, 4, (6, 7), (3, 3), {}, residual=True)
    check("ConvAct", args, {"activation": "Sigmoid"}, strided=True)
    x, w, b, _ = _conv_args(3, 4, (6, 7), (3, 3), {})
    cuda = lookup("ConvAct", "tensorkiln", 1, "cuda").fn
    y = cuda(*(to_torch(a, DEVICE) for a in (x[:0], w, b)), activation="Relu")
    assert tuple(y.shape) == (0, 4, 4, 5) and y.dtype == torch.float32


def test_conv_act_rejects_bad_inputs():
    x, w, _b, _ = _conv_args(3, 4, (6, 6), (3, 3), {})
    cuda = lookup("ConvAct", "tensorkiln", 1, "cuda").fn
    xt, wt = to_torch(x, DEVICE), to_torch(w, DEVICE)
    with pytest.raises(ValueError, match="residual Z"):
        cuda(xt, wt, None, to_torch(_rand(2, 4, 3, 3), DEVICE))
    with pytest.raises(ValueError, match="bias B"):
        cuda(xt, wt, to_torch(_rand(5), DEVICE))
    with pytest.raises(ValueError, match="unknown activation"):
        cuda(xt, wt, activation="Mish")
    with pytest.raises(ValueError, match="residual_order"):
        cuda(xt, wt, residual_order="later")


# ---------------------------------------------------------------------------------- GemmAct

GEMMS = [  # (A shape, B shape, C shape or None, attrs)
    ((5, 7), (7, 3), (3,), {}),
    ((5, 7), (3, 7), (1, 3), {"transB": 1}),
    ((7, 5), (7, 3), (5, 3), {"transA": 1, "alpha": 0.5, "beta": 2.0}),
    ((7, 5), (3, 7), (5, 1), {"transA": 1, "transB": 1}),
    ((5, 7), (7, 3), (), {"alpha": -1.5}),
    ((5, 7), (7, 3), None, {"alpha": 3.0}),
    ((2, 3, 7), (7, 4), (4,), {}),
    ((2, 3, 7), (4, 7), (1, 1, 4), {"transB": 1, "beta": 0.5}),
    ((2, 2, 3, 7), (7, 4), (1,), {"alpha": 2.0}),
    ((2, 3, 7), (7, 4), None, {}),
    ((0, 7), (7, 3), (3,), {}),
]


def _gemm_args(a, b, c):
    return [_rand(*a), _rand(*b), None if c is None else _rand(*c)]


@pytest.mark.parametrize("shapes", GEMMS, ids=range(len(GEMMS)))
@pytest.mark.parametrize("act", ["", "Relu", "GeluTanh"])
def test_gemm_act_shapes(shapes, act):
    a, b, c, attrs = shapes
    check("GemmAct", _gemm_args(a, b, c), {**attrs, **_act(act)})


@pytest.mark.parametrize("act", list(ACTIVATIONS))
def test_gemm_act_activations(act):
    check("GemmAct", _gemm_args((6, 9), (9, 5), (5,)), _act(act))
    check("GemmAct", _gemm_args((2, 3, 9), (9, 5), (5,)), _act(act), strided=True)


def test_gemm_act_empty_inner_dimension():
    c = _rand(3)
    cuda = lookup("GemmAct", "tensorkiln", 1, "cuda").fn
    args = [to_torch(a, DEVICE) for a in (_rand(5, 0), _rand(0, 3), c)]
    y = to_numpy(cuda(*args, beta=2.0, activation="Relu"))
    np.testing.assert_array_equal(y, np.broadcast_to(np.maximum(2 * c, 0), (5, 3)))


def test_gemm_act_beta_zero_ignores_c():
    a, b, c = _gemm_args((4, 6), (6, 3), (4, 3))
    c[0, 0] = np.nan
    got = check("GemmAct", [a, b, c], {"beta": 0.0, "activation": "Relu"})
    assert np.isfinite(got[0]).all()


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
@pytest.mark.parametrize("act", ["Relu", "Gelu", "GeluTanh", "Swish"])
def test_gemm_act_half_precision(dtype, act):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    check("GemmAct", _gemm_args((2, 16, 64), (64, 32), (32,)), _act(act), dtype=dtype)
    check(
        "GemmAct",
        _gemm_args((64, 16), (32, 64), (16, 32)),
        {"transA": 1, "transB": 1, **_act(act)},
        dtype=dtype,
    )


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tanh_gelu_epilogue_tactic(dtype):
    """cublaslt_gelu_tanh runs an erf-GELU GemmAct as the tanh GELU of the same GEMM: the
    reference's GeluTanh to rounding, and within fp16's tolerance of the exact erf GELU the
    autotuner checks it against; it applies only to 16-bit operands with a bias row on a GPU."""
    from tensorkiln.kernels.tactics import LayerSpec, get_tactic

    tactic = get_tactic("GemmAct", "tensorkiln", "cublaslt_gelu_tanh")
    tdtype = getattr(torch, dtype)
    args = _gemm_args((2, 24, 64), (64, 96), (96,))
    attrs = {"beta": 1.0, "activation": "Gelu"}

    def spec(shapes=((2, 24, 64), (64, 96), (96,)), dtypes=(dtype,) * 3, device="cuda", **at):
        return LayerSpec("GemmAct", "tensorkiln", {**attrs, **at}, shapes, dtypes, device=device)

    assert tactic.applies(spec())
    assert tactic.applies(spec(((48, 64), (96, 64), (1, 96)), transB=1))
    assert not tactic.applies(spec(dtypes=("float32",) * 3))  # (fp32 engines: exact GELU)
    assert not tactic.applies(spec(device="cpu"))
    assert not tactic.applies(spec(activation="Relu"))
    assert not tactic.applies(spec(((48, 64), (64, 96), (48, 96))))  # a full C, not a row
    tensors = [to_torch(a, DEVICE).to(tdtype) for a in args]
    got = tactic.fn(*tensors, **attrs).double()
    wide = [t.double().cpu().numpy() for t in tensors]  # (the rounded operands, exactly)
    reference = lookup("GemmAct", "tensorkiln", 1, "reference")
    tanh = invoke(reference, wide, {**attrs, "activation": "GeluTanh"}, 1)[0]
    erf = invoke(reference, wide, attrs, 1)[0]
    tol = 1e-2 if dtype == "float16" else 4e-2
    np.testing.assert_allclose(to_numpy(got), tanh, rtol=tol, atol=tol * np.abs(tanh).max())
    assert np.linalg.norm(to_numpy(got) - erf) <= 1e-2 * np.linalg.norm(erf)
    assert 0 < np.abs(tanh - erf).max() <= 5e-4 * max(1.0, np.abs(erf).max())


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_gemm_act_rejects_bad_shapes(backend):
    kernel = lookup("GemmAct", "tensorkiln", 1, backend).fn
    put = functools.partial(to_torch, device=DEVICE) if backend == "cuda" else np.asarray
    a3, b = put(_rand(2, 3, 4)), put(_rand(4, 5))
    with pytest.raises(ValueError, match="transA"):
        kernel(a3, b, transA=1)
    with pytest.raises(ValueError, match="last axis"):
        kernel(a3, b, put(_rand(3, 5)))
    with pytest.raises(ValueError, match="inner"):
        kernel(a3, put(_rand(3, 5)))
    with pytest.raises(ValueError, match="inner"):  # A' is (4, 3) but B' is (5, 4)
        kernel(put(_rand(3, 4)), b, transA=1, transB=1)


@pytest.mark.parametrize("backend", ["cuda", "reference"])
def test_gemm_rejects_bad_shapes(backend):
    """Gemm shares GemmAct's checks (kernels/common/gemm.py), named for Gemm, and keeps the
    spec's 2-D A."""
    kernel = lookup("Gemm", "", 13, backend).fn
    put = functools.partial(to_torch, device=DEVICE) if backend == "cuda" else np.asarray
    with pytest.raises(ValueError, match="Gemm: inner dimensions differ"):
        kernel(put(_rand(3, 4)), put(_rand(5, 6)))
    with pytest.raises(ValueError, match="Gemm: A must be 2-D"):
        kernel(put(_rand(2, 3, 4)), put(_rand(4, 5)))
    with pytest.raises(ValueError, match="Gemm: B must be 2-D"):
        kernel(put(_rand(3, 4)), put(_rand(1, 4, 5)))


# ------------------------------------------------------------------------ LayerNorm, RMSNorm


LAYER_NORMS = [  # (X shape, scale shape, bias shape or None, residual shape or None, axis)
    ((2, 5, 16), (16,), (16,), None, -1),
    ((2, 5, 16), (16,), None, None, -1),
    ((2, 5, 16), (5, 16), (5, 16), None, -2),
    ((2, 5, 16), (1, 16), (16,), None, 1),  # scale spans one of the two normalized axes
    ((3, 8), (3, 8), (8,), None, 1),  # scale varies along the leading axis: applied after
    ((2, 5, 16), (16,), (16,), (2, 5, 16), -1),
    ((2, 5, 16), (16,), (16,), (5, 16), -1),  # the residual broadcasts
    ((4, 32), (32,), None, (4, 32), 0),
    ((0, 16), (16,), (16,), None, -1),
]


@pytest.mark.parametrize("case", LAYER_NORMS, ids=range(len(LAYER_NORMS)))
def test_layer_norm(case):
    xs, ss, bs, rs, axis = case
    args = [_rand(*xs), _rand(*ss), None if bs is None else _rand(*bs)]
    args.append(None if rs is None else _rand(*rs))
    attrs = {"axis": axis, "epsilon": float(_rng().choice([1e-5, 1e-12, 0.1]))}
    check("LayerNorm", args, attrs, strided=True)
    if rs is not None:
        _y, s = check("LayerNorm", args, attrs, n_outputs=2)
        np.testing.assert_array_equal(s, args[0] + args[3])


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16"])
def test_layer_norm_half_precision(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = _rand(2, 8, 64) * 30 + 100  # an offset mean: the variance needs float32 statistics
    check("LayerNorm", [x, _rand(64), _rand(64)], {}, dtype=dtype)
    check("LayerNorm", [x, _rand(64), _rand(64), _rand(2, 8, 64)], {}, n_outputs=2, dtype=dtype)
    check("LayerNorm", [x, _rand(8, 64)], {"axis": -2}, dtype=dtype)


RMS_NORMS = [
    ((2, 5, 16), (16,), -1),
    ((2, 5, 16), (5, 16), 1),
    ((3, 8), (3, 8), 0),
    ((0, 4), (4,), -1),
]


@pytest.mark.parametrize("case", RMS_NORMS, ids=range(len(RMS_NORMS)))
def test_rms_norm(case):
    xs, ss, axis = case
    check("RMSNorm", [_rand(*xs), _rand(*ss)], {"axis": axis, "epsilon": 1e-6}, strided=True)


@pytest.mark.parametrize("dtype", [np.float16, "bfloat16", np.float64])
def test_rms_norm_other_dtypes(dtype):
    import ml_dtypes

    dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
    x = _rand(4, 8, 256) * 200  # squares past float16's range: the sum needs float32
    if dtype == np.float64:
        check("RMSNorm", [x.astype(dtype), _rand(256).astype(dtype)])
    else:
        check("RMSNorm", [x, _rand(256)], dtype=dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gelu_and_silu(approximate, dtype):
    x = _rand(3, 7, 33) * 4
    check("Gelu", [x], {"approximate": approximate}, dtype=dtype, strided=True)
    check("SiLU", [x], dtype=dtype, strided=True)


def test_gelu_rejects_unknown_approximation():
    with pytest.raises(ValueError, match="approximate"):
        lookup("Gelu", "tensorkiln", 1, "cuda").fn(to_torch(_rand(3), DEVICE), approximate="x")


# -------------------------------------------------------------------------------- Attention

B, H, S, D = 2, 4, 6, 8


def _qkv(layout: str, sq: int = S, sk: int = S, dv: int = D, batch: int = B):
    if layout == "bsd":
        return [_rand(batch, sq, H * D), _rand(batch, sk, H * D), _rand(batch, sk, H * dv)]
    return [_rand(batch, H, sq, D), _rand(batch, H, sk, D), _rand(batch, H, sk, dv)]


def _mask(kind: str, shape) -> np.ndarray | None:
    if kind == "bool":
        keep = _rng().random(shape) < 0.7
        keep[..., 0] = True
        return keep
    if kind == "additive":
        add = np.where(_rng().random(shape) < 0.7, _rand(*shape), np.float32(-1e9))
        add[..., 0] = 0.0  # every query sees at least one key
        return add
    return None


@pytest.mark.parametrize("mask_kind", ["", "additive", "bool"])
@pytest.mark.parametrize("causal", [0, 1])
@pytest.mark.parametrize(
    ("input_layout", "output_layout"),
    [("bhsd", "bhsd"), ("bhsd", "bshd"), ("bsd", "bsd"), ("bsd", "bhsd")],
)
def test_attention(mask_kind, causal, input_layout, output_layout):
    args = _qkv(input_layout)
    mask = _mask(mask_kind, (B, 1, S, S))
    attrs = {
        "scale": float(_rng().choice([0.0, 0.3])),
        "causal": causal,
        "mask_kind": mask_kind,
        "num_heads": H if input_layout == "bsd" else 0,
        "input_layout": input_layout,
        "output_layout": output_layout,
    }
    check("Attention", args + ([mask] if mask is not None else []), attrs)


@pytest.mark.parametrize("mask_kind", ["", "additive", "bool"])
def test_attention_uneven_lengths_and_broadcasts(mask_kind):
    q, k, v = _qkv("bhsd", sq=5, sk=9, dv=6)
    k, v = k[:1], v[:, :1]  # K broadcast over the batch, V over the heads
    mask = _mask(mask_kind, (5, 9))  # one mask for every batch and head
    attrs = {"causal": 1, "mask_kind": mask_kind}
    check("Attention", [q, k, v] + ([mask] if mask is not None else []), attrs)


@pytest.mark.parametrize("mask_kind", ["additive", "bool"])
def test_attention_expanded_mask(mask_kind):
    """A mask broadcast along the key axis (stride 0, as an exporter's Expand leaves it): the
    GPU's fused SDPA kernels want a unit stride there, so the kernel materializes it."""
    q, k, v = _qkv("bhsd")
    mask = _mask(mask_kind, (B, 1, S, 1))
    if mask_kind == "bool":
        mask[..., 0] = True  # (every row sees every key, or none)
    attrs = {"causal": 0, "mask_kind": mask_kind}
    ref = invoke(lookup("Attention", "tensorkiln", 1, "reference"),
                 [q, k, v, np.broadcast_to(mask, (B, 1, S, S))], attrs, 1)  # fmt: skip
    expanded = to_torch(mask, DEVICE).expand(B, 1, S, S)
    assert expanded.stride(-1) == 0
    for m in (expanded, to_torch(mask, DEVICE)):  # an expanded view, and the size-1 key axis
        args = [to_torch(a, DEVICE) for a in (q, k, v)] + [m]
        got = invoke(lookup("Attention", "tensorkiln", 1, "cuda"), args, attrs, 1)
        np.testing.assert_allclose(to_numpy(got[0]), ref[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(), (S,)])
def test_attention_scalar_and_per_key_masks(shape):
    mask = _rand(*shape)
    check("Attention", [*_qkv("bhsd"), mask], {"mask_kind": "additive", "causal": 1})


def test_attention_fully_masked_rows_give_zeros():
    q, k, v = _qkv("bhsd")
    keep = np.ones((B, 1, S, S), bool)
    keep[0, 0, 2] = False
    add = np.where(keep, 0, -np.inf).astype(np.float32)
    for mask, kind in ((keep, "bool"), (add, "additive")):
        (y,) = check("Attention", [q, k, v, mask], {"mask_kind": kind})
        assert not np.isnan(y).any()
        np.testing.assert_array_equal(y[0, :, 2], 0.0)


@pytest.mark.parametrize("mask_kind", ["", "additive", "bool"])
def test_attention_float16(mask_kind):
    q, k, v = (x * 8 for x in _qkv("bsd", sq=16, sk=16))  # scores past float16's range
    mask = _mask(mask_kind, (B, 1, 1, 16))
    if mask_kind == "additive":
        mask = np.where(mask > -1e9, mask, np.finfo(np.float32).min).astype(np.float32)
    attrs = {
        "mask_kind": mask_kind,
        "num_heads": H,
        "input_layout": "bsd",
        "causal": 1,
        "output_layout": "bsd",
    }
    args = [q, k, v] + ([mask] if mask is not None else [])
    ref = lookup("Attention", "tensorkiln", 1, "reference")
    cuda = lookup("Attention", "tensorkiln", 1, "cuda")
    half = [to_torch(a.astype(np.float16) if i < 3 else a, DEVICE) for i, a in enumerate(args)]
    got = to_numpy(invoke(cuda, half, attrs, 1)[0])
    wide = [a.astype(np.float16).astype(np.float32) if i < 3 else a for i, a in enumerate(args)]
    (expected,) = invoke(ref, wide, attrs, 1)
    assert got.dtype == np.float16 and np.isfinite(got).all()
    err = np.linalg.norm(got.astype(np.float64) - expected)
    assert err <= HALF_TOL * np.linalg.norm(expected)


def test_attention_rejects_bad_attributes():
    cuda = lookup("Attention", "tensorkiln", 1, "cuda").fn
    q, k, v = (to_torch(a, DEVICE) for a in _qkv("bhsd"))
    with pytest.raises(ValueError, match="mask_kind"):
        cuda(q, k, v, mask_kind="additive")
    with pytest.raises(ValueError, match="input_layout"):
        cuda(q, k, v, input_layout="sbd")
    with pytest.raises(ValueError, match="bsd"):
        cuda(q, k, v, input_layout="bsd", num_heads=3)


# ------------------------------------------------------------- graphs through the optimizer


def _vi(name: str, shape, dtype: int = F32):
    return helper.make_tensor_value_info(name, dtype, None if shape is None else list(shape))


def _init(name: str, arr) -> object:
    return numpy_helper.from_array(np.asarray(arr), name)


def _model(nodes, inputs, outputs, inits=(), opset: int = 17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def _feeds_for(model) -> dict[str, np.ndarray]:
    g = tensorkiln.import_onnx(model)
    feeds = {}
    for v in g.inputs:
        if v.dtype.name == "BOOL":
            keep = _rng().random(tuple(v.shape)) < 0.7
            keep[..., 0] = True
            feeds[v.name] = keep
        else:
            feeds[v.name] = _rand(*v.shape).astype(v.dtype.numpy)
    return feeds


def run_optimized(model, feeds, *, rtol: float = 1e-4) -> list[str]:
    """Optimize ``model`` for the cuda backend, run it there and compare with the reference
    backend on the unoptimized model. Returns the fused graph's ops (fused ones 'tensorkiln.Op');
    skips when the optimized graph keeps an op the cuda backend lacks."""
    graph = tensorkiln.import_onnx(model, backend="cuda")
    optimize(graph, 3)
    fused = [f"{n.domain}.{n.op}" if n.domain else n.op for n in graph.nodes]
    try:
        runner = Runner(graph, backend="cuda", device=DEVICE)
    except UnsupportedOpError as exc:
        pytest.skip(f"no cuda kernel: {exc}")
    got = runner.infer(feeds)
    expected = Runner(model).infer(feeds)
    assert list(got) == list(expected)
    for name, e in expected.items():
        g = got[name]
        assert g.shape == e.shape and g.dtype == e.dtype, f"{name}: {g.dtype}{g.shape}"
        if e.dtype == np.float16:
            err = np.linalg.norm(g.astype(np.float64) - e.astype(np.float64))
            assert err <= HALF_TOL * np.linalg.norm(e.astype(np.float64)), name
        else:
            atol = rtol * float(np.abs(e).max()) if e.size else 0.0
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=name)
    return fused


def _conv_block_model(dtype=np.float32, elem=F32):
    """Conv + per-channel Add + residual Add + Relu; Conv + HardSwish; Conv + erf GELU; Conv +
    Sigmoid*x + residual after; the ResNet and MobileNet epilogues."""

    def w(*shape):
        return (_rand(*shape) * 0.3).astype(dtype)

    nodes = [
        helper.make_node("Conv", ["x", "W1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Add", ["c1", "B1"], ["c1b"]),
        helper.make_node("Add", ["c1b", "x"], ["c1r"]),
        helper.make_node("Relu", ["c1r"], ["y1"]),
        helper.make_node("Conv", ["y1", "W2", "B2"], ["c2"], strides=[2, 2], pads=[0, 0, 1, 1]),
        helper.make_node("HardSwish", ["c2"], ["y2"]),
        helper.make_node("Conv", ["y2", "W3", "B3"], ["c3"], group=8, pads=[1, 1, 1, 1]),
        helper.make_node("Div", ["c3", "sqrt2"], ["g1"]),
        helper.make_node("Erf", ["g1"], ["g2"]),
        helper.make_node("Add", ["g2", "one"], ["g3"]),
        helper.make_node("Mul", ["c3", "g3"], ["g4"]),
        helper.make_node("Mul", ["g4", "half"], ["y3"]),
        helper.make_node("Conv", ["y3", "W4", "B4"], ["c4"], auto_pad="SAME_UPPER"),
        helper.make_node("Sigmoid", ["c4"], ["s4"]),
        helper.make_node("Mul", ["c4", "s4"], ["a4"]),
        helper.make_node("Add", ["a4", "y3"], ["y"]),
    ]
    inits = [
        _init("W1", w(8, 8, 3, 3)),
        _init("B1", w(1, 8, 1, 1)),
        _init("W2", w(8, 8, 3, 3)),
        _init("B2", w(8)),
        _init("W3", w(8, 1, 3, 3)),
        _init("B3", w(8)),
        _init("W4", w(8, 8, 2, 2)),
        _init("B4", w(8)),
        _init("sqrt2", np.asarray(np.sqrt(2), dtype)),
        _init("one", np.asarray(1, dtype)),
        _init("half", np.asarray(0.5, dtype)),
    ]
    return _model(nodes, [_vi("x", (2, 8, 8, 8), elem)], [_vi("y", None, elem)], inits)


def test_optimized_conv_blocks():
    model = _conv_block_model()
    ops = run_optimized(model, _feeds_for(model))
    assert ops == ["tensorkiln.ConvAct"] * 4


def test_optimized_conv_blocks_float16():
    model = _conv_block_model(np.float16, TensorProto.FLOAT16)
    ops = run_optimized(model, _feeds_for(model))
    # float16's sqrt(2) is too far from sqrt(2) for the GELU match: that tail stays Pointwise
    assert ops.count("tensorkiln.ConvAct") == 4, ops


def _mlp_model(dtype=np.float32, elem=F32, seq: int = 6, hidden: int = 32):
    """Pre-LN transformer MLP: LayerNorm (decomposed) -> MatMul+bias -> GELU (tanh, GPT-2's
    spelling) -> MatMul+bias -> residual Add -> RMSNorm (decomposed); a Gemm with transB + Relu."""

    def w(*shape):
        return (_rand(*shape) * 0.2).astype(dtype)

    def c(v):
        return np.asarray(v, dtype)

    n = helper.make_node
    nodes = [
        n("ReduceMean", ["x"], ["mu"], axes=[-1]),
        n("Sub", ["x", "mu"], ["d"]),
        n("Pow", ["d", "two"], ["d2"]),
        n("ReduceMean", ["d2"], ["var"], axes=[-1]),
        n("Add", ["var", "eps"], ["ve"]),
        n("Sqrt", ["ve"], ["sd"]),
        n("Div", ["d", "sd"], ["xn"]),
        n("Mul", ["xn", "ln_w"], ["xs"]),
        n("Add", ["xs", "ln_b"], ["h"]),
        n("MatMul", ["h", "W1"], ["m1"]),
        n("Add", ["m1", "b1"], ["u"]),
        n("Mul", ["u", "half"], ["t0"]),
        n("Pow", ["u", "three"], ["t1"]),
        n("Mul", ["t1", "k"], ["t2"]),
        n("Add", ["u", "t2"], ["t3"]),
        n("Mul", ["t3", "sqrt2pi"], ["t4"]),
        n("Tanh", ["t4"], ["t5"]),
        n("Add", ["t5", "one"], ["t6"]),
        n("Mul", ["t0", "t6"], ["g"]),
        n("MatMul", ["g", "W2"], ["m2"]),
        n("Add", ["m2", "b2"], ["o"]),
        n("Add", ["o", "x"], ["r"]),
        n("Mul", ["r", "r"], ["r2"]),
        n("ReduceMean", ["r2"], ["ms"], axes=[-1]),
        n("Add", ["ms", "eps"], ["mse"]),
        n("Sqrt", ["mse"], ["rms"]),
        n("Div", ["r", "rms"], ["rn"]),
        n("Mul", ["rn", "rms_w"], ["y"]),
        n("Reshape", ["y", "flat"], ["y2"]),
        n("Gemm", ["y2", "W3", "b3"], ["z0"], transB=1, alpha=0.5),
        n("Relu", ["z0"], ["z"]),
    ]
    inits = [
        _init("two", c(2)),
        _init("eps", c(1e-5)),
        _init("ln_w", w(hidden)),
        _init("ln_b", w(hidden)),
        _init("W1", w(hidden, 4 * hidden)),
        _init("b1", w(4 * hidden)),
        _init("half", c(0.5)),
        _init("three", c(3)),
        _init("k", c(0.044715)),
        _init("sqrt2pi", c(np.sqrt(2 / np.pi))),
        _init("one", c(1)),
        _init("W2", w(4 * hidden, hidden)),
        _init("b2", w(hidden)),
        _init("rms_w", w(hidden)),
        _init("flat", np.asarray([-1, hidden], np.int64)),
        _init("W3", w(16, hidden)),
        _init("b3", w(16)),
    ]
    inputs = [_vi("x", (2, seq, hidden), elem)]
    return _model(nodes, inputs, [_vi("y", None, elem), _vi("z", None, elem)], inits)


def test_optimized_transformer_mlp():
    model = _mlp_model()
    ops = run_optimized(model, _feeds_for(model))
    for op in ("LayerNorm", "GemmAct", "RMSNorm"):
        assert f"tensorkiln.{op}" in ops, ops


def test_optimized_transformer_mlp_float16():
    model = _mlp_model(np.float16, TensorProto.FLOAT16)
    ops = run_optimized(model, _feeds_for(model))
    assert "tensorkiln.GemmAct" in ops, ops


def _attention_model(mask: str = "", causal: bool = False):
    """softmax(Q K^T / sqrt(D) [+ mask]) V on [B, H, S, D] inputs, as the exporters write it."""
    n = helper.make_node
    inputs = [_vi(name, (B, H, S, D)) for name in "qkv"]
    inits = [_init("sqrt_d", np.float32(np.sqrt(D))), _init("zero", np.float32(0))]
    nodes = [
        n("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2]),
        n("MatMul", ["q", "kt"], ["qk"]),
        n("Div", ["qk", "sqrt_d"], ["s"]),
    ]
    logits = "s"
    if causal:
        inits += [_init("tril", np.tri(S, dtype=bool)), _init("low", np.finfo(np.float32).min)]
        nodes.append(n("Where", ["tril", "s", "low"], ["sc"]))
        logits = "sc"
    if mask == "additive":
        inputs.append(_vi("mask", (B, 1, 1, S)))
        nodes.append(n("Add", [logits, "mask"], ["logits"]))
        logits = "logits"
    elif mask == "bool":
        inputs.append(_vi("keep", (B, 1, S, S), TensorProto.BOOL))
        inits.append(_init("ninf", np.float32(-np.inf)))
        nodes += [
            n("Where", ["keep", "zero", "ninf"], ["bias"]),
            n("Add", [logits, "bias"], ["logits"]),
        ]
        logits = "logits"
    nodes += [n("Softmax", [logits], ["p"], axis=-1), n("MatMul", ["p", "v"], ["o"])]
    return _model(nodes, inputs, [_vi("o", (B, H, S, D))], inits)


@pytest.mark.parametrize(("mask", "causal"), [("", False), ("additive", True), ("bool", False)])
def test_optimized_attention(mask, causal):
    model = _attention_model(mask, causal)
    ops = run_optimized(model, _feeds_for(model))
    assert ops == ["tensorkiln.Attention"], ops


def test_optimized_pointwise():
    """An elementwise chain the optimizer turns into one Pointwise node (the body runs on the
    cuda kernels of its ops: skipped while one is missing)."""
    n = helper.make_node
    nodes = [
        n("Mul", ["x", "a"], ["t1"]),
        n("Exp", ["t1"], ["t2"]),
        n("Add", ["t2", "y"], ["t3"]),
        n("Sqrt", ["t3"], ["t4"]),
        n("Sub", ["t4", "x"], ["t5"]),
        n("Abs", ["t5"], ["out"]),
    ]
    model = _model(
        nodes,
        [_vi("x", (3, 16)), _vi("y", (16,))],
        [_vi("out", (3, 16))],
        [_init("a", np.float32(0.5))],
    )
    feeds = {"x": _rand(3, 16), "y": np.abs(_rand(16)) + 1}
    ops = run_optimized(model, feeds)
    assert "tensorkiln.Pointwise" in ops, ops


def test_optimized_pointwise_of_scalars():
    """DynamicQuantizeLinear's scale arithmetic: 0-d values and 0-d body constants stay 0-d."""
    n = helper.make_node
    nodes = [
        n("Min", ["lo", "zero"], ["t1"]),
        n("Max", ["hi", "zero"], ["t2"]),
        n("Sub", ["t2", "t1"], ["t3"]),
        n("Div", ["t3", "q_max"], ["scale"]),
    ]
    inits = [_init("zero", np.float32(0)), _init("q_max", np.float32(255))]
    model = _model(nodes, [_vi("lo", ()), _vi("hi", ())], [_vi("scale", ())], inits)
    ops = run_optimized(model, {"lo": np.float32(-1.5), "hi": np.float32(2.5)})
    assert ops == ["tensorkiln.Pointwise"], ops


# ---------------------------------------------------------------------- exported real models


class _TinyResNet(torch.nn.Module):
    """Stem, two bottleneck-style blocks (BN folded by the exporter, residual adds, SiLU), head."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8), nn.ReLU())
        self.a = nn.Sequential(
            nn.Conv2d(8, 8, 3, 1, 1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 8, 1),
            nn.BatchNorm2d(8),
        )
        self.b = nn.Sequential(
            nn.Conv2d(8, 8, 3, 1, 1, groups=8), nn.BatchNorm2d(8), nn.SiLU(), nn.Conv2d(8, 8, 1)
        )
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.a(x) + x)
        x = self.b(x) + x
        return self.head(x.mean((2, 3)))


@functools.cache
def _exported(name: str, folder: str) -> tuple[Path, dict]:
    from tests.models import test_architectures as arch

    if name == "tiny_resnet":
        torch.manual_seed(0)
        model = _TinyResNet().eval()
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, torch.nn.BatchNorm2d):
                    m.running_mean.normal_(0, 0.1)
                    m.running_var.uniform_(0.5, 1.5)
        feeds = {"input": _rand(2, 3, 16, 16)}
    else:
        model, feeds = arch.BUILDERS[name](full=False)
    return arch.export(model, feeds, Path(folder) / name, dynamo=False), feeds


@pytest.mark.parametrize(
    ("name", "fused"),
    [
        ("tiny_resnet", ["ConvAct"]),
        ("transformer_encoder", ["Attention", "GemmAct"]),
        pytest.param("gpt2", ["Attention", "GemmAct"], marks=pytest.mark.slow),
    ],
)
def test_exported_model_on_the_cuda_backend(name, fused, tmp_path_factory):
    if name == "gpt2":
        pytest.importorskip("transformers")
    import onnx

    folder = tmp_path_factory.getbasetemp() / "fused-exports"
    path, feeds = _exported(name, str(folder))
    model = onnx.load(str(path))
    if name != "tiny_resnet" and has_kernel("LayerNormalization", backend="cuda"):
        fused = [*fused, "LayerNorm"]  # (without it, the importer expands LayerNormalization)
    ops = run_optimized(copy.deepcopy(model), feeds)
    for op in fused:
        assert f"tensorkiln.{op}" in ops, ops

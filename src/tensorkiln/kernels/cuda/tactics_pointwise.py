"""Triton tactics of the memory-bound layers: fused Pointwise bodies, LayerNorm/RMSNorm, Softmax.

Each is an alternative to the op's default cuda kernel; the autotuner times it where ``supports``
accepts the layer. Nothing registers when Triton cannot be imported. The kernels run on CUDA
tensors, or on CPU tensors through Triton's interpreter (``TRITON_INTERPRET=1``, in tests).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tensorkiln.kernels.common.pool import pool_geometry
from tensorkiln.kernels.tactics import LayerSpec, tactic
from tensorkiln.kernels.triton import available, interpreting
from tensorkiln.kernels.triton.pointwise import can_generate

NORM_DTYPES = frozenset(["float16", "bfloat16", "float32"])
_POOL_DTYPES = NORM_DTYPES | {"int8", "float8_e4m3fn"}


def _runs_here(spec: LayerSpec) -> bool:
    return spec.device == "cuda" or interpreting()


def _last_axis(axis: int, rank: int) -> bool:
    return rank >= 1 and -rank <= axis < rank and axis % rank == rank - 1


def _per_column(shape: tuple[int, ...] | None, n: int) -> bool:
    """Whether a scale/bias of ``shape`` holds one value per column of rows of ``n``."""
    return (
        shape is not None and len(shape) >= 1 and shape[-1] == n and all(d == 1 for d in shape[:-1])
    )


def _norm_fits(spec: LayerSpec, n_params: int = 1) -> bool:
    """x of a float dtype normalized over its last axis, with ``n_params`` per-column inputs
    (scale, then an optional bias) after it."""
    if not _runs_here(spec) or spec.dtypes[0] not in NORM_DTYPES or spec.shapes[0] is None:
        return False
    shape = spec.shapes[0]
    if not _last_axis(int(spec.attrs.get("axis", -1)), len(shape)):
        return False
    params = list(spec.shapes[1 : 1 + n_params])
    if not params or params[0] is None:
        return False
    return all(s is None or _per_column(s, shape[-1]) for s in params)


def _layer_norm_fits(spec: LayerSpec) -> bool:
    if not _norm_fits(spec, 2):
        return False
    if len(spec.shapes) > 3 and spec.shapes[3] is not None:  # residual: same dtype, and
        x, r = spec.shapes[0], spec.shapes[3]  # broadcast against x (run shapes may differ)
        try:
            np.broadcast_shapes(x, r)
        except ValueError:
            return False
        return spec.dtypes[3] == spec.dtypes[0] and len(r) > 0 and r[-1] == x[-1]
    return True


def _quantized_layer_norm_fits(rows: int) -> Callable[[LayerSpec], bool]:
    """A LayerNorm that also writes its output quantized, ``rows`` of whose rows (their length
    rounded up to a power of two) hold at most 4,096 values: a block a program, as the default
    tiles hold about 2,048."""

    def fits(spec: LayerSpec) -> bool:
        x = spec.shapes[0]
        if not spec.attrs.get("q_dtype") or not _layer_norm_fits(spec) or not x or x[-1] < 1:
            return False
        return rows * (1 << (int(x[-1]) - 1).bit_length()) <= 4096

    return fits


def _onnx_layer_norm_fits(spec: LayerSpec) -> bool:
    return int(spec.attrs.get("stash_type", 1)) == 1 and _norm_fits(spec, 2)


def _softmax_fits(spec: LayerSpec) -> bool:
    """The last axis, named: below opset 13 a missing axis means 1 (a flattening), not -1."""
    if not _runs_here(spec) or spec.dtypes[0] not in NORM_DTYPES or spec.shapes[0] is None:
        return False
    rank = len(spec.shapes[0])
    if "axis" not in spec.attrs:
        return rank in (1, 2)
    return _last_axis(int(spec.attrs["axis"]), rank)


def _pointwise_fits(spec: LayerSpec) -> bool:
    body = spec.attrs.get("body")
    return _runs_here(spec) and body is not None and can_generate(body)


def _max_pool_fits(spec: LayerSpec) -> bool:
    """A 2-D max pool of a float, int8 or E4M3 tensor whose windows the geometry accepts."""
    x = spec.shapes[0]
    if not _runs_here(spec) or spec.dtypes[0] not in _POOL_DTYPES or x is None or len(x) != 4:
        return False
    a = spec.attrs
    try:
        pool_geometry(
            x, "MaxPool", a.get("kernel_shape"), a.get("strides"), a.get("dilations"),
            a.get("pads"), a.get("auto_pad", "NOTSET"), a.get("ceil_mode", 0),
        )  # fmt: skip
    except ValueError:
        return False
    return True


if available():
    import torch
    from onnx.helper import tensor_dtype_to_np_dtype

    from tensorkiln.kernels.common.norm import quant_scale
    from tensorkiln.kernels.cuda.convert import torch_dtype
    from tensorkiln.kernels.cuda.pool import max_pool
    from tensorkiln.kernels.triton import norm, pointwise, softmax
    from tensorkiln.kernels.triton import pool as triton_pool

    @tactic("Pointwise", domain="tensorkiln", name="triton", supports=_pointwise_fits)
    def pointwise_triton(*inputs, body):
        """The body as one generated Triton kernel."""
        outs = pointwise.run(body, inputs)
        return outs[0] if len(outs) == 1 else outs

    @tactic("LayerNorm", domain="tensorkiln", name="triton", supports=_layer_norm_fits)
    def layer_norm_triton(
        x, scale, bias=None, residual=None, y_scale=None, *, axis: int = -1,
        epsilon: float = 1e-5, q_dtype: int = 0, _n_outputs: int = 1,
    ):  # fmt: skip
        """LayerNorm of ``x + residual`` over the last axis; second output the sum. With
        ``q_dtype``: second output the normalized values quantized to ``y_scale`` in the same
        kernel, third the sum."""
        return _layer_norm(x, scale, bias, residual, y_scale, epsilon, q_dtype, _n_outputs)

    # The quantizing LayerNorm at two more tiles (rows a program, warps), the same arithmetic:
    # it computes far more a value than the plain one (the quantization), and on an H200 the
    # best tile for it moved with each change of that arithmetic (benchmarks/norm_quant.py, on
    # 8192 x 768 values: 0.0085 to 0.0145 ms by tile for one form, 0.0151 to 0.0314 for another).
    def _tiled_layer_norm(rows: int, warps: int):
        def tiled(
            x, scale, bias=None, residual=None, y_scale=None, *, axis: int = -1,
            epsilon: float = 1e-5, q_dtype: int = 0, _n_outputs: int = 1,
        ):  # fmt: skip
            return _layer_norm(x, scale, bias, residual, y_scale, epsilon, q_dtype, _n_outputs,
                               (rows, warps))  # fmt: skip

        tiled.__doc__ = f"The quantizing LayerNorm, {rows} rows a program, {warps} warps."
        return tiled

    for rows, warps in ((1, 4), (4, 4)):
        fits = _quantized_layer_norm_fits(rows)
        tactic("LayerNorm", domain="tensorkiln", name=f"triton_r{rows}w{warps}", supports=fits)(
            _tiled_layer_norm(rows, warps)
        )

    def _layer_norm(x, scale, bias, residual, y_scale, epsilon, q_dtype, _n_outputs, tile=None):
        sums = _n_outputs == (3 if q_dtype else 2)
        quantized = None
        if q_dtype and _n_outputs > 1:
            y_scale = quant_scale(y_scale, q_dtype)
            target = torch_dtype(tensor_dtype_to_np_dtype(int(q_dtype)))
            shape = x.shape if residual is None else torch.broadcast_shapes(x.shape, residual.shape)
            quantized = (torch.empty(shape, dtype=target, device=x.device), y_scale)
        y, s, _, _ = norm.normalize(
            x, scale, bias, residual, eps=epsilon, want_sum=sums and residual is not None,
            quantized=quantized, tile=tile,
        )  # fmt: skip
        if _n_outputs == 1:
            return y
        s = x if residual is None else s
        if quantized is None:
            return y, s
        return (y, quantized[0], s) if sums else (y, quantized[0])

    @tactic("RMSNorm", domain="tensorkiln", name="triton", supports=_norm_fits)
    def rms_norm_triton(x, scale, *, axis: int = -1, epsilon: float = 1e-5):
        """``x / sqrt(mean(x^2) + epsilon) * scale`` over the last axis."""
        return norm.normalize(x, scale, eps=epsilon, rms=True)[0]

    @tactic("LayerNormalization", name="triton", supports=_onnx_layer_norm_fits)
    def layer_normalization_triton(
        x, scale, bias=None, *, axis: int = -1, epsilon: float = 1e-5, stash_type: int = 1,
        _n_outputs: int = 1,
    ):  # fmt: skip
        """ONNX LayerNormalization over the last axis; Mean and InvStdDev in float32."""
        want = _n_outputs > 1
        y, _, mean, inv = norm.normalize(x, scale, bias, eps=epsilon, want_stats=want)
        if not want:
            return y
        keep = (*x.shape[:-1], 1)
        return (y, mean.reshape(keep), inv.reshape(keep))[:_n_outputs]

    @tactic("Softmax", name="triton", supports=_softmax_fits)
    def softmax_triton(x, *, axis: int = -1):
        """Softmax over the last axis."""
        return softmax.softmax_last(x)

    @tactic("LogSoftmax", name="triton", supports=_softmax_fits)
    def log_softmax_triton(x, *, axis: int = -1):
        """LogSoftmax over the last axis."""
        return softmax.softmax_last(x, log=True)

    def _max_pool_triton(block_p: int, warps: int) -> Callable:
        def max_pool_triton(
            x, *, auto_pad: str = "NOTSET", ceil_mode: int = 0, dilations=None,
            kernel_shape=None, pads=None, storage_order: int = 0, strides=None,
            _n_outputs: int = 1,
        ):  # fmt: skip
            """2-D max pooling in one pass over channels-last input, ``block_p`` output
            positions a program (the indices output, or a layout the kernel does not take, go
            to the default kernel)."""
            g = pool_geometry(
                x.shape, "MaxPool", kernel_shape, strides, dilations, pads, auto_pad, ceil_mode
            )
            if _n_outputs == 1 and triton_pool.applies(x, g):
                return triton_pool.max_pool2d(x, g, block_p=block_p, warps=warps)
            return max_pool(
                x, auto_pad=auto_pad, ceil_mode=ceil_mode, dilations=dilations,
                kernel_shape=kernel_shape, pads=pads, storage_order=storage_order,
                strides=strides, _n_outputs=_n_outputs,
            )  # fmt: skip

        return max_pool_triton

    # (32 positions a program, and 128 for large pools: an 8-bit engine's stem pool reads 205 MB)
    for _name, _block_p, _warps in (("triton", 32, 4), ("triton_p128", 128, 8)):
        tactic("MaxPool", name=_name, supports=_max_pool_fits)(_max_pool_triton(_block_p, _warps))

"""Triton tactics of the GEMMs and convolutions, one per tile config.

tensorkiln.GemmAct, Gemm and MatMul get ``triton_gemm_<config>`` (see
:data:`tensorkiln.kernels.triton.gemm.CONFIGS`); tensorkiln.ConvAct and Conv get
``triton_conv_<config>`` (:data:`tensorkiln.kernels.triton.conv.CONFIGS`). A tactic applies where
its kernel computes exactly the op: float32/float16/bfloat16 operands of one dtype, the ranks,
groups and attributes the kernel takes, 32-bit offsets, tiles that fit the shared memory and are
not much larger than the problem; and CUDA tensors, or any tensors with Triton's interpreter on.
Nothing registers when Triton is not installed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from typing import Any

from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import conv as common_conv
from tensorkiln.kernels.common import gemm as common_gemm
from tensorkiln.kernels.common.conv import conv_geometry
from tensorkiln.kernels.cuda.fused_conv import TorchConvArrays
from tensorkiln.kernels.cuda.fused_gemm import TorchGemmArrays
from tensorkiln.kernels.tactics import LayerSpec, tactic
from tensorkiln.kernels.triton import available, interpreting

if available():
    from tensorkiln.kernels.triton import conv, gemm

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
_ACT_ATTRS = {
    "activation",
    "activation_alpha",
    "activation_beta",
    "activation_min",
    "activation_max",
}
_GEMM_ATTRS = {"alpha", "beta", "transA", "transB"}
_CONV_ATTRS = {"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"}
_MAX_ELEMENTS = 2**31 - 1
_MAX_BATCH = 65535

Shape = tuple[int, ...]


# -------------------------------------------------------------------------------------- checks


def _device_ok(spec: LayerSpec) -> bool:
    return spec.device == "cuda" or interpreting()


def _input(spec: LayerSpec, i: int) -> tuple[Shape | None, str | None]:
    if i >= len(spec.shapes):
        return None, None
    return spec.shapes[i], spec.dtypes[i] if i < len(spec.dtypes) else None


def _floats(spec: LayerSpec, n: int) -> str | None:
    """The common float dtype of the first ``n`` inputs (all present, shapes known), or None."""
    dtypes = {_input(spec, i)[1] for i in range(n)}
    shapes = [_input(spec, i)[0] for i in range(n)]
    if len(dtypes) != 1 or any(s is None for s in shapes):
        return None
    dt = dtypes.pop()
    return dt if dt in _ITEMSIZE else None


def _optional_ok(spec: LayerSpec, i: int) -> bool:
    """An optional input is absent or a float tensor of known shape."""
    shape, dt = _input(spec, i)
    return (shape is None and dt is None) or (shape is not None and dt in _ITEMSIZE)


def _small(*shapes: Shape) -> bool:
    return all(math.prod(s) <= _MAX_ELEMENTS for s in shapes)


def _fits(block: int, size: int) -> bool:
    """A tile side worth trying for a problem side: not far below 64 nor above the problem."""
    p = 1 << max(size - 1, 0).bit_length()
    return min(64, p) // 2 <= block <= max(64, p)


def tile_fits(cfg: gemm.TileConfig, m: int, n: int, itemsize: int) -> bool:
    """A tiling worth trying for an M x N output of ``itemsize``-byte operands: its pipelined
    tiles fit the shared memory, its sides fit the problem's (:func:`_fits`)."""
    if cfg.smem_bytes(itemsize) > gemm.SMEM_LIMIT:
        return False
    return _fits(cfg.block_m, m) and _fits(cfg.block_n, n)


def _tile_ok(cfg: gemm.TileConfig, m: int, n: int, dtype: str) -> bool:
    return tile_fits(cfg, m, n, _ITEMSIZE[dtype])


def _activation_ok(attrs: dict) -> bool:
    return attrs.get("activation", "") in gemm.ACT_CODES


# ------------------------------------------------------------------------------------- GEMMs


def gemm_dims(spec: LayerSpec) -> tuple[int, int, int] | None:
    """(M, N, K) of a GemmAct/Gemm, or None when the kernel does not take its shapes."""
    a, b = spec.shapes[0], spec.shapes[1]
    ta, tb = spec.attrs.get("transA", 0), spec.attrs.get("transB", 0)
    if len(b) != 2 or len(a) < 2 or (len(a) > 2 and ta):
        return None
    m, k = (a[1], a[0]) if ta else (math.prod(a[:-1]), a[-1])
    kb, n = (b[1], b[0]) if tb else b
    return (m, n, k) if k == kb else None


def _bias_ok(spec: LayerSpec, m: int, n: int) -> bool:
    """C broadcasts as GemmAct takes it: to (M, N) for a 2-D A, along the last axis otherwise."""
    c = spec.shapes[2] if len(spec.shapes) > 2 else None
    if c is None or spec.attrs.get("beta", 1.0) == 0.0:
        return True
    if len(spec.shapes[0]) > 2:
        size = math.prod(c)
        return size in (1, n) and (not c or c[-1] == size)
    return len(c) <= 2 and all(d in (1, t) for d, t in zip(reversed(c), (n, m)))


def _gemm_supported(cfg: gemm.TileConfig, fused: bool, spec: LayerSpec) -> bool:
    """GemmAct (``fused``) or Gemm, whose A is 2-D."""
    dt = _floats(spec, 2)
    attrs = _GEMM_ATTRS | (_ACT_ATTRS if fused else {"broadcast"})
    if dt is None or not _device_ok(spec) or not set(spec.attrs) <= attrs:
        return False
    if not fused and len(spec.shapes[0]) != 2:
        return False
    if not _optional_ok(spec, 2) or not _activation_ok(spec.attrs):
        return False
    dims = gemm_dims(spec)
    if dims is None or not _bias_ok(spec, dims[0], dims[1]):
        return False
    m, n, _ = dims
    return _small(*spec.shapes[:2], (m, n)) and _tile_ok(cfg, m, n, dt)


def _matmul_dims(a: Shape, b: Shape) -> tuple[int, int, int] | None:
    """(batch, M, N) of a MatMul as :func:`gemm.matmul` runs it, or None."""
    if len(a) < 2 or len(b) < 2 or a[-1] != b[-2]:
        return None
    if all(d == 1 for d in b[:-2]) and len(b) <= len(a):
        return 1, math.prod(a[:-1]), b[-1]  # A's batch folds into the rows
    batch = gemm.batch_shape(a, b)
    if batch is None:
        return None
    return math.prod(batch), a[-2], b[-1]


def _matmul_supported(cfg: gemm.TileConfig, spec: LayerSpec) -> bool:
    dt = _floats(spec, 2)
    if dt is None or not _device_ok(spec) or len(spec.shapes) != 2:
        return False
    a, b = spec.shapes
    dims = _matmul_dims(a, b)
    if dims is None or not 1 <= dims[0] <= _MAX_BATCH:
        return False
    nb, m, n = dims
    operands = ((nb, m, a[-1]), (nb, b[-2], n), (nb, m, n))
    return _small(*operands) and _tile_ok(cfg, m, n, dt)


class _TritonGemmArrays(TorchGemmArrays):
    """The torch arrays of Gemm and GemmAct with the float product on the Triton GEMM of one
    tile configuration (integers, which no tactic takes, stay torch's)."""

    def __init__(self, cfg: gemm.TileConfig) -> None:
        self.cfg = cfg

    def affine(
        self, a: Any, b: Any, bias: Any, alpha: float, beta: float, act: tuple, dtype: Any
    ) -> Any:
        return gemm.gemm_2d(a, b, bias, alpha, beta, gemm.Epilogue.of(*act), self.cfg)


def _gemm_act_fn(cfg: gemm.TileConfig) -> Callable:
    return bind(common_gemm.gemm_act, _TritonGemmArrays(cfg), __name__)


def _gemm_fn(cfg: gemm.TileConfig) -> Callable:
    return bind(common_gemm.gemm, _TritonGemmArrays(cfg), __name__)


def _matmul_fn(cfg: gemm.TileConfig) -> Callable:
    def matmul(a, b):
        return gemm.matmul(a, b, config=cfg)

    return matmul


# -------------------------------------------------------------------------------- convolutions


def _conv_out(spec: LayerSpec) -> Shape | None:
    """The output shape of a 1-D/2-D Conv/ConvAct the kernel takes, or None."""
    x, w = spec.shapes[0], spec.shapes[1]
    group = spec.attrs.get("group", 1)
    if len(x) not in (3, 4) or len(w) != len(x) or group < 1:
        return None
    if x[1] != w[1] * group or w[0] % group:
        return None
    if group > 1 and (w[1] < 16 or w[0] // group < 16):
        return None  # thin groups (depthwise) leave the tensor cores idle
    at = spec.attrs
    try:
        geom = conv_geometry(
            x, w, at.get("auto_pad", "NOTSET"), at.get("dilations"), at.get("kernel_shape"),
            at.get("pads"), at.get("strides"),
        )  # fmt: skip
    except ValueError:
        return None
    return (x[0], w[0], *geom.out)


def _conv_supported(cfg: gemm.TileConfig, fused: bool, spec: LayerSpec) -> bool:
    dt = _floats(spec, 2)
    attrs = _CONV_ATTRS | (_ACT_ATTRS | {"residual_order"} if fused else set())
    if dt is None or not _device_ok(spec) or not set(spec.attrs) <= attrs:
        return False
    if not _activation_ok(spec.attrs):
        return False
    if spec.attrs.get("residual_order", "add_act") not in ("add_act", "act_add"):
        return False
    out = _conv_out(spec)
    if out is None or not all(_optional_ok(spec, i) for i in (2, 3)):
        return False
    b, z = _input(spec, 2)[0], _input(spec, 3)[0]
    if (b is not None and math.prod(b) != out[1]) or (z is not None and tuple(z) != out):
        return False
    group = spec.attrs.get("group", 1)
    m = out[0] * math.prod(out[2:])
    return _small(*spec.shapes[:2], out) and _tile_ok(cfg, m, out[1] // group, dt)


class _TritonConvArrays(TorchConvArrays):
    """The torch arrays of Conv and ConvAct with the convolution on the Triton implicit GEMM of
    one tile configuration."""

    def __init__(self, cfg: gemm.TileConfig) -> None:
        self.cfg = cfg

    def conv(self, x: Any, w: Any, b: Any, g: Any, group: int) -> Any:
        return conv.conv_act(x, w, b, geom=g, group=group, config=self.cfg)

    def conv_act(
        self, x: Any, w: Any, b: Any, z: Any, g: Any, group: int, act: tuple, after: bool
    ) -> Any:
        epilogue = gemm.Epilogue.of(*act)
        return conv.conv_act(
            x, w, b, z, geom=g, group=group, epilogue=epilogue, residual_after=after,
            config=self.cfg,
        )  # fmt: skip


def _conv_act_fn(cfg: gemm.TileConfig) -> Callable:
    return bind(common_conv.conv_act, _TritonConvArrays(cfg), __name__)


def _conv_fn(cfg: gemm.TileConfig) -> Callable:
    return bind(common_conv.conv, _TritonConvArrays(cfg), __name__)


# ------------------------------------------------------------------------------------ estimates


def sm_count() -> int:
    """The GPU's multiprocessors (an H100/H200's 132 where there is none, for tests)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.get_device_properties(0).multi_processor_count
    return 132  # an H100/H200


def tile_coverage(cfg: gemm.TileConfig, m: int, n: int, sms: int) -> float:
    """How well ``cfg`` covers an M x N output on ``sms`` multiprocessors: the share of tile area
    doing useful work times the share of the last wave of tiles that is busy."""
    tiles = math.ceil(m / cfg.block_m) * math.ceil(n / cfg.block_n)
    useful = (m * n) / (tiles * cfg.block_m * cfg.block_n)
    waves = math.ceil(tiles / sms)
    return useful * tiles / (waves * sms)


def _tile_score(cfg: gemm.TileConfig, m: int, n: int, sms: int) -> float:
    """:func:`tile_coverage`, favouring larger tiles (more reuse of each loaded operand) among
    equals."""
    return tile_coverage(cfg, m, n, sms) + 1e-7 * cfg.block_m * cfg.block_n


def _gemm_estimate(cfg: gemm.TileConfig, spec: LayerSpec) -> float:
    dims = gemm_dims(spec)
    return 0.0 if dims is None else _tile_score(cfg, dims[0], dims[1], sm_count())


def _matmul_estimate(cfg: gemm.TileConfig, spec: LayerSpec) -> float:
    dims = _matmul_dims(*spec.shapes[:2]) if len(spec.shapes) == 2 else None
    if dims is None:
        return 0.0
    nb, m, n = dims
    return _tile_score(cfg, nb * m, n, sm_count())  # the batch runs as more tiles


# --------------------------------------------------------------------------------- registration


def _register() -> None:
    for cfg in gemm.CONFIGS:
        name = f"triton_gemm_{cfg.name}"
        fused = partial(_gemm_supported, cfg, True)
        plain = partial(_gemm_supported, cfg, False)
        score = partial(_gemm_estimate, cfg)
        tactic("GemmAct", domain="tensorkiln", name=name, supports=fused, estimate=score)(
            _gemm_act_fn(cfg)
        )
        tactic("Gemm", name=name, supports=plain, estimate=score)(_gemm_fn(cfg))
        tactic(
            "MatMul",
            name=name,
            supports=partial(_matmul_supported, cfg),
            estimate=partial(_matmul_estimate, cfg),
        )(_matmul_fn(cfg))
    for cfg in conv.CONFIGS:
        name = f"triton_conv_{cfg.name}"
        fused = partial(_conv_supported, cfg, True)
        tactic("ConvAct", domain="tensorkiln", name=name, supports=fused)(_conv_act_fn(cfg))
        tactic("Conv", name=name, supports=partial(_conv_supported, cfg, False))(_conv_fn(cfg))


if available():
    _register()

"""The cpu backend's native kernels: native.c compiled at first use, called through ctypes.

At batch 1 a mobile network's convolutions are tens of microseconds each, and oneDNN's call costs
about 40 us whatever the size (RESULTS.md): a depthwise 3x3 of 16x112x112 takes 50 us through
oneDNN and 24 us here. This module builds native.c with the system C compiler (``$CC``, else
``cc``, ``gcc`` or ``clang``; -O3 -march=native, OpenMP where the compiler has it) into a shared
library cached per user, and wraps its kernels as functions of one layer and input shape
(:func:`depthwise`, :func:`pointwise`, :func:`im2col_conv`) that the cpu backend's ConvAct times
against its oneDNN and GEMM paths, keeping the faster (fused_conv._specialize_conv_act).

Nothing here is required: without a compiler, with TENSORKILN_CPU_NATIVE=0 (``always``: use
them wherever they apply, untimed, for tests and comparisons), or when building or
loading fails (said once in the ``tensorkiln`` logger), :func:`library` is None and the cpu backend
runs as before. The cache (``$TENSORKILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/tensorkiln``, else
``~/.cache/tensorkiln``) holds only libraries built here from this source: the file name is the
SHA-256 of the source, compiler, flags and CPU, the folder must belong to the user and not be
writable by others, and a library is written under a temporary name and renamed into place.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tensorkiln.kernels.common.build import cached_library, find_program, run
from tensorkiln.kernels.common.window import Geometry

ENV = "TENSORKILN_CPU_NATIVE"
_SOURCE = Path(__file__).with_name("native.c")
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11"]
_LOG = logging.getLogger("tensorkiln")
_LOCK = threading.Lock()
# layers with more multiply-adds (batch x output positions x weight elements) are left to oneDNN
# (timing both there would cost more than it could find: the native kernels win on small layers
# and on depthwise, SE and small-K 1x1 convolutions at batch 16, up to a few 100M)
_MAX_MACS = 2_000_000_000
# seconds a layer's choice may spend timing its candidates beyond the first rounds
_TIMING_S = 0.05

# ConvAct activations the kernels apply: name -> (code, defaults of (a0, a1))
_ACT = {
    "": (0, (0.0, 0.0)),
    "Relu": (1, (0.0, 0.0)),
    "Clip": (2, (float("-inf"), float("inf"))),
    "HardSwish": (3, (0.0, 0.0)),
    "HardSigmoid": (4, (0.20000000298023224, 0.5)),
    "Sigmoid": (5, (0.0, 0.0)),
    "Swish": (6, (0.0, 0.0)),
    "LeakyRelu": (7, (0.009999999776482582, 0.0)),
}

_P = ctypes.c_void_p
_SIGNATURES = {
    "tk_vector_floats": ([], ctypes.c_int),
    "tk_panel_floats": ([], ctypes.c_int),
    "tk_conv_max_k": ([], ctypes.c_long),
    "tk_set_parallel_min": ([ctypes.c_long], None),
    # (fixed int64 arguments, fixed float arguments, x, y, residual or scratch)
    "tk_gemm_rows_p": ([_P] * 5, None),
    "tk_conv_gemm_p": ([_P] * 5, None),
    "tk_dwconv_p": ([_P] * 5, None),
    "tk_se_p": ([_P] * 5, None),
    "tk_to_channels_last": ([_P, ctypes.c_long, ctypes.c_long, ctypes.c_long, _P], None),
    "tk_spatial_mean": ([_P, ctypes.c_long, ctypes.c_long, ctypes.c_long, _P], None),
}


def _fixed(ints: tuple, floats: tuple) -> tuple[int, int, tuple]:
    """A layer's fixed arguments as the addresses of an int64 and a float array (and the
    arrays, which the caller keeps alive): one ctypes argument each instead of one per value."""
    ia = (ctypes.c_int64 * len(ints))(*(int(v) for v in ints))
    fa = (ctypes.c_float * len(floats))(*(float(v) for v in floats))
    return ctypes.addressof(ia), ctypes.addressof(fa), (ia, fa)


class Native:
    """The loaded library: its functions with their ctypes signatures, and its panel width."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.lib = lib
        self.panel = int(lib.tk_panel_floats())
        self.vector = int(lib.tk_vector_floats())
        if os.environ.get("TENSORKILN_CPU_PARALLEL_MIN", "").isdigit():  # (for tuning)
            lib.tk_set_parallel_min(int(os.environ["TENSORKILN_CPU_PARALLEL_MIN"]))
        self.max_k = int(lib.tk_conv_max_k())


def enabled() -> bool:
    """Whether native kernels may run: TENSORKILN_CPU_NATIVE unset or anything but 0/off."""
    return os.environ.get(ENV, "").strip().lower() not in ("0", "false", "no", "off")


def always() -> bool:
    """TENSORKILN_CPU_NATIVE=always: the native kernel wherever it applies, without timing it
    against the other paths (for tests and comparisons)."""
    return os.environ.get(ENV, "").strip().lower() == "always"


def library() -> Native | None:
    """The native kernels, built at the first call of the process (None where unavailable)."""
    if not enabled():
        return None
    return _load()


@functools.cache
def _load() -> Native | None:
    with _LOCK:
        try:
            return Native(ctypes.CDLL(str(_build())))
        except (OSError, RuntimeError, subprocess.SubprocessError, AttributeError) as exc:
            _LOG.info("tensorkiln: native CPU kernels unavailable (%s); using oneDNN", exc)
            return None


def _compiler() -> str:
    cc = find_program("CC", ("cc", "gcc", "clang"))
    if cc is None:
        raise RuntimeError("no C compiler found (set CC)")
    return cc


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's flags (a library built on another CPU of a
    shared home folder must not be loaded here)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features", "model name")):
                    return line.strip()
    except OSError:
        pass
    return platform.processor()


def _build() -> Path:
    cc = _compiler()
    key = (cc, run([cc, "--version"]).stdout, " ".join(_FLAGS), platform.machine() + _cpu_id())
    commands = [  # (OpenMP where the compiler has it)
        [cc, *_FLAGS, *extra, "-o", "{out}", "{src}"] for extra in (["-fopenmp"], [])
    ]
    return cached_library("cpu_native", _SOURCE, (k.encode() for k in key), commands)


# ------------------------------------------------------------------- layer functions


def activation(
    name: str, alpha: float | None, beta: float | None, lo: float | None, hi: float | None
) -> tuple[int, float, float] | None:
    """The kernels' (code, a0, a1) for a ConvAct activation; None where they have none."""
    if name not in _ACT or (name == "Swish" and alpha not in (None, 1.0)):
        return None
    code, (d0, d1) = _ACT[name]
    if name == "Clip":
        return code, d0 if lo is None else lo, d1 if hi is None else hi
    if name in ("HardSigmoid", "LeakyRelu"):
        return code, d0 if alpha is None else alpha, d1 if beta is None else beta
    return code, d0, d1


def _applies(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> bool:
    """float32 CPU tensors (the callers check the ranks)."""
    return (
        x.device.type == "cpu"
        and x.dtype == torch.float32
        and w.dtype == torch.float32
        and (b is None or b.dtype == torch.float32)
    )


def _cl(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous(memory_format=torch.channels_last)


def _panels(w2: torch.Tensor, nr: int) -> torch.Tensor:
    """A (K, N) weight as ceil(N / nr) panels of (K, nr), zero padded."""
    k, n = w2.shape
    count = -(-n // nr)
    packed = torch.zeros(count, nr, k, dtype=torch.float32)
    packed.view(count * nr, k)[:n] = w2.t()
    return packed.transpose(1, 2).contiguous()


def _padded_bias(b: torch.Tensor | None, n: int, nr: int) -> torch.Tensor:
    out = torch.zeros(-(-n // nr) * nr, dtype=torch.float32)
    if b is not None:
        out[:n] = b.reshape(-1)
    return out


Layer = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


def _residual(z: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if z is None:
        return None
    if tuple(z.shape) != shape or z.dtype != torch.float32 or z.device.type != "cpu":
        raise ValueError(f"ConvAct: residual Z of shape {tuple(z.shape)} must be {shape}")
    return _cl(z)


@dataclass(frozen=True)
class _Conv:
    """A convolution layer's arguments, as the kernel choosers below take them."""

    native: Native
    x: torch.Tensor
    w: torch.Tensor
    b: torch.Tensor | None
    g: Geometry
    group: int
    act: tuple[int, float, float]
    order: int

    def fields(self) -> tuple:
        return (self.native, self.x, self.w, self.b, self.g, self.group, self.act, self.order)


def _runner(fn: Any, ints: tuple, floats: tuple, shape: tuple, keep: tuple) -> Layer:
    """``(x, z) -> y`` calling convolution kernel ``fn`` with these fixed arguments."""
    ip, fp, arrays = _fixed(ints, floats)
    cl, f32 = torch.channels_last, torch.float32

    def run(x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        # (inlined: this runs once per layer per inference, where a function call is a visible
        # part of a small layer's time)
        x = x.contiguous(memory_format=cl)
        y = torch.empty(shape, dtype=f32, memory_format=cl)
        if z is None:
            fn(ip, fp, x.data_ptr(), y.data_ptr(), None)
        else:
            r = _residual(z, shape)  # (held while the kernel reads it: it may be a fresh copy)
            fn(ip, fp, x.data_ptr(), y.data_ptr(), r.data_ptr())
        return y

    run.keep = (keep, arrays)  # type: ignore[attr-defined]
    return run


def depthwise(conv: _Conv) -> Layer | None:
    """``(x, z) -> y`` for a depthwise 2-D convolution (one channel per group) at ``x``'s
    shape, or None where the kernel does not apply."""
    native, x, w, b, g, group, act, order = conv.fields()
    n, c, h, wd = x.shape
    if not _applies(x, w, b) or group != c or tuple(w.shape[:2]) != (c, 1) or len(g.out) != 2:
        return None
    kh, kw = w.shape[2:]
    taps = w.detach().reshape(c, kh * kw).t().contiguous()  # (kh*kw, C)
    bias = _padded_bias(b, c, 1)
    code, a0, a1 = act
    ints = (n, h, wd, c, taps.data_ptr(), bias.data_ptr(), kh, kw, *g.strides, *g.begin[:2])
    ints += (*g.dilations, *g.out, order, code)
    return _runner(native.lib.tk_dwconv_p, ints, (a0, a1), (n, c, *g.out), (taps, bias))


def pointwise(conv: _Conv) -> Layer | None:
    """``(x, z) -> y`` for a 1x1 convolution of one group, stride 1, no padding (a GEMM over
    the channels-last rows), or None where the kernel does not apply."""
    native, x, w, b, g, group, act, order = conv.fields()
    n, c, h, wd = x.shape
    if not _applies(x, w, b) or group != 1 or tuple(w.shape[2:]) != (1, 1):
        return None
    if g.padded or g.strides != (1, 1) or g.dilations != (1, 1):
        return None
    m = w.shape[0]
    packed = _panels(w.detach().reshape(m, c).t(), native.panel)
    bias = _padded_bias(b, m, native.panel)
    rows = n * h * wd
    code, a0, a1 = act
    ints = (rows, c, packed.data_ptr(), bias.data_ptr(), m, order, code)
    return _runner(native.lib.tk_gemm_rows_p, ints, (a0, a1), (n, m, h, wd), (packed, bias))


def im2col_conv(conv: _Conv) -> Layer | None:
    """``(x, z) -> y`` for a 2-D convolution of one group whose patches (kh*kw*C values) are
    at most the kernel's limit (the stem of a mobile network: 3x3 over 3 channels), or None."""
    native, x, w, b, g, group, act, order = conv.fields()
    n, c, h, wd = x.shape
    if not _applies(x, w, b) or group != 1 or w.shape[1] != c or len(g.out) != 2:
        return None
    m, _, kh, kw = w.shape
    if kh * kw * c > native.max_k:
        return None
    w2 = w.detach().permute(2, 3, 1, 0).reshape(kh * kw * c, m)  # rows in (i, j, c) order
    packed = _panels(w2, native.panel)
    bias = _padded_bias(b, m, native.panel)
    code, a0, a1 = act
    ints = (n, h, wd, c, packed.data_ptr(), bias.data_ptr(), m, kh, kw, *g.strides, *g.begin[:2])
    ints += (*g.dilations, *g.out, order, code)
    fn = native.lib.tk_conv_gemm_p
    return _runner(fn, ints, (a0, a1), (n, m, *g.out), (packed, bias))


def layer(
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: Geometry,
    group: int,
    act: tuple[int, float, float] | None,
    order: int,
) -> Layer | None:
    """The native function for this convolution at ``x``'s shape, or None (no library, an
    activation or geometry the kernels lack)."""
    native = library()
    if native is None or act is None or len(g.kernel) != 2 or x.ndim != 4:
        return None
    macs = x.shape[0] * w.numel() * g.out[0] * g.out[1]
    if macs > _MAX_MACS:
        return None
    conv = _Conv(native, x, w, b, g, group, act, order)
    for make in (depthwise, pointwise, im2col_conv):
        fn = make(conv)
        if fn is not None:
            return fn
    return None


def to_channels_last(x: torch.Tensor, y: torch.Tensor) -> bool:
    """Copy NCHW-contiguous float32 ``x`` into channels-last ``y`` of its shape natively; False
    (nothing done) where the library or the layouts are not there."""
    native = library()
    if (
        native is None
        or x.dtype != torch.float32
        or y.dtype != torch.float32
        or x.ndim != 4
        or x.shape != y.shape
        or not x.is_contiguous()
        or not y.is_contiguous(memory_format=torch.channels_last)
    ):
        return False
    n, c, h, w = x.shape
    native.lib.tk_to_channels_last(x.data_ptr(), n, c, h * w, y.data_ptr())
    return True


def spatial_mean(x: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> mean over the spatial axes, kept`` for a channels-last float32 (N, C, H, W) of
    this shape (GlobalAveragePool), or None. torch's mean wakes its idle threads for a small
    input: 46 us in MobileNetV3-Small's head where the pooling takes 6."""
    native = library()
    if native is None or x.device.type != "cpu" or x.ndim != 4 or x.dtype != torch.float32:
        return None
    n, c, h, w = x.shape
    fn = native.lib.tk_spatial_mean

    def run(x: torch.Tensor) -> torch.Tensor:
        x = _cl(x)
        y = torch.empty((n, c, 1, 1), dtype=torch.float32)
        fn(x.data_ptr(), n, h * w, c, y.data_ptr())
        return y

    return run


def squeeze_excite(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act1: tuple[int, float, float] | None,
    act2: tuple[int, float, float] | None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x -> y`` for a SqueezeExcite at ``x``'s shape with these weights (one pass over x for
    the mean, one for the scaling), or None (no library, an activation the kernels lack)."""
    native = library()
    if native is None or act1 is None or act2 is None or not _applies(x, w1, b1):
        return None
    if w2.dtype != torch.float32 or (b2 is not None and b2.dtype != torch.float32):
        return None
    n, c, h, wd = x.shape
    s = w1.shape[0]
    vl = native.vector
    sp, cp = -(-s // vl) * vl, -(-c // vl) * vl
    w1t = torch.zeros(c, sp, dtype=torch.float32)
    w1t[:, :s] = w1.detach().reshape(s, c).t()
    w2t = torch.zeros(s, cp, dtype=torch.float32)
    w2t[:, :c] = w2.detach().reshape(c, s).t()
    b1p, b2p = _padded_bias(b1, s, vl), _padded_bias(b2, c, vl)
    ip, fp, arrays = _fixed(
        (n, h * wd, c, w1t.data_ptr(), b1p.data_ptr(), s, sp, w2t.data_ptr(), b2p.data_ptr(), cp,
         act1[0], act2[0]),
        (*act1[1:], *act2[1:]),
    )  # fmt: skip
    scratch = n * (2 * cp + sp)
    fn = native.lib.tk_se_p

    def run(x: torch.Tensor) -> torch.Tensor:
        x = _cl(x)
        y = torch.empty_like(x, memory_format=torch.channels_last)
        work = torch.empty(scratch, dtype=torch.float32)
        fn(ip, fp, x.data_ptr(), y.data_ptr(), work.data_ptr())
        return y

    run.keep = (w1t, w2t, b1p, b2p, arrays)  # type: ignore[attr-defined]
    return run


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    trans_b: int,
    act: tuple[int, float, float] | None,
) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``a -> act(a @ B' + c)`` for a 2-D float32 ``a`` of this shape and constant ``b``, ``c``
    (C of N values), or None (no library, an activation the kernels lack, too large)."""
    native = library()
    if native is None or act is None or a.ndim != 2 or b.ndim != 2 or not _applies(a, b, c):
        return None
    w2 = b.detach().t() if trans_b else b.detach()
    m, k = a.shape
    n = w2.shape[1]
    if w2.shape[0] != k or m * k * n > _MAX_MACS:
        return None
    if c is not None and (c.numel() != n or (c.ndim == 2 and c.shape[0] != 1) or c.ndim > 2):
        return None
    packed = _panels(w2, native.panel)
    bias = _padded_bias(c, n, native.panel)
    ints = (m, k, packed.data_ptr(), bias.data_ptr(), n, 0, act[0])
    ip, fp, arrays = _fixed(ints, act[1:])
    fn = native.lib.tk_gemm_rows_p

    def run(a: torch.Tensor) -> torch.Tensor:
        a = a.contiguous()
        y = torch.empty((m, n), dtype=torch.float32)
        fn(ip, fp, a.data_ptr(), y.data_ptr(), None)
        return y

    run.keep = (packed, bias, arrays)  # type: ignore[attr-defined]
    return run


def specialize_gemm(
    kernel: Callable[..., torch.Tensor],
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor | None,
    attrs: dict[str, Any],
) -> Callable[..., torch.Tensor] | None:
    """The ``specialize`` of the Gemm and GemmAct kernels: the native GEMM where alpha, beta
    and transA are the defaults and the activation is one the kernels have."""
    get = attrs.get
    if a.device.type != "cpu" or get("alpha", 1.0) != 1.0 or get("transA", 0):
        return None
    if c is not None and get("beta", 1.0) != 1.0:
        return None
    act = activation(
        get("activation", ""), get("activation_alpha"), get("activation_beta"),
        get("activation_min"), get("activation_max"),
    )  # fmt: skip
    native = gemm(a, b, c, get("transB", 0), act)
    if native is None:
        return None
    return specialized(native, functools.partial(kernel, **attrs), (a, b, c))


def specialized(
    native: Callable[[torch.Tensor], torch.Tensor],
    generic: Callable[..., torch.Tensor],
    args: tuple,
    timed: bool = True,
) -> Callable[..., torch.Tensor] | None:
    """A kernel's specialized function over ``native`` (made for the constants ``args[1:]``: any
    other goes to ``generic``), where it is the faster of the two on ``args`` (always with
    TENSORKILN_CPU_NATIVE=always or ``timed`` False); None where ``generic`` is faster."""
    consts = args[1:]

    def run_native(x: torch.Tensor, *rest: Any) -> torch.Tensor:
        if any(p is not q for p, q in zip(rest, consts)) or len(rest) != len(consts):
            return generic(x, *rest)  # (a guard: the executor's weights are constants)
        return native(x)

    if always() or not timed or faster(run_native, generic, args) is run_native:
        return run_native
    return None


def faster(
    first: Callable[..., Any], second: Callable[..., Any], args: tuple, runs: int = 7
) -> Callable[..., Any]:
    """The faster of two functions of ``args``, measured here: 1 warm-up run each, then up to
    ``runs`` alternating runs (fewer for slow layers: about _TIMING_S of runs each); the
    shorter best run wins (noise only ever adds time), ``first`` on a tie."""
    best = [float("inf"), float("inf")]
    spent = 0.0
    for i in range(runs + 1):
        for k, fn in enumerate((first, second)):
            t0 = time.perf_counter()
            fn(*args)
            took = time.perf_counter() - t0
            spent += took
            if i:
                best[k] = min(best[k], took)
        if i >= 2 and spent > _TIMING_S:
            break
    return first if best[0] <= best[1] else second

"""The cpu backend's native kernels: cpu_native.c compiled at first use, called through ctypes.

At batch 1 a mobile network's convolutions are tens of microseconds each, and oneDNN's call costs
about 40 us whatever the size (RESULTS.md): a depthwise 3x3 of 16x112x112 takes 50 us through
oneDNN and 24 us here. This module builds cpu_native.c with the system C compiler (``$CC``, else
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
import hashlib
import logging
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from tensorkiln.kernels.reference._window import Geometry

ENV = "TENSORKILN_CPU_NATIVE"
_SOURCE = Path(__file__).with_name("cpu_native.c")
_FLAGS = ["-O3", "-march=native", "-fPIC", "-shared", "-std=gnu11"]
_LOG = logging.getLogger("tensorkiln")
_LOCK = threading.Lock()
# layers with more multiply-adds (batch x output positions x weight elements) are left to oneDNN,
# whose kernels win on them (and timing both there would cost more than it finds)
_MAX_MACS = 50_000_000

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

_L, _P, _I, _F = ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "tk_vector_floats": ([], _I),
    "tk_panel_floats": ([], _I),
    "tk_conv_max_k": ([], _L),
    "tk_gemm_rows": ([_P, _L, _L, _P, _P, _L, _P, _P, _I, _I, _F, _F], None),
    "tk_conv_gemm": ([_P, _L, _L, _L, _L, _P, _P, _L] + [_L] * 10 + [_P, _P, _I, _I, _F, _F], None),
    "tk_dwconv": ([_P, _L, _L, _L, _L, _P, _P] + [_L] * 10 + [_P, _P, _I, _I, _F, _F], None),
}


class Native:
    """The loaded library: its functions with their ctypes signatures, and its panel width."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        for name, (args, res) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res
        self.lib = lib
        self.panel = int(lib.tk_panel_floats())
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
    for name in (os.environ.get("CC", "").strip(), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    raise RuntimeError("no C compiler found (set CC)")


def cache_dir() -> Path:
    """Where built libraries are kept (created private to the user when missing)."""
    root = os.environ.get("TENSORKILN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    base = Path(root) if root else Path.home() / ".cache"
    folder = base if os.environ.get("TENSORKILN_CACHE_DIR") else base / "tensorkiln"
    folder = folder / "native"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"cache folder {folder} is not private to this user")
    return folder


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


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


def _build() -> Path:
    cc = _compiler()
    source = _SOURCE.read_bytes()
    version = _run([cc, "--version"]).stdout
    key = hashlib.sha256()
    for part in (source, cc.encode(), version.encode(), " ".join(_FLAGS).encode()):
        key.update(part + b"\0")
    key.update((platform.machine() + _cpu_id()).encode())
    folder = cache_dir()
    target = folder / f"cpu_native-{key.hexdigest()[:32]}.so"
    if target.is_file() and not target.is_symlink():
        return target
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / "lib.so"
        src = Path(tmp) / "cpu_native.c"
        src.write_bytes(source)
        for extra in (["-fopenmp"], []):  # OpenMP where the compiler has it
            done = _run([cc, *_FLAGS, *extra, "-o", str(out), str(src)])
            if done.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-300:]}")
        os.replace(out, target)
    return target


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
    return (
        x.device.type == "cpu"
        and x.ndim == 4
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


def _output(x: torch.Tensor, m: int, g: Geometry) -> torch.Tensor:
    return torch.empty(
        (x.shape[0], m, *g.out), dtype=torch.float32, memory_format=torch.channels_last
    )


def _residual(z: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor | None:
    if z is None:
        return None
    if tuple(z.shape) != shape or z.dtype != torch.float32 or z.device.type != "cpu":
        raise ValueError(f"ConvAct: residual Z of shape {tuple(z.shape)} must be {shape}")
    return _cl(z)


def depthwise(
    native: Native,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: Geometry,
    group: int,
    act: tuple[int, float, float],
    order: int,
) -> Layer | None:
    """``(x, z) -> y`` for a depthwise 2-D convolution (one channel per group) at ``x``'s
    shape, or None where the kernel does not apply."""
    n, c, h, wd = x.shape
    if not _applies(x, w, b) or group != c or tuple(w.shape[:2]) != (c, 1) or len(g.out) != 2:
        return None
    kh, kw = w.shape[2:]
    taps = w.detach().reshape(c, kh * kw).t().contiguous()  # (kh*kw, C)
    bias = _padded_bias(b, c, 1)
    fixed = (n, h, wd, c, taps.data_ptr(), bias.data_ptr(), kh, kw, *g.strides)
    fixed += (g.begin[0], g.begin[1], *g.dilations, *g.out)
    code, a0, a1 = act
    fn = native.lib.tk_dwconv
    shape = (n, c, *g.out)

    def run(x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        x = _cl(x)
        r = _residual(z, shape)
        y = _output(x, c, g)
        fn(
            x.data_ptr(),
            *fixed,
            y.data_ptr(),
            None if r is None else r.data_ptr(),
            order,
            code,
            a0,
            a1,
        )
        return y

    run.keep = (taps, bias)  # type: ignore[attr-defined]
    return run


def pointwise(
    native: Native,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: Geometry,
    group: int,
    act: tuple[int, float, float],
    order: int,
) -> Layer | None:
    """``(x, z) -> y`` for a 1x1 convolution of one group, stride 1, no padding (a GEMM over
    the channels-last rows), or None where the kernel does not apply."""
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
    fn = native.lib.tk_gemm_rows
    wp, bp = packed.data_ptr(), bias.data_ptr()
    shape = (n, m, h, wd)

    def run(x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        x = _cl(x)
        r = _residual(z, shape)
        y = _output(x, m, g)
        fn(
            x.data_ptr(),
            rows,
            c,
            wp,
            bp,
            m,
            y.data_ptr(),
            None if r is None else r.data_ptr(),
            order,
            code,
            a0,
            a1,
        )
        return y

    run.keep = (packed, bias)  # type: ignore[attr-defined]
    return run


def im2col_conv(
    native: Native,
    x: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    g: Geometry,
    group: int,
    act: tuple[int, float, float],
    order: int,
) -> Layer | None:
    """``(x, z) -> y`` for a 2-D convolution of one group whose patches (kh*kw*C values) are
    at most the kernel's limit (the stem of a mobile network: 3x3 over 3 channels), or None."""
    n, c, h, wd = x.shape
    if not _applies(x, w, b) or group != 1 or w.shape[1] != c or len(g.out) != 2:
        return None
    m, _, kh, kw = w.shape
    if kh * kw * c > native.max_k:
        return None
    w2 = w.detach().permute(2, 3, 1, 0).reshape(kh * kw * c, m)  # rows in (i, j, c) order
    packed = _panels(w2, native.panel)
    bias = _padded_bias(b, m, native.panel)
    fixed = (n, h, wd, c, packed.data_ptr(), bias.data_ptr(), m, kh, kw, *g.strides)
    fixed += (g.begin[0], g.begin[1], *g.dilations, *g.out)
    code, a0, a1 = act
    fn = native.lib.tk_conv_gemm
    shape = (n, m, *g.out)

    def run(x: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        x = _cl(x)
        r = _residual(z, shape)
        y = _output(x, m, g)
        fn(
            x.data_ptr(),
            *fixed,
            y.data_ptr(),
            None if r is None else r.data_ptr(),
            order,
            code,
            a0,
            a1,
        )
        return y

    run.keep = (packed, bias)  # type: ignore[attr-defined]
    return run


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
    for make in (depthwise, pointwise, im2col_conv):
        fn = make(native, x, w, b, g, group, act, order)
        if fn is not None:
            return fn
    return None

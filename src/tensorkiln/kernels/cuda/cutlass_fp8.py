"""FP8 (and int8) GEMMs and convolutions from a kernel library built ahead of time: tactics
``cutlass_fp8_<variant>`` of QGemmAct and of QConvAct (1x1 as a GEMM of the pixels; 3x3 padded
by 1 of stride 1 or 2, and 1x1 of stride 2, as implicit GEMMs), where a library is configured and
has a kernel for the layer.

The library is what ``benchmarks/cutlass_gemm_build.py`` writes: CUTLASS's persistent,
warp-specialized Hopper GEMM (TMA loads and stores, WGMMA), compiled for sm_90a with CUTLASS's
Python DSL on any machine and exported as object code, with ``manifest.json`` naming each
kernel's entry point. ``TENSORKILN_CUTLASS_KERNELS`` names the folder; without it (or without a
CUDA GPU of compute capability 9.0) the tactics are not candidates. Nothing of the DSL is needed
here: the kernels are called through ctypes on torch's stream, with the CUDA runtime torch
loaded.

The kernels take E4M3 A (M x K) and B (N x K, the packed weight), both K-major, and write E4M3
or float16 D (M x N): ``D = act(acc * col[n] + bias[n])`` (``channel``) or ``act(acc * col[n] +
bias[n] + Z * z)`` (``residual``, Z an 8-bit M x N tensor of the operands' type), with ``act``
ReLU or none. A quantized layer maps onto them with ``col = alpha * X_scale * W_scale[n] / Y_scale`` and
``bias = beta * B[n] / Y_scale`` (and ``z = Z_scale / Y_scale``): ReLU commutes with the positive
division, and the kernel's conversion to E4M3 saturates as QuantizeLinear does. GELU does not
commute with it: a GEMM with GELU (``channel``, QGemmAct's) takes ``col`` and ``bias`` without
the division and ``D = gelu(acc * col[n] + bias[n]) * (1 / Y_scale)``, its GELU CUTLASS's
polynomial for the normal CDF (within 0.001 of erf's GELU, far inside an E4M3 step), or,
``gelu_tanh``, GELU's tanh form on the hardware's approximate tanh (within 2e-3; half the
epilogue's instructions). A float16 output (a layer without Y_scale or activation: BERT's QKV,
attention-output and second FFN GEMMs) takes ``col = alpha * X_scale * W_scale[n]`` and ``bias =
beta * B[n]``, and so does a 1x1 convolution with ReLU and an 8-bit residual that writes
float16 (a network's last block, whose sum a float pool reads), with ``z = Z_scale``. The same
kernels with int8 operands (int32 sums, exact) write int8 (GELU, ReLU
or none, with an int8 residual or without, saturated and rounded half to even, as QuantizeLinear
rounds) or float16: the tactics
keep the family's name, ``cutlass_fp8_``, and the kernel's name says its types
(``gemm_i8_i8_...``). Dividing before rounding rather than after changes a value by at most one
E4M3 step, which the autotuner's check of E4M3 outputs (one step of the tensor's largest value)
allows. Shapes: M a multiple of 128, N and K of 16; a call at another shape (an engine's dynamic
dimension away from the shape it was tuned at) runs the layer's exact default kernel instead.

The convolution kernels (``conv3x3s1_...``, ``conv3x3s2_...``, ``conv1x1s2_...``) are the same
GEMM with A read by TMA's im2col mode: A is the dense NHWC input, each K step one window tap and
``32 x k_steps`` input channels (so the channels are a multiple of that), the padding's pixels
zeros the TMA unit fills in, B the weight as (out channels, KH x KW x C) in the order of an OHWI
weight's columns, D the (pixels x out channels) output, channels-last; the per-channel or the
residual epilogue, ReLU or none, an 8-bit output of the operands' type.

E4M3 kernels with promoted sums (a tile ending in ``p``) add each K step's sums into a float32
accumulator, as CUTLASS's C++ FP8 GEMMs do by default: Hopper's FP8 tensor-core sums are
narrower than float32, which over a long K (a 3x3 convolution of 512 channels sums 4,608
products) can move an output past the autotuner's check.

Kernels whose tile ends in ``v`` copy the tile's ``col`` and ``bias`` to shared memory when the
tile starts (cp.async, under the main loop) and read them from there in the epilogue, where the
others read them from global memory between the epilogue's barriers. Residual kernels whose
tile ends in ``d`` keep two buffers of the residual's tile in shared memory and request the next
tile's while this one's runs (``residual_buffers`` 2 in the manifest).

A manifest entry's ``sha256`` (its object code's digest, which the build records) is the
tactic's version: a timing cache keys its entries with it, so a rebuilt library's kernels are
timed again rather than chosen on their predecessors' timings.

The library is code: a folder named here is trusted as a plugin library is. Its manifest is
still read defensively (bounded, every field checked), and a library that does not load or does
not match is reported once and leaves these tactics out; an engine that names one of them then
fails to load with the tactic's name rather than running something else.
"""

from __future__ import annotations

import ctypes
import glob
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from tensorkiln.errors import KernelError
from tensorkiln.kernels.cuda.convert import host_list
from tensorkiln.kernels.cuda.fused_quant import qconv, qconv_act, qgemm_act, qgemm_call
from tensorkiln.kernels.cuda.tactics_quant import _kept
from tensorkiln.kernels.tactics import LayerSpec, Tactic, TacticFamily, tactic_family

log = logging.getLogger(__name__)

ENV = "TENSORKILN_CUTLASS_KERNELS"
PREFIX = "cutlass_fp8_"
MANIFEST = "manifest.json"
_MANIFEST_LIMIT = 4 << 20
_KERNELS_LIMIT = 4096
# every kernel the build writes: gemm_<A>_<D>_<epilogue>_<activation>_<tile>; the tactics use
# the FP8 ones with a per-channel or residual epilogue and ReLU or none (or a per-channel one
# with GELU and its output scale after it, or a per-channel one writing float16 with no
# activation; the per-channel and residual ones with int8 operands and outputs too), and pass
# over the rest
_ANY_KERNEL = re.compile(r"(?:gemm|conv[13]x[13]s[12])_(fp8|f16|i8)_(fp8|f16|i8)_"
                         r"(scalar|channel|residual)_([a-z_]{1,20})_([0-9a-z]{1,40})\Z")  # fmt: skip
# (a convolution's kernel, conv<K>x<K>s<S>: A read through TMA's im2col mode, implicit GEMM)
_KERNEL_NAME = re.compile(
    r"(?:gemm|conv(?P<geometry>3x3s[12]|1x1s2))_(fp8|i8)_(fp8|i8|f16)_(channel|residual)_"
    r"(relu|none|gelu|gelu_tanh)_([0-9a-z]{1,40})\Z"
)
_ENTRY = re.compile(r"_mlir_[A-Za-z0-9_]{1,480}\Z")
_DIGEST = re.compile(r"[0-9a-f]{16,64}\Z")
_LIBRARY_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}\.so\Z")
_TILES_M, _TILES_N = (64, 128), (64, 128, 256)
_E4M3 = "float8_e4m3fn"
_E4M3_CODE = 17  # ONNX's FLOAT8E4M3FN
_INT8_CODE = 3  # ONNX's INT8
_OPERANDS = {_E4M3: "fp8", "int8": "i8"}  # (the layer's operand type: the kernels' A and B)
_QUANTIZED_OUT = {"fp8": _E4M3_CODE, "i8": _INT8_CODE}  # (their 8-bit output, as ONNX codes)
_OUT_DTYPES = {"fp8": torch.float8_e4m3fn, "i8": torch.int8, "f16": torch.float16}
_F16_CODE = 10  # ONNX's FLOAT16
_ACTIVATIONS = {"": "none", "Relu": "relu"}
_GEMM_ACTIVATIONS = {**_ACTIVATIONS, "Gelu": "gelu"}  # (QGemmAct's: with the output scale after)
# a kernel's activation that computes a layer's: GELU in tanh's form on the hardware's tanh
# (within 2e-3 of erf's, inside an 8-bit step; the autotuner checks each kernel's outputs)
_SAME_AS = {"gelu_tanh": "gelu"}
_M_MULTIPLE, _NK_MULTIPLE = 128, 16
_VECTOR_PAD = max(_TILES_N)  # (the epilogue's vectors: whole tiles of columns)


class TensorArg(ctypes.Structure):  # a 2-D row-major tensor: extents and the two dynamic strides
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("shapes", ctypes.c_int32 * 2),
        ("strides", ctypes.c_int64 * 2),
    ]


class ImageArg(ctypes.Structure):  # an NHWC image seen as (N, D = 1, H, W, C): N, H, W, C and the
    _fields_ = [  # strides of N, D, H and W
        ("data", ctypes.c_void_p),
        ("shapes", ctypes.c_int32 * 4),
        ("strides", ctypes.c_int64 * 4),
    ]


class VectorArg(ctypes.Structure):  # a vector: its data and length
    _fields_ = [("data", ctypes.c_void_p), ("shapes", ctypes.c_int32 * 1)]


def read_manifest(folder: Path) -> tuple[Path, dict[str, dict[str, Any]]]:
    """The library's path and its kernels (name -> manifest entry), checked: a malformed or
    oversized manifest, a library named outside the folder, or a kernel entry of another shape
    is a :class:`KernelError` naming the file and the field."""
    folder = Path(folder).resolve()
    path = folder / MANIFEST
    where = f"kernel library {path}"
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise KernelError(f"{where}: cannot read it ({exc.strerror or exc})") from None
    if size > _MANIFEST_LIMIT:
        raise KernelError(f"{where}: {size} bytes, more than a manifest's {_MANIFEST_LIMIT}")
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:
        raise KernelError(f"{where}: not JSON ({exc})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("kernels"), list):
        raise KernelError(f"{where}: expected an object with a 'kernels' list")
    lib_name = doc.get("library")
    if not isinstance(lib_name, str) or not _LIBRARY_NAME.fullmatch(lib_name):
        raise KernelError(
            f"{where}: 'library' must name a .so file in the folder, not {lib_name!r}"
        )
    lib = (folder / lib_name).resolve()
    if lib.parent != folder or not lib.is_file():
        raise KernelError(f"{where}: library {lib_name!r} is not a file in {folder}")
    if len(doc["kernels"]) > _KERNELS_LIMIT:
        raise KernelError(f"{where}: more than {_KERNELS_LIMIT} kernels")
    kernels = {}
    for i, k in enumerate(doc["kernels"]):
        if _checked_kernel(k, f"{where}, kernels[{i}]"):
            kernels[k["name"]] = k
    return lib, kernels


def _checked_kernel(k: Any, where: str) -> bool:
    """Whether manifest entry ``k`` is a kernel the tactics use (False: another the build makes,
    such as a 16-bit or scalar-epilogue one); a malformed entry is a KernelError."""
    if not isinstance(k, dict):
        raise KernelError(f"{where}: expected an object")
    name, entry = k.get("name"), k.get("entry")
    if not isinstance(name, str) or not _ANY_KERNEL.fullmatch(name):
        raise KernelError(f"{where}: name {name!r} is not an exported GEMM kernel's")
    found = _KERNEL_NAME.fullmatch(name)
    if found is None:
        return False
    if not isinstance(entry, str) or not _ENTRY.fullmatch(entry):
        raise KernelError(f"{where}: entry point {entry!r} is not an exported kernel's")
    geometry = found.group("geometry")
    a, out, epilogue, activation = found.groups()[1:5]
    if activation.startswith("gelu") and (epilogue != "channel" or k.get("post_scale") is not True):
        return False  # (a GELU kernel built to scale before its activation: not one of these)
    if out == "f16" and activation.startswith("gelu"):
        return False  # (16-bit outputs: no output scale after the activation)
    if out not in (a, "f16"):
        return False  # (8-bit outputs of the operands' type)
    if (k.get("a"), k.get("c"), k.get("epilogue"), k.get("activation")) != (
        a, out, epilogue, activation,
    ):  # fmt: skip
        raise KernelError(f"{where}: types or epilogue do not match the name {name!r}")
    tile = k.get("tile")
    if not (
        isinstance(tile, list) and len(tile) == 2 and tile[0] in _TILES_M and tile[1] in _TILES_N
    ):
        raise KernelError(f"{where}: tile {tile!r} is not one of M {_TILES_M} by N {_TILES_N}")
    cluster = k.get("cluster", [1, 1])  # (a library built before clusters names none)
    if not (isinstance(cluster, list) and len(cluster) == 2 and all(c in (1, 2) for c in cluster)):
        raise KernelError(f"{where}: cluster {cluster!r} is not M x N CTAs of 1 or 2")
    digest = k.get("sha256")  # (a build since per-kernel digests: the object code's)
    if digest is not None and not (isinstance(digest, str) and _DIGEST.fullmatch(digest)):
        raise KernelError(f"{where}: sha256 {digest!r} is not a hexadecimal digest")
    stages = k.get("ab_stages", 2)  # (recorded since residual kernels have two buffers)
    if not isinstance(stages, int) or stages < 1:
        raise KernelError(f"{where}: ab_stages {stages!r} is not a count of main-loop stages")
    if stages < 2:
        return False  # (the main loop would wait on its one stage for the next K tile: a hang)
    buffers = k.get("residual_buffers", 1)
    if buffers not in (1, 2) or (buffers == 2 and epilogue != "residual"):
        raise KernelError(f"{where}: residual_buffers {buffers!r} is not 1, or 2 for a residual")
    tensors = k.get("tensors")
    want = ("a", "b", "c", "res") if epilogue == "residual" else ("a", "b", "c")
    extents = {t: [2, 2] for t in want}
    if geometry is not None:  # (A: the NHWC input as (N, 1, H, W, C), four extents and strides)
        if out != a or cluster != [1, 1]:
            raise KernelError(f"{where}: {name} is not a convolution's kernel of the build")
        if k.get("conv") != list(_conv_geometry(geometry)):
            raise KernelError(f"{where}: conv {k.get('conv')!r} does not match the name {name!r}")
        extents["a"] = [4, 4]
    if not isinstance(tensors, dict) or any(tensors.get(t) != e for t, e in extents.items()):
        raise KernelError(f"{where}: tensors {tensors!r} are not the dynamic ones it takes")
    return True


def _conv_geometry(geometry: str) -> tuple[int, int, int]:
    """(window, padding, stride) of a conv kernel's geometry, ``3x3s1``, ``3x3s2`` or ``1x1s2``."""
    window, stride = int(geometry[0]), int(geometry[-1])
    return window, window // 2, stride


class Library:
    """The kernels of one library, loaded on the current CUDA device. A kernel that does not
    load is left out with a warning naming it (the others stay candidates); a library none of
    whose kernels loads is a KernelError."""

    def __init__(self, folder: Path) -> None:
        lib_path, kernels = read_manifest(folder)
        load_cudart()
        where = f"kernel library {lib_path}"
        try:
            self._lib = ctypes.CDLL(str(lib_path), mode=ctypes.RTLD_GLOBAL)
        except OSError as exc:
            raise KernelError(f"{where}: does not load ({exc})") from None
        self._entries, failed = {}, []
        for name, k in kernels.items():
            try:
                self._entries[name] = load_kernel(self._lib, name, k["entry"], where)
            except KernelError as exc:
                failed.append(str(exc))
        if kernels and not self._entries:
            raise KernelError(f"{where}: none of its {len(kernels)} kernels loads ({failed[0]})")
        if failed:
            log.warning("%s: %d of its kernels left out: %s", where, len(failed),
                        "; ".join(failed[:3]) + (" ..." if len(failed) > 3 else ""))  # fmt: skip
        self.kernels = {name: k for name, k in kernels.items() if name in self._entries}

    def run(
        self,
        name: str,
        a: torch.Tensor,
        b: torch.Tensor,
        d: torch.Tensor,
        col: torch.Tensor,
        bias: torch.Tensor,
        z: torch.Tensor | None = None,
        scalar: float = 0.0,
    ) -> None:
        """``d = act(a @ b.T * col + bias [+ z * scalar])`` (a residual kernel) or ``act(a @ b.T *
        col + bias) * scalar`` (a GELU one) on torch's current stream; for a convolution's
        kernel, ``a`` is the dense NHWC input and ``a @ b.T`` its im2col matrix times b."""
        first = image_arg(a) if self.kernels[name].get("conv") else tensor_arg(a)
        structs: list[ctypes.Structure] = [first, tensor_arg(b), tensor_arg(d)]
        structs += [VectorArg(v.data_ptr(), (v.shape[0],)) for v in (col, bias)]
        if self.kernels[name]["epilogue"] == "residual":
            if z is None:
                raise KernelError(f"{name} reads a residual and was given none")
            structs.append(tensor_arg(z))
        launch(self._entries[name], name, structs, scalar)


def load_kernel(lib: ctypes.CDLL, name: str, entry_name: str, where: str) -> Any:
    """Kernel ``name`` of an exported library loaded on the current CUDA device (its generated
    init and load functions, as the exported header calls them), and its entry point."""
    try:
        init = getattr(lib, f"_mlir_{name}_cuda_init")
        load = getattr(lib, f"_mlir_{name}_cuda_load_to_device")
        entry = getattr(lib, entry_name)
    except AttributeError:
        raise KernelError(f"{where}: {name} is not in it") from None
    module = ctypes.c_void_p()  # (the cudaLibrary_t the init fills; kept with the entry point)
    holder = ctypes.pointer(module)
    device = ctypes.c_int32(torch.cuda.current_device())
    ret = ctypes.c_int(0)
    init((ctypes.c_void_p * 2)(ctypes.addressof(holder), ctypes.addressof(ret)))
    if not ret.value:
        args = (ctypes.addressof(holder), ctypes.addressof(device), ctypes.addressof(ret))
        load((ctypes.c_void_p * 3)(*args))
    if ret.value:
        raise KernelError(f"{where}: {name} did not load (CUDA error {ret.value})")
    entry.argtypes = [ctypes.c_void_p, ctypes.c_int32]
    entry.restype = None
    entry.tk_module = (module, holder)
    return entry


def launch(entry: Any, name: str, structs: list[ctypes.Structure], scalar: float) -> None:
    """Call an exported kernel's entry point on torch's current stream: its tensor arguments in
    order, then the one float scalar, the stream and the status it writes."""
    value = ctypes.c_float(scalar)
    stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    ret = ctypes.c_int32(0)
    ptrs = [ctypes.addressof(s) for s in (*structs, value, stream, ret)]
    entry((ctypes.c_void_p * len(ptrs))(*ptrs), len(ptrs))
    if ret.value:
        raise KernelError(f"{name}: the launch failed (status {ret.value})")


def tensor_arg(t: torch.Tensor) -> TensorArg:
    rows, cols = t.shape
    if t.stride() != (cols, 1) or t.data_ptr() % 16:
        raise KernelError("CUTLASS FP8 GEMMs take row-major operands on 16-byte boundaries")
    return TensorArg(t.data_ptr(), (rows, cols), (cols, rows * cols))


def image_arg(t: torch.Tensor) -> ImageArg:
    nb, h, w, c = t.shape
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise KernelError("CUTLASS convolutions take a dense NHWC input on a 16-byte boundary")
    return ImageArg(t.data_ptr(), (nb, h, w, c), (h * w * c, h * w * c, w * c, c))


def load_cudart() -> None:
    """The CUDA runtime torch uses, made global so that the kernels' launchers bind to it (one
    runtime, one context)."""
    names = ["libcudart.so.13", "libcudart.so.12"]
    for base in sys.path:
        names += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", "libcudart.so*")))
    for name in names:
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL).cudaLibraryLoadData  # noqa: B018
            return
        except (OSError, AttributeError):
            continue
    raise KernelError("no CUDA runtime with cudaLibraryLoadData (CUDA 12 or later) found")


_state: dict[str, Any] = {}


def library() -> Library | None:
    """The library ``TENSORKILN_CUTLASS_KERNELS`` names, loaded once (None: none named, no
    Hopper GPU, or it did not load; the reason is logged once)."""
    folder = os.environ.get(ENV, "")
    if _state.get("folder") == folder:
        return _state.get("lib")
    lib = None
    if folder and torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        try:
            lib = Library(Path(folder))
        except KernelError as exc:
            log.warning("CUTLASS FP8 tactics unavailable: %s", exc)
    elif folder:
        log.info("CUTLASS FP8 tactics unavailable: they need a GPU of compute capability 9.0")
    _state.update(folder=folder, lib=lib)
    return lib


class _Layer(NamedTuple):
    """What the kernels need to know of a layer: the epilogue, the GEMM's M x N x K (a
    convolution's: output pixels x output channels x window taps times input channels), the
    output and operand types, and a convolution's window (``1x1`` for one the GEMM kernels take
    alone; ``1x1s2``, ``3x3s1``, ``3x3s2`` for ones a conv kernel of that geometry takes, the
    first also the GEMM kernels) with its input channels."""

    epilogue: str
    m: int
    n: int
    k: int
    out: str
    operands: str
    geometry: str | None = None
    channels: int = 0


def _layer(spec: LayerSpec) -> _Layer | None:
    """The layer ``spec`` describes, if the kernels compute it, else None."""
    if spec.device != "cuda":
        return None
    if spec.op == "QGemmAct":
        return _gemm_layer(spec)
    if spec.op == "QConvAct":
        return _conv_layer(spec)
    return None


def _gemm_layer(spec: LayerSpec) -> _Layer | None:
    at = spec.attrs
    operands = _OPERANDS.get(spec.dtypes[0])
    if operands is None or spec.dtypes[2] != spec.dtypes[0] or len(spec.shapes) < 5:
        return None
    if at.get("transA", 0) or not at.get("transB", 0):
        return None  # (a packed weight)
    y = spec.shapes[5] if len(spec.shapes) > 5 else None
    if y is not None and at.get("out_dtype") == _QUANTIZED_OUT[operands]:
        out = operands  # (a quantized output, any activation the kernels have)
        if at.get("activation", "") not in _GEMM_ACTIVATIONS:
            return None
    elif y is None and at.get("out_dtype") == _F16_CODE and not at.get("activation", ""):
        out = "f16"  # (a 16-bit output, no activation: a QKV projection's, a residual branch's)
    else:
        return None
    a, b = spec.shapes[0], spec.shapes[2]
    if a is None or b is None or len(b) != 2 or len(a) < 2 or a[-1] != b[1]:
        return None
    m, n, k = math.prod(a[:-1]), b[0], b[1]
    c = spec.shapes[4]
    if c is not None and math.prod(c) != n:
        return None  # (a bias of one row)
    return _Layer("channel", m, n, k, out, operands)


def _window(x, w, at: dict) -> tuple[str, int, int] | None:
    """(geometry, OH, OW) of a convolution the kernels take: a 1x1 window without padding of
    any stride (``1x1``; ``1x1s2`` at stride 2 on an even image), or a 3x3 one padded by 1 on
    every side, stride 1 or 2 (2: an even image), else None."""
    strides = tuple(at.get("strides") or (1, 1))
    if len(strides) != 2 or any(s < 1 for s in strides):
        return None
    if any(d != 1 for d in at.get("dilations") or (1, 1)):
        return None
    auto_pad, pads = at.get("auto_pad", "NOTSET"), tuple(at.get("pads") or (0, 0, 0, 0))
    even = x[2] % 2 == 0 and x[3] % 2 == 0
    if tuple(w[2:]) == (1, 1):
        if any(pads) or auto_pad not in ("NOTSET", "VALID"):
            return None
        oh, ow = _out_size(x, strides)
        return ("1x1s2" if strides == (2, 2) and even else "1x1"), oh, ow
    if tuple(w[2:]) != (3, 3) or strides not in ((1, 1), (2, 2)) or (strides[0] == 2 and not even):
        return None
    same = auto_pad in ("SAME_UPPER", "SAME_LOWER") and strides == (1, 1)
    if not (same or (auto_pad == "NOTSET" and pads == (1, 1, 1, 1))):
        return None
    return f"3x3s{strides[0]}", x[2] // strides[0], x[3] // strides[0]


def _conv_layer(spec: LayerSpec) -> _Layer | None:
    at = spec.attrs
    x, w = spec.shapes[0], spec.shapes[2]
    operands = _OPERANDS.get(spec.dtypes[0])
    if operands is None or spec.dtypes[2] != spec.dtypes[0] or x is None or w is None:
        return None
    if len(x) != 4 or len(w) != 4 or at.get("group", 1) != 1 or x[1] != w[1]:
        return None
    window = _window(x, w, at)
    if window is None:
        return None
    geometry, oh, ow = window
    z = spec.shapes[5] if len(spec.shapes) > 5 else None
    quantized_out = len(spec.shapes) > 6 and spec.shapes[6] is not None
    if quantized_out and at.get("out_dtype") == _QUANTIZED_OUT[operands]:
        out = operands  # (8 bits out, the operands' type)
    elif not quantized_out and z is not None and at.get("out_dtype") == _F16_CODE:
        out = "f16"  # (a last block's sum, read on in float: the residual kernels only)
    else:
        return None
    if at.get("activation", "") not in _ACTIVATIONS:
        return None
    epilogue = "channel"
    if z is not None:  # (a residual quantized as the operands are, added before the activation)
        quantized = len(spec.shapes) > 7 and spec.shapes[7] is not None
        if not quantized or spec.dtypes[5] != spec.dtypes[0]:
            return None
        if tuple(z) != (x[0], w[0], oh, ow):
            return None
        if at.get("residual_order", "add_act") != "add_act":
            return None
        epilogue = "residual"
    taps = w[2] * w[3]
    return _Layer(epilogue, x[0] * oh * ow, w[0], taps * w[1], out, operands, geometry, w[1])


def _takes(kern: dict, layer: _Layer) -> bool:
    """Whether kernel ``kern`` (a manifest entry) computes ``layer``'s kind: a GEMM kernel a
    GEMM or a 1x1 convolution, a conv kernel a convolution of its geometry whose input
    channels its K steps divide (each step within one tap)."""
    conv = kern.get("conv")
    if conv is None:
        return layer.geometry in (None, "1x1", "1x1s2")
    window, _, stride = conv
    if layer.geometry != f"{window}x{window}s{stride}":
        return False
    return layer.channels % (32 * kern.get("k_steps", 4)) == 0


def _kernels_for(spec: LayerSpec, fit: bool = True) -> list[str]:
    """The library's kernels for the layer ``spec`` describes; ``fit``: only where its shape is
    one they take. (Without ``fit``: the layer's kind alone, as a tactic timed at one shape
    must also apply at an engine's other shapes, where it runs the exact kernel instead when
    the shape is not one the kernels take: a dynamic batch of 1 image is not 128 pixels.)"""
    lib = library() if spec.device == "cuda" else None
    layer = _layer(spec) if lib is not None else None
    if layer is None:
        return []
    if fit and not _fits(layer.m, layer.n, layer.k):
        return []
    act = _GEMM_ACTIVATIONS[spec.attrs.get("activation", "")]
    names = []
    for name, kern in lib.kernels.items():  # type: ignore[union-attr]
        if (kern["epilogue"], _SAME_AS.get(kern["activation"], kern["activation"]), kern["c"],
                kern["a"]) != (layer.epilogue, act, layer.out, layer.operands):  # fmt: skip
            continue
        if not _takes(kern, layer):
            continue
        tile_m, tile_n = kern["tile"]
        if fit and not _fits(layer.m, layer.n, layer.k, kern):
            continue
        if layer.epilogue == "residual" and ((fit and layer.m % tile_m) or layer.n % tile_n):
            continue  # (its tile is read unbounded; where it runs, M is a multiple of 128)
        restaged = (
            kern.get("k_steps", 4) != 4 or kern.get("epi_tile") or kern.get("epi_stages", 4) != 4
        )
        if layer.k > 64 and restaged and not kern.get("conv"):
            # (GEMM variants that change stage counts stalled the GPU at larger K: at least
            # those left one main-loop stage, which the build now leaves out; which variant
            # stalled at K = 576 is not known, so they stay at K = 64)
            continue
        names.append(PREFIX + name)
    return names


def _vectors(
    scale: Callable[[], torch.Tensor],
    w_scale,
    x_scale,
    y_scale,
    bias,
    beta: float,
    key: tuple,
    over_y: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The epilogue's (col, bias), float32 vectors of N: the layer's per-column scale (``scale()``,
    its call's) and its bias times ``beta``, over Y_scale unless ``over_y`` is False; kept per
    constant as the other quantized tactics keep theirs (tactics_quant._kept), so an engine's
    calls make them once. Without ``y_scale`` (a 16-bit output) nothing is divided. Each is
    zero-padded to a whole number of the widest tile's columns: a tile wider than N reads its
    vectors' columns past N (the TMA store drops those outputs), and they stay in the tensor."""
    n = key[0]
    size = -(-n // _VECTOR_PAD) * _VECTOR_PAD
    over_y = over_y and y_scale is not None
    key = (*key, over_y)

    def over(v: torch.Tensor) -> torch.Tensor:
        v = v / y_scale.reshape(()).to(torch.float32) if over_y else v
        padded = v.new_zeros(size)
        padded[:n] = v
        return padded

    def col() -> torch.Tensor:
        return over(scale().expand(n).to(torch.float32))

    def shifted() -> torch.Tensor:
        return over(bias.reshape(n).to(torch.float32) * beta)

    def zeros() -> torch.Tensor:
        return torch.zeros(size, dtype=torch.float32, device=w_scale.device)

    cols = _kept(w_scale, ("cutlass_col", *key), col, x_scale, y_scale)
    if bias is None:
        return cols, _kept(w_scale, ("cutlass_zeros", n), zeros)
    return cols, _kept(bias, ("cutlass_bias", n, beta, over_y), shifted, y_scale)


def _host_scalar(t: torch.Tensor) -> float:
    """A one-value scale read on the host (an engine's constants carry their host values, so no
    device synchronization: the kernel takes the residual's scale by value)."""
    return float(np.ravel(host_list(t))[0])


def _gemm_fn(kernel: str) -> Callable:
    def run(a_q, a_scale, b_q, b_scale, c=None, y_scale=None, **attrs) -> torch.Tensor:
        call = qgemm_call(a_q, a_scale, b_q, b_scale, c, y_scale, attrs)
        lib = library()
        kern = lib.kernels[kernel] if lib is not None else None
        wide = kern is not None and kern["c"] == "f16"
        if kern is None or (call.y_scale is None) != wide or not call.packed:
            raise KernelError(f"{PREFIX}{kernel}: no kernel library, or not a packed 8-bit layer")
        if wide and (call.out != torch.float16 or call.activation):
            raise KernelError(f"{PREFIX}{kernel}: writes float16 without an activation")
        m, n = call.a2.shape[0], call.b.shape[0]
        if not _fits(m, n, call.a2.shape[1], kern):  # (a shape other than the tuned one's: exact)
            return qgemm_act(a_q, a_scale, b_q, b_scale, c, y_scale, **attrs)
        gelu = kern["activation"].startswith("gelu")  # (the output scale after the GELU)
        col, bias = _vectors(lambda: call.scale(torch.float32), b_scale, a_scale, y_scale, c,
                             call.beta, (n, call.alpha), over_y=not gelu)  # fmt: skip
        d = torch.empty((m, n), dtype=_OUT_DTYPES[kern["c"]], device=a_q.device)
        scalar = 1.0 / _host_scalar(y_scale) if gelu else 0.0
        lib.run(kernel, call.a2.contiguous(), call.b.contiguous(), d, col, bias, None, scalar)
        return d.reshape(call.shape)

    run.__name__ = f"{PREFIX}{kernel}"
    return run


def _out_size(x_shape, strides: tuple[int, ...]) -> tuple[int, int]:
    """The output's height and width of a 1x1 convolution of ``strides``, no padding, on an
    (N, C, H, W) input."""
    return -(-x_shape[2] // strides[0]), -(-x_shape[3] // strides[1])


def _subsampled(x: torch.Tensor, strides: tuple[int, int]) -> torch.Tensor:
    """The pixels a 1x1 convolution of ``strides`` (no padding) reads: ``x`` itself at unit
    strides, else every strides-th row and column, copied to a dense channels-last tensor (a
    quarter of the input at stride 2, in 8 bits: the GEMM then reads it as rows)."""
    if strides == (1, 1):
        return x
    return x[:, :, :: strides[0], :: strides[1]].contiguous(memory_format=torch.channels_last)


def _conv_fn(kernel: str) -> Callable:
    def run(x_q, x_scale, w_q, w_scale, b=None, z=None, y_scale=None, z_scale=None, **attrs):
        lib = library()
        if lib is None:
            raise KernelError(f"{PREFIX}{kernel}: no kernel library")
        kern = lib.kernels[kernel]
        scales = (x_scale, w_scale, y_scale, z_scale)
        if kern.get("conv"):
            return _implicit_gemm(lib, kernel, x_q, w_q, b, z, scales, attrs)
        strides = tuple(attrs.get("strides") or (1, 1))
        pixels = 0
        if x_q.ndim == 4 and len(strides) == 2:
            pixels = x_q.shape[0] * math.prod(_out_size(x_q.shape, strides))
        if not pixels or not _fits(pixels, w_q.shape[0], w_q.shape[1], kern):
            return qconv_act(x_q, x_scale, w_q, w_scale, b, z, y_scale, z_scale, **attrs)

        def sums(xq, wq, _bias, zz, call) -> tuple[torch.Tensor, bool]:  # (b read as given)
            xq = _subsampled(xq, strides)  # (qconv checked the geometry: 1x1, no padding)
            nb, ch, h, wd = xq.shape
            rows = xq.permute(0, 2, 3, 1).reshape(nb * h * wd, ch)  # (a view when channels-last)
            b2 = wq.reshape(wq.shape[0], ch).contiguous()
            return _run_conv(lib, kernel, rows.contiguous(), b2, (nb, h, wd), b, zz, scales, call)

        return qconv(x_q, x_scale, w_q, w_scale, b, z, y_scale, attrs, sums, z_scale)

    run.__name__ = f"{PREFIX}{kernel}"
    return run


def _run_conv(lib: Library, kernel: str, a, b2, pixels: tuple[int, int, int], bias, zz, scales,
              call) -> tuple[torch.Tensor, bool]:  # fmt: skip
    """A convolution's sums and epilogue by library kernel ``kernel``: A ``a`` (pixel rows, or a
    conv kernel's NHWC image) and B ``b2`` (out channels x K), the output's ``pixels`` (images,
    rows, columns) written in 8 bits (or float16, where the kernel writes it) as (pixels x out
    channels) rows and handed back as a channels-last NCHW view; the epilogue's vectors from the
    layer's ``scales`` (X, W, Y, Z) and ``bias``, the residual ``zz`` (if any) as rows of the
    output's pixels."""
    x_scale, w_scale, y_scale, z_scale = scales
    nb, oh, ow = pixels
    m = b2.shape[0]
    out = _OUT_DTYPES[lib.kernels[kernel]["c"]]  # (8 bits, the operands' type, or float16)
    if (y_scale is None) != (out == torch.float16) or call.out != out:
        raise KernelError(f"{PREFIX}{kernel}: writes {out}, the layer {call.out}")
    col, bias2 = _vectors(call.scale, w_scale, x_scale, y_scale, bias, 1.0, (m,))
    d = torch.empty((nb * oh * ow, m), dtype=out, device=a.device)
    z2, zs = None, 0.0
    if zz is not None:  # (8 bits of the operands' type, as the layer's check made sure)
        z2 = zz.permute(0, 2, 3, 1).reshape(nb * oh * ow, m).contiguous()
        zs = _host_scalar(z_scale) / (1.0 if y_scale is None else _host_scalar(y_scale))
    lib.run(kernel, a, b2, d, col, bias2, z2, zs)
    return d.reshape(nb, oh, ow, m).permute(0, 3, 1, 2), True


def _implicit_gemm(lib: Library, kernel: str, x_q, w_q, b, z, scales, attrs: dict) -> torch.Tensor:
    """A convolution through a conv kernel of the library: the dense NHWC input (a view when
    channels-last) read through TMA's im2col mode, the weight as (out channels, KH x KW x C),
    its columns in the order of an OHWI weight's (kept per constant), the residual (a residual
    kernel's) as (pixels x out channels) rows, the output likewise, channels-last. A layer it
    does not take at this shape (an engine's dynamic dimension away from the tuned one) runs
    the exact default kernel."""
    kern = lib.kernels[kernel]
    window, _, stride = kern["conv"]
    x_shape, w_shape = tuple(x_q.shape), tuple(w_q.shape)
    layer = None
    if len(x_shape) == 4 and len(w_shape) == 4 and x_shape[1] == w_shape[1]:
        layer = _window(x_shape, w_shape, attrs)
    ok = layer is not None and layer[0] == f"{window}x{window}s{stride}"
    if ok:
        pixels = x_shape[0] * layer[1] * layer[2]
        taken = _Layer("channel", pixels, w_shape[0], window * window * w_shape[1], "", "",
                       layer[0], w_shape[1])  # fmt: skip
        ok = _takes(kern, taken) and _fits(taken.m, taken.n, taken.k, kern)
    x_scale, w_scale, y_scale, z_scale = scales
    residual = kern["epilogue"] == "residual"
    if not ok or residual != (z is not None):
        return qconv_act(x_q, x_scale, w_q, w_scale, b, z, y_scale, z_scale, **attrs)

    def sums(xq, wq, _bias, zz, call) -> tuple[torch.Tensor, bool]:  # (b read as given)
        m = wq.shape[0]
        image = xq.permute(0, 2, 3, 1)
        image = image if image.is_contiguous() else image.contiguous()
        taps = _kept(
            w_q, ("cutlass_ohwi", m), lambda: wq.permute(0, 2, 3, 1).reshape(m, -1).contiguous()
        )
        pixels = (xq.shape[0], *call.geometry.out)
        return _run_conv(lib, kernel, image, taps, pixels, b, zz, scales, call)

    return qconv(x_q, x_scale, w_q, w_scale, b, z, y_scale, attrs, sums, z_scale)


def _estimate(kernel: dict, m: int, n: int, k: int) -> float:
    """The autotuner's ranking of a kernel for an M x N x K layer (it times the best few), from
    what won on the H200 (benchmarks/RESULTS.md): a tile as wide as N, or narrower, wastes none
    of its columns, and of those the widest reads A the fewest times; two CTAs an SM keep memory
    busier where tiles are small; on K = 64 layers, 64-byte stages and wider epilogue subtiles
    help; 64-row tiles rarely won; GELU on the hardware's tanh beat the polynomial on every
    GELU GEMM of BERT-base (FP8 and int8), so its tiles come first; a cluster of two CTAs
    along N (A's tiles loaded once for both, multicast) was as fast or faster on BERT-base's
    GEMMs of K = 768 to 3072; kernels that promote their E4M3 sums into float32 every K step
    (``p``) run slower, but over a long K (2,048 and more) they are the ones whose outputs
    pass the autotuner's check, so there they rank first and elsewhere last; kernels that stage
    the epilogue's vectors in shared memory (``v``) rank a little higher where K is short and the
    layer is bound by memory, which the epilogue's reads from global memory would slow."""
    tile_m, tile_n = kernel["tile"]
    score = n / (-(-n // tile_n) * tile_n) * (0.8 + 0.2 * tile_n / 256)  # (wider: fewer loads)
    if kernel.get("occupancy", 1) == 2:
        score *= 1.15
    if k == 64 and kernel.get("k_steps", 4) == 2:
        score *= 1.1
    if k == 64 and kernel.get("epi_tile"):
        score *= 1.05
    if kernel.get("activation") == "gelu_tanh":
        score *= 1.2
    if kernel.get("cluster") == [1, 2]:
        score *= 1.2
    if kernel.get("promote"):
        score *= 1.5 if k >= 2048 else 0.8
    if kernel.get("vectors_in_smem") and k <= 1024:
        score *= 1.1
    return score * (0.9 if tile_m == 64 else 1.0)


def _fits(m: int, n: int, k: int, kernel: dict | None = None) -> bool:
    """Whether an M x N x K GEMM is one the kernels take; with ``kernel``, that one: a cluster
    of CTAs stays inside the matrix (its CTAs share their loads, so none is left without work)."""
    if m % _M_MULTIPLE or n % _NK_MULTIPLE or k % _NK_MULTIPLE or m * max(n, k) >= 2**31:
        return False
    cm, cn = kernel.get("cluster", [1, 1]) if kernel is not None else (1, 1)
    if cm * cn == 1:
        return True
    tile_m, tile_n = kernel["tile"]  # type: ignore[index]
    return not (m % (tile_m * cm) or n % (tile_n * cn))


def _resolver(op: str, fn_of: Callable[[str], Callable]) -> Callable[[str], Tactic | None]:
    made: dict[str, Tactic | None] = {}

    def resolve(name: str) -> Tactic | None:
        if name not in made:
            kernel = name.removeprefix(PREFIX)
            lib = library() if name.startswith(PREFIX) else None
            if lib is None or kernel not in lib.kernels:
                return None  # (not made: a library configured later may have it)

            def supports(spec: LayerSpec, name: str = name) -> bool:
                return name in _kernels_for(spec, fit=False)

            def estimate(spec: LayerSpec, entry: dict = lib.kernels[kernel]) -> float:
                layer = _layer(spec)
                return 0.0 if layer is None else _estimate(entry, layer.m, layer.n, layer.k)

            # (the kernel's object code, where the build recorded its digest: a rebuilt kernel
            # of the same name is timed again, not chosen from a timing cache's old entry)
            version = lib.kernels[kernel].get("sha256")
            made[name] = Tactic(
                name, op, "tensorkiln", fn_of(kernel), supports, estimate, PREFIX, version
            )
        return made[name]

    return resolve


def _register() -> None:
    for op, fn_of in (("QGemmAct", _gemm_fn), ("QConvAct", _conv_fn)):
        missing = f"{ENV} must name the kernel library it was built with, on an sm_90 GPU"
        family = TacticFamily(PREFIX, _kernels_for, _resolver(op, fn_of), missing)
        tactic_family(op, family, domain="tensorkiln")


_register()

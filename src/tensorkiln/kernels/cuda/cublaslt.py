"""cuBLASLt's algorithms as GEMM tactics: those its heuristic offers for a layer's shape, each
timed by the autotuner like any other kernel (TensorRT's cuBLASLt tactic source).

PyTorch's GEMMs run the heuristic's first choice. That choice is often not the fastest on the
shapes transformers run: on an H200 in fp16, for BERT's and GPT-2's projections (M of 7,168 to
49,152 rows, N and K of 768 to 4,096), another of the first eight algorithms ran 3-34% faster
than torch.addmm alone, most where N is 768 or 1,024 and the heuristic's tiles fill the 132 SMs
in a wave and a bit. The tactics call cuBLASLt through ctypes, in the library torch itself
loaded, with the bias and the activation (Relu, the tanh GELU) in the GEMM's epilogue, as
PyTorch's own cuBLASLt path does.

A tactic's name carries the algorithm: ``cublaslt_<cuBLASLt version>_<the 64-byte
cublasLtMatmulAlgo_t in hex>`` (cuBLASLt documents the structure as serializable for reuse with
the same library version). So an engine runs the algorithm that was timed, at other row counts
too (a dynamic batch, padding removal's packed lengths), where the heuristic's list for the
actual shape would differ. Before first use for a shape, cublasLtMatmulAlgoCheck confirms that
the algorithm takes it; where it does not, or the engine came from another cuBLASLt version
(its bytes are never handed to another version), the heuristic's first algorithm runs instead,
which is always valid.

Where cuBLASLt is not found, or a call does not fit (integer or 32-bit operands, a bias that is
not a row vector, strides cuBLAS cannot express), the layer runs torch's GEMM instead; the
tactics' constraint checks keep the autotuner from timing them there.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch

from tensorkiln.errors import KernelError
from tensorkiln.kernels.common import bind
from tensorkiln.kernels.common import gemm as common
from tensorkiln.kernels.cuda.fused_gemm import TorchGemmArrays
from tensorkiln.kernels.cuda.tactics_gemm import gemm_dims
from tensorkiln.kernels.tactics import LayerSpec, Tactic, TacticFamily, tactic_family

log = logging.getLogger(__name__)

ALGOS = 8  # candidates per layer: the heuristic's first ALGOS algorithms
WORKSPACE = 32 << 20  # the most workspace an algorithm may ask (what PyTorch gives cuBLASLt)
PLANS_MAX = 4096  # cached (shape, layout) plans; beyond, a plan is made and dropped per call

# cublasLt.h
_COMPUTE_32F = 68
_R_32F = 0
_DATA_TYPES = {torch.float16: 2, torch.bfloat16: 14}
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_PREF_MAX_WORKSPACE = 1
_PREF_ALIGN = (5, 6, 7, 8)  # minimum alignment of A, B, C, D in bytes
_OP_N, _OP_T = 0, 1
# (activation, with a bias) -> cublasLtEpilogue_t
_EPILOGUES = {
    ("", False): 1,
    ("", True): 4,
    ("Relu", False): 2,
    ("Relu", True): 6,
    ("GeluTanh", False): 32,
    ("GeluTanh", True): 36,
}


class _Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _Heuristic(ctypes.Structure):
    _fields_ = [
        ("algo", _Algo),
        ("workspaceSize", ctypes.c_size_t),
        ("state", ctypes.c_int),
        ("wavesCount", ctypes.c_float),
        ("reserved", ctypes.c_int * 4),
    ]


_vp = ctypes.c_void_p


class _Library:
    """The cuBLASLt entry points this module calls, typed."""

    def __init__(self, path: str) -> None:
        lib = ctypes.CDLL(path)
        self.path = path
        self.create = lib.cublasLtCreate
        self.create.argtypes = [ctypes.POINTER(_vp)]
        self.desc_create = lib.cublasLtMatmulDescCreate
        self.desc_create.argtypes = [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_int]
        self.desc_set = lib.cublasLtMatmulDescSetAttribute
        self.desc_set.argtypes = [_vp, ctypes.c_int, _vp, ctypes.c_size_t]
        self.desc_destroy = lib.cublasLtMatmulDescDestroy
        self.desc_destroy.argtypes = [_vp]
        self.layout_create = lib.cublasLtMatrixLayoutCreate
        self.layout_create.argtypes = [
            ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64,
        ]  # fmt: skip
        self.layout_destroy = lib.cublasLtMatrixLayoutDestroy
        self.layout_destroy.argtypes = [_vp]
        self.pref_create = lib.cublasLtMatmulPreferenceCreate
        self.pref_create.argtypes = [ctypes.POINTER(_vp)]
        self.pref_set = lib.cublasLtMatmulPreferenceSetAttribute
        self.pref_set.argtypes = [_vp, ctypes.c_int, _vp, ctypes.c_size_t]
        self.pref_destroy = lib.cublasLtMatmulPreferenceDestroy
        self.pref_destroy.argtypes = [_vp]
        self.heuristic = lib.cublasLtMatmulAlgoGetHeuristic
        self.heuristic.argtypes = [
            _vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.c_int,
            ctypes.POINTER(_Heuristic), ctypes.POINTER(ctypes.c_int),
        ]  # fmt: skip
        self.matmul = lib.cublasLtMatmul
        self.matmul.argtypes = [
            _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp,
            ctypes.POINTER(_Algo), _vp, ctypes.c_size_t, _vp,
        ]  # fmt: skip
        self.check = lib.cublasLtMatmulAlgoCheck
        self.check.argtypes = [
            _vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(_Algo), ctypes.POINTER(_Heuristic),
        ]  # fmt: skip
        lib.cublasLtGetVersion.restype = ctypes.c_size_t
        self.version = int(lib.cublasLtGetVersion())
        self.handles: dict[int, _vp] = {}

    def handle(self, device: int) -> _vp:
        h = self.handles.get(device)
        if h is None:
            h = _vp()
            with torch.cuda.device(device):
                _check(self.create(ctypes.byref(h)), "cublasLtCreate")
            self.handles[device] = h
        return h


def _check(status: int, what: str) -> None:
    if status != 0:
        raise KernelError(f"cuBLASLt: {what} failed with status {status}")


_LOCK = threading.Lock()  # plans, and a plan's bias pointer between its setting and the call
_state: dict[str, Any] = {}


def library() -> _Library | None:
    """The cuBLASLt that torch loaded (None: no CUDA, or not found)."""
    if "lib" in _state:
        return _state["lib"]
    lib = None
    if torch.cuda.is_available():
        try:
            lib = _Library(_find())
        except (OSError, AttributeError, RuntimeError) as exc:
            log.info("cuBLASLt tactics unavailable: %s", exc)
    _state["lib"] = lib
    return lib


def _find() -> str:
    """The path of the libcublasLt torch loaded (its cuBLAS handle loads it)."""
    torch.cuda.current_blas_handle()
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    return line.split(maxsplit=5)[-1].strip()
    except OSError:
        pass
    import ctypes.util

    found = ctypes.util.find_library("cublasLt")
    if not found:
        raise RuntimeError("libcublasLt is not loaded and not found")
    return found


class _Plan:
    """One problem's descriptors and the heuristic's algorithms for it."""

    def __init__(self, lib: _Library, device: int, key: tuple) -> None:
        dtype, (op_a, ra, ca, lda), (op_b, rb, cb, ldb), (n, m), epilogue, aligns = key
        self.lib = lib
        data = _DATA_TYPES[dtype]
        self.desc, self.a, self.b, self.d = _vp(), _vp(), _vp(), _vp()
        pref = _vp()
        try:
            _check(lib.desc_create(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
            for attr, value in (
                (_DESC_TRANSA, ctypes.c_int32(op_a)),
                (_DESC_TRANSB, ctypes.c_int32(op_b)),
                (_DESC_EPILOGUE, ctypes.c_uint32(epilogue)),
            ):
                _check(
                    lib.desc_set(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    "attribute",
                )
            _check(lib.layout_create(ctypes.byref(self.a), data, ra, ca, lda), "layout A")
            _check(lib.layout_create(ctypes.byref(self.b), data, rb, cb, ldb), "layout B")
            _check(lib.layout_create(ctypes.byref(self.d), data, n, m, n), "layout D")
            _check(lib.pref_create(ctypes.byref(pref)), "preference")
            ws = ctypes.c_uint64(WORKSPACE)
            _check(lib.pref_set(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "workspace")
            for attr, align in zip(_PREF_ALIGN, aligns):
                value = ctypes.c_uint32(align)
                _check(lib.pref_set(pref, attr, ctypes.byref(value), 4), "alignment")
            found = (_Heuristic * ALGOS)()
            count = ctypes.c_int(0)
            _check(
                lib.heuristic(
                    lib.handle(device), self.desc, self.a, self.b, self.d, self.d, pref,
                    ALGOS, found, ctypes.byref(count),
                ),
                "heuristic",
            )  # fmt: skip
        finally:
            if pref:
                lib.pref_destroy(pref)
        self.device = device
        ok = [found[i] for i in range(count.value)]
        ok = [h for h in ok if h.state == 0 and h.workspaceSize <= WORKSPACE]
        self.algos = [h.algo for h in ok]
        self.workspace = {bytes(h.algo): int(h.workspaceSize) for h in ok}  # bytes each needs
        self.checked: dict[bytes, _Algo | None] = {}

    def pick(self, algo: bytes | None) -> tuple[_Algo, int]:
        """The algorithm to run and the workspace it needs: ``algo`` where cuBLASLt confirms it
        takes this problem (checked once), else the heuristic's first."""
        first = self.algos[0]
        if algo is None:
            return first, self.workspace[bytes(first)]
        if algo not in self.checked:
            candidate = _Algo.from_buffer_copy(algo)
            result = _Heuristic()
            status = self.lib.check(
                self.lib.handle(self.device), self.desc, self.a, self.b, self.d, self.d,
                ctypes.byref(candidate), ctypes.byref(result),
            )  # fmt: skip
            ok = status == 0 and result.workspaceSize <= WORKSPACE
            self.checked[algo] = candidate if ok else None
            if ok:
                self.workspace.setdefault(algo, int(result.workspaceSize))
        chosen = self.checked[algo]
        if chosen is None:
            return first, self.workspace[bytes(first)]
        return chosen, self.workspace[algo]

    def release(self) -> None:
        for layout in (self.a, self.b, self.d):
            if layout:
                self.lib.layout_destroy(layout)
        if self.desc:
            self.lib.desc_destroy(self.desc)


def _operand(t: torch.Tensor) -> tuple[int, int, int, int] | None:
    """How cuBLAS (column-major) reads the transpose of row-major ``t`` (R, C): (op, rows,
    cols, ld) of its memory; None where the strides are neither row- nor column-major."""
    r, c = t.shape
    s0, s1 = t.stride()
    if r < 2 or c < 2:
        return None  # (strides of a size-1 dimension are arbitrary)
    if s1 == 1 and s0 >= c:
        return _OP_N, c, r, s0  # its memory, column-major, is t^T (C, R)
    if s0 == 1 and s1 >= r:
        return _OP_T, r, c, s1  # its memory, column-major, is t (R, C); transposed
    return None


def _alignment(*values: int) -> int:
    """The largest power of two up to 256 that divides every one of ``values`` (addresses,
    leading dimensions in bytes)."""
    align = 256
    for v in values:
        if v:
            align = min(align, v & -v)
    return align


def problem(
    a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, activation: str
) -> tuple | None:
    """The plan key of ``act(a @ b + bias)`` for a (M, K) and b (K, N) of one 16-bit dtype and a
    bias of N values (or None), or None where cuBLASLt cannot take it as one call."""
    if a.dtype not in _DATA_TYPES or b.dtype is not a.dtype or a.ndim != 2 or b.ndim != 2:
        return None
    if bias is not None and (bias.dtype is not a.dtype or bias.numel() != b.shape[1]):
        return None
    epilogue = _EPILOGUES.get((activation, bias is not None))
    x, w = _operand(a), _operand(b)
    if epilogue is None or x is None or w is None:
        return None
    m, n = a.shape[0], b.shape[1]
    return (a.dtype, w, x, (n, m), epilogue, _aligns(w[3], x[3], n, b.data_ptr(), a.data_ptr()))


def _aligns(ld_w: int, ld_x: int, n: int, w_ptr: int = 0, x_ptr: int = 0) -> tuple[int, ...]:
    """The alignments of cuBLAS's A (the weights), B (the activations), C and D (a fresh tensor
    of ld ``n``), 2-byte elements: what the heuristic may assume."""
    a = _alignment(w_ptr, 2 * ld_w)
    b = _alignment(x_ptr, 2 * ld_x)
    d = _alignment(2 * n)
    return (a, b, d, d)


def _plan(key: tuple, device: int, make: Callable = _Plan) -> tuple[Any, bool]:
    """The plan for ``key`` on ``device`` (``make(lib, device, key)``: a :class:`_Plan`, or an
    :class:`_Fp8Plan` for keys that start with "fp8") and whether it is cached (else the caller
    releases it after its call)."""
    lib = library()
    if lib is None:
        return None, False
    full = (device, *key)
    with _LOCK:
        plans: dict = _state.setdefault("plans", {})
        plan = plans.get(full)
        if plan is not None:
            return plan, True
        plan = make(lib, device, key)
        if len(plans) < PLANS_MAX:
            plans[full] = plan
            return plan, True
        return plan, False


def matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    bias: torch.Tensor | None,
    alpha: float,
    activation: str,
    algo: bytes | None = None,
    residual: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """``act(alpha * a @ b + bias)`` by cuBLASLt's algorithm ``algo`` (a serialized
    cublasLtMatmulAlgo_t; None or one that does not take the problem: the heuristic's first);
    with ``residual`` (M, N) and no activation, ``alpha * a @ b + bias + residual`` (cuBLASLt's C
    with beta 1: the sum written once, not the product and then the sum); None where cuBLASLt
    cannot run it (the caller computes it otherwise)."""
    if not a.is_cuda:
        return None
    if bias is not None:
        bias = bias.reshape(-1)
        if not bias.is_contiguous():
            return None
    key = problem(a, b, bias, activation)
    if key is None:
        return None
    if residual is not None and not _takes_residual(residual, a, b, activation, key[5][2]):
        return None
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    plan, cached = _plan(key, device)
    if plan is None:
        return None
    if not plan.algos:
        if not cached:
            plan.release()
        return None
    lib = plan.lib
    out = torch.empty((a.shape[0], b.shape[1]), dtype=a.dtype, device=a.device)
    stream = torch.cuda.current_stream(a.device).cuda_stream
    scale, zero = ctypes.c_float(alpha), ctypes.c_float(0.0 if residual is None else 1.0)
    c_ptr = out.data_ptr() if residual is None else residual.data_ptr()
    with _LOCK:
        chosen, size = plan.pick(algo)
        # (from the caching allocator, on this stream: freed once the GEMM is queued, reused by
        # later work on the stream only; most algorithms need none)
        ws = torch.empty(size, dtype=torch.uint8, device=a.device) if size else None
        if bias is not None:
            ptr = _vp(bias.data_ptr())
            _check(
                lib.desc_set(plan.desc, _DESC_BIAS_POINTER, ctypes.byref(ptr), ctypes.sizeof(ptr)),
                "bias",
            )
        status = lib.matmul(
            lib.handle(device), plan.desc, ctypes.byref(scale),
            b.data_ptr(), plan.a, a.data_ptr(), plan.b, ctypes.byref(zero),
            c_ptr, plan.d, out.data_ptr(), plan.d,
            ctypes.byref(chosen), ws.data_ptr() if ws is not None else None, size, stream,
        )  # fmt: skip
    if not cached:
        plan.release()
    _check(status, f"matmul of {tuple(a.shape)} x {tuple(b.shape)}")
    return out


# FP8 (E4M3) GEMMs: cublasLt.h's scale pointers and types
_E4M3 = 28
_DESC_A_SCALE, _DESC_B_SCALE, _DESC_D_SCALE, _DESC_FAST_ACCUM, _DESC_BIAS_TYPE = 17, 18, 20, 25, 26
_FP8_OUT = {torch.float16: 2, torch.bfloat16: 14, torch.float8_e4m3fn: _E4M3}


def fp8_matmul(
    a: torch.Tensor,
    w: torch.Tensor,
    a_scale: torch.Tensor,
    w_scale: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    activation: str = "",
    out_dtype: torch.dtype = torch.float16,
    y_scale: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor | None:
    """``act(a_scale * w_scale * a @ w.T + bias)`` in one cuBLASLt call for E4M3 ``a`` (M, K)
    and ``w`` (N, K), both row-major, per-tensor float32 scales (one value each, on the GPU), a
    16-bit ``bias`` of N values and an activation of cuBLASLt's epilogue ("", "Relu",
    "GeluTanh"). ``out_dtype`` float16 or bfloat16, or E4M3 with ``y_scale``: the result is
    quantized to it (divided by it, saturated) in the epilogue. ``fast_accum``: Hopper's FP8
    accumulation without the periodic promotion to float32 (faster, less exact). The
    heuristic's first algorithm runs. None where cuBLASLt cannot run it (no cuBLASLt, other
    types or layouts)."""
    lib = library()
    if lib is None or not a.is_cuda or a.dtype != torch.float8_e4m3fn or w.dtype != a.dtype:
        return None
    if a.ndim != 2 or w.ndim != 2 or a.shape[1] != w.shape[1] or out_dtype not in _FP8_OUT:
        return None
    if not (a.is_contiguous() and w.is_contiguous()) or (out_dtype == a.dtype) != (
        y_scale is not None
    ):
        return None
    m, k = a.shape
    n = w.shape[0]
    c_dtype = torch.bfloat16 if out_dtype == torch.bfloat16 else torch.float16
    if bias is not None and (bias.dtype != c_dtype or bias.numel() != n):
        return None
    epilogue = _EPILOGUES.get((activation, bias is not None))
    if epilogue is None or k % 16 or n % 16:
        return None
    device = a.device.index if a.device.index is not None else torch.cuda.current_device()
    key = ("fp8", m, n, k, out_dtype, c_dtype, epilogue, bias is not None, fast_accum)
    plan, cached = _plan(key, device, _Fp8Plan)
    if plan.algo is None:
        if not cached:
            plan.release()
        return None
    # (D of E4M3 takes a C of its own: C and D may be one buffer only with one layout; with
    # beta 0 nothing reads it)
    out = torch.empty((m, n), dtype=out_dtype, device=a.device)
    c = out if out_dtype == c_dtype else torch.empty((m, n), dtype=c_dtype, device=a.device)
    d_scale = None if y_scale is None else torch.reciprocal(y_scale.reshape(1).float())
    size = plan.workspace
    space = torch.empty(size, dtype=torch.uint8, device=a.device) if size else None
    one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
    pointers = [(_DESC_A_SCALE, w_scale), (_DESC_B_SCALE, a_scale), (_DESC_D_SCALE, d_scale),
                (_DESC_BIAS_POINTER, bias)]  # fmt: skip
    with _LOCK:  # (the pointers stay set on the shared descriptor until the call is queued)
        for attr, t in pointers:
            if t is not None:
                ptr = _vp(t.data_ptr())
                _check(lib.desc_set(plan.desc, attr, ctypes.byref(ptr), 8), "pointer")
        status = lib.matmul(
            lib.handle(device), plan.desc, ctypes.byref(one), w.data_ptr(), plan.a,
            a.data_ptr(), plan.b, ctypes.byref(zero), c.data_ptr(), plan.c, out.data_ptr(),
            plan.d, ctypes.byref(plan.algo), space.data_ptr() if space is not None else None,
            size, torch.cuda.current_stream(a.device).cuda_stream,
        )  # fmt: skip
    if not cached:
        plan.release()
    _check(status, f"FP8 matmul of {tuple(a.shape)} x {tuple(w.shape)}")
    return out


class _Fp8Plan:
    """One FP8 problem's descriptors and the heuristic's first algorithm (None: none takes it)."""

    def __init__(self, lib: _Library, device: int, key: tuple) -> None:
        _, m, n, k, out_dtype, c_dtype, epilogue, has_bias, fast = key
        self.lib = lib
        self.desc, self.a, self.b, self.c, self.d = _vp(), _vp(), _vp(), _vp(), _vp()
        self.algo: _Algo | None = None
        self.workspace = 0
        pref = _vp()
        try:
            _check(lib.desc_create(ctypes.byref(self.desc), _COMPUTE_32F, _R_32F), "desc")
            attrs: list = [
                (_DESC_TRANSA, ctypes.c_int32(_OP_T)),
                (_DESC_TRANSB, ctypes.c_int32(_OP_N)),
                (_DESC_EPILOGUE, ctypes.c_uint32(epilogue)),
            ]
            if has_bias:
                attrs.append((_DESC_BIAS_TYPE, ctypes.c_int32(_DATA_TYPES[c_dtype])))
            if fast:
                attrs.append((_DESC_FAST_ACCUM, ctypes.c_int8(1)))
            for attr, value in attrs:
                _check(
                    lib.desc_set(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                    "attribute",
                )
            # the scale pointers are part of the problem the heuristic answers: set now (to a
            # placeholder address, never read), each call sets the real ones
            scales = [_DESC_A_SCALE, _DESC_B_SCALE]
            if out_dtype == torch.float8_e4m3fn:
                scales.append(_DESC_D_SCALE)
            for attr in scales:
                placeholder = _vp(256)
                _check(lib.desc_set(self.desc, attr, ctypes.byref(placeholder), 8), "scale")
            _check(lib.layout_create(ctypes.byref(self.a), _E4M3, k, n, k), "layout A")
            _check(lib.layout_create(ctypes.byref(self.b), _E4M3, k, m, k), "layout B")
            cd = _DATA_TYPES[c_dtype]
            _check(lib.layout_create(ctypes.byref(self.c), cd, n, m, n), "layout C")
            _check(lib.layout_create(ctypes.byref(self.d), _FP8_OUT[out_dtype], n, m, n), "D")
            _check(lib.pref_create(ctypes.byref(pref)), "preference")
            ws = ctypes.c_uint64(WORKSPACE)
            _check(lib.pref_set(pref, _PREF_MAX_WORKSPACE, ctypes.byref(ws), 8), "workspace")
            found = (_Heuristic * 1)()
            count = ctypes.c_int(0)
            status = lib.heuristic(
                lib.handle(device), self.desc, self.a, self.b, self.c, self.d, pref, 1, found,
                ctypes.byref(count),
            )  # fmt: skip
            if status == 0 and count.value > 0 and found[0].workspaceSize <= WORKSPACE:
                self.algo = found[0].algo
                self.workspace = int(found[0].workspaceSize)
        finally:
            if pref:
                lib.pref_destroy(pref)

    def release(self) -> None:
        for layout in (self.a, self.b, self.c, self.d):
            if layout:
                self.lib.layout_destroy(layout)
        if self.desc:
            self.lib.desc_destroy(self.desc)


def _takes_residual(
    r: torch.Tensor, a: torch.Tensor, b: torch.Tensor, activation: str, align: int
) -> bool:
    """Whether ``r`` goes in as cuBLASLt's C: (M, N) row-major like the output, of its dtype and
    device, at least as aligned as the plan assumed of C, with no activation after the sum."""
    if activation or r.dtype is not a.dtype or r.device != a.device or r.ndim != 2:
        return False
    if tuple(r.shape) != (a.shape[0], b.shape[1]) or not r.is_contiguous():
        return False
    return _alignment(r.data_ptr(), 2 * r.shape[1]) >= align


class _LtGemmArrays(TorchGemmArrays):
    """Gemm arrays whose float products run cuBLASLt's algorithm ``algo`` (serialized)."""

    def __init__(self, algo: bytes | None) -> None:
        self.algo = algo

    def affine(self, a, b, bias, alpha, beta, act, dtype):
        activation = act[0]
        if activation == "Gelu":  # (the tactic applies only where the tanh form is tolerated)
            activation = "GeluTanh"
        plain = all(x is None for x in act[1:])
        if plain and (bias is None or beta == 1.0):
            y = self._matmul(a, b, bias, alpha, activation, dtype)
            if y is not None:
                return y
        return super().affine(a, b, bias, alpha, beta, act, dtype)

    def affine_residual(self, a, b, bias, alpha, beta, dtype, z):
        if bias is not None and beta != 1.0:
            return None
        return self._matmul(a, b, bias, alpha, "", dtype, z)

    def _matmul(self, a, b, bias, alpha, activation, dtype, residual=None):
        """:func:`matmul` with this algorithm, B and the bias in ``dtype``."""
        b = b if b.dtype is dtype else b.to(dtype)
        if bias is not None:
            bias = bias if bias.dtype is dtype else bias.to(dtype)
        return matmul(a, b, bias, alpha, activation, self.algo, residual=residual)


def _layer_algos(spec: LayerSpec) -> list[_Algo] | None:
    """The heuristic's algorithms for a 16-bit float GEMM layer on a GPU whose bias (if any) is
    a row vector added once and whose activation cuBLASLt's epilogue computes, at the spec's
    shapes, operands as the layer holds them; None for any other layer."""
    if spec.device != "cuda" or library() is None or None in spec.shapes[:2]:
        return None
    dims = gemm_dims(spec)
    dtypes = {d for d in spec.dtypes[:3] if d is not None}
    if dims is None or min(dims) < 2 or len(dtypes) != 1:
        return None
    dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(dtypes.pop())
    activation = spec.attrs.get("activation", "")
    if dtype is None or activation not in ("", "Relu", "GeluTanh", "Gelu"):
        return None
    if any(spec.attrs.get(k) is not None for k in ("activation_alpha", "activation_beta")):
        return None
    m, n, k = dims
    bias = spec.shapes[2] if len(spec.shapes) > 2 else None
    if bias is not None and (
        spec.attrs.get("beta", 1.0) != 1.0 or tuple(bias) not in ((n,), (1, n))
    ):
        return None
    w = (_OP_T, k, n, k) if spec.attrs.get("transB", 0) else (_OP_N, n, k, n)
    x = (_OP_T, m, k, m) if spec.attrs.get("transA", 0) else (_OP_N, k, m, k)
    epilogue = _EPILOGUES[("GeluTanh" if activation == "Gelu" else activation, bias is not None)]
    key = (dtype, w, x, (n, m), epilogue, _aligns(w[3], x[3], n))
    plan, cached = _plan(key, torch.cuda.current_device())
    if plan is None:
        return None
    if not cached:
        plan.release()
    return plan.algos


PREFIX = "cublaslt_"


def algorithm_name(algo: _Algo, version: int) -> str:
    """A tactic's name for ``algo``: the prefix, the cuBLASLt version, the structure's bytes in
    hex (trailing zeros dropped)."""
    return f"{PREFIX}{version}_{bytes(algo).hex().rstrip('0') or '0'}"


def parse_name(name: str) -> tuple[int, bytes] | None:
    """(version, algorithm bytes) of a name :func:`algorithm_name` made; None for any other."""
    version, _, text = name.removeprefix(PREFIX).partition("_")
    size = ctypes.sizeof(_Algo)
    if not version.isdigit() or not text or len(text) > 2 * size:
        return None
    try:
        raw = bytes.fromhex(text.ljust(2 * size, "0"))
    except ValueError:
        return None
    return int(version), raw


def _expand(spec: LayerSpec) -> list[str]:
    algos = _layer_algos(spec)
    version = library().version if algos else 0  # type: ignore[union-attr]
    return [algorithm_name(a, version) for a in algos or ()]


def _applies(spec: LayerSpec) -> bool:
    return _layer_algos(spec) is not None


def _make(op: str, domain: str, fn_of: Callable[[_LtGemmArrays], Callable]):
    """The family's resolver for ``op``: a name -> its tactic (made once per name)."""
    made: dict[str, Tactic | None] = {}

    def resolve(name: str) -> Tactic | None:
        if name not in made:
            parsed = parse_name(name)
            if parsed is None:
                made[name] = None
            else:
                version, raw = parsed
                lib = library()
                # (another version's bytes are not handed to this library: its first algorithm)
                same = lib is not None and lib.version == version
                fn = fn_of(_LtGemmArrays(raw if same else None))
                made[name] = Tactic(name, op, domain, fn, _applies, None, name)
        return made[name]

    return resolve


def _register() -> None:
    fused = _make("GemmAct", "tensorkiln", lambda xp: bind(common.gemm_act, xp, __name__))
    plain = _make("Gemm", "", lambda xp: bind(common.gemm, xp, __name__))
    tactic_family("GemmAct", TacticFamily(PREFIX, _expand, fused), domain="tensorkiln")
    tactic_family("Gemm", TacticFamily(PREFIX, _expand, plain))


_register()

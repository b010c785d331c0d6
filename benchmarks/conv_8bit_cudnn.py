"""Whether cuDNN's own 8-bit convolutions carry ResNet-50 past its fp16 ones on this GPU: each
of ResNet-50's convolution shapes at batch 256 (channels-last) through cuDNN's graph API (the
backend descriptors, called through ctypes) with FP8 E4M3 or INT8 operands, against torch's
fp16 convolution (cuDNN, channels-last, ``cudnn.benchmark``).

    python benchmarks/conv_8bit_cudnn.py [--batch 256] [--reps 30] [--variants fp8,fp8_epi,int8]
        [--plans 8]

Variants (each one cuDNN operation graph; its engines come from cuDNN's heuristics, the first
``--plans`` that build are timed and the fastest kept):
- ``fp8``: E4M3 input and weights, float accumulation, the product times the two scales
  (``alpha``) written as fp16;
- ``fp8_epi``: the same with the layer's epilogue fused: a float product, times the scales,
  plus a per-channel bias, ReLU, fp16 out (what an engine's convolution layer needs);
- ``fp8_out8``: the epilogue with an E4M3 output (the next layer's input, quantized in place);
- ``int8``: INT8 input and weights, int32 accumulation, float product times the scales, fp16 out.

``fp8`` and ``int8`` are compared with the bare fp16 convolution, the others with fp16's
convolution, bias and ReLU (torch runs them as separate kernels). Every variant's output is
first checked against torch's float32 convolution of the same 8-bit
values (dequantized), to 1e-2 relative L2 (one E4M3 step for ``fp8_out8``); a variant that
disagrees is reported, not timed. Times: the median of ``--reps`` calls between CUDA events.
The last table weighs each shape by how often ResNet-50 runs it (the stem's 7x7 convolution on
3 channels is left out: it is not an 8-bit candidate).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks._common import norm_rel_torch  # noqa: E402

# ResNet-50 (torchvision, stride on the 3x3): (in channels, out channels, kernel, stride, input
# height and width, how many times the network runs it)
SHAPES = (
    (64, 64, 1, 1, 56, 1), (64, 64, 3, 1, 56, 3), (64, 256, 1, 1, 56, 4), (256, 64, 1, 1, 56, 2),
    (256, 128, 1, 1, 56, 1), (128, 128, 3, 2, 56, 1), (128, 512, 1, 1, 28, 4),
    (256, 512, 1, 2, 56, 1), (512, 128, 1, 1, 28, 3), (128, 128, 3, 1, 28, 3),
    (512, 256, 1, 1, 28, 1), (256, 256, 3, 2, 28, 1), (256, 1024, 1, 1, 14, 6),
    (512, 1024, 1, 2, 28, 1), (1024, 256, 1, 1, 14, 5), (256, 256, 3, 1, 14, 5),
    (1024, 512, 1, 1, 14, 1), (512, 512, 3, 2, 14, 1), (512, 2048, 1, 1, 7, 3),
    (1024, 2048, 1, 2, 14, 1), (2048, 512, 1, 1, 7, 2), (512, 512, 3, 1, 7, 2),
)  # fmt: skip

# cuDNN 9's graph API (cudnn_graph.h)
FLOAT, HALF, INT8, INT32, E4M3 = 0, 2, 3, 4, 12
T_HANDLE, T_DTYPE, T_BOOL, T_INT64, T_FLOAT, T_VOIDP, T_CONVMODE, T_HEUR, T_PWMODE, T_DESC = (
    0, 1, 2, 3, 4, 6, 7, 8, 14, 15,
)  # fmt: skip
D_POINTWISE, D_CONV, D_ENGINECFG, D_HEUR, D_PLAN = 0, 1, 3, 4, 5
D_OP_CONV_FWD, D_OP_POINTWISE, D_OPGRAPH, D_VARPACK, D_TENSOR = 10, 13, 15, 16, 17
PW_ADD, PW_MUL, PW_RELU = 0, 1, 100


class CudnnError(RuntimeError):
    pass


class Cudnn:
    """The few backend calls a convolution graph needs."""

    def __init__(self) -> None:
        import torch

        # (torch loads cuDNN on its first convolution; the same library is then opened here)
        x = torch.zeros(1, 8, 4, 4, device="cuda", dtype=torch.half)
        torch.nn.functional.conv2d(x, torch.zeros(8, 8, 1, 1, device="cuda", dtype=torch.half))
        for name in ("libcudnn.so.9", "libcudnn_graph.so.9"):
            try:
                self.lib = ctypes.CDLL(name)
                self.lib.cudnnBackendCreateDescriptor  # noqa: B018 (present?)
                break
            except (OSError, AttributeError):
                continue
        else:
            raise CudnnError("cuDNN 9 (libcudnn.so.9) could not be opened")
        self.lib.cudnnGetVersion.restype = ctypes.c_size_t
        self.version = self.lib.cudnnGetVersion()
        self.handle = ctypes.c_void_p()
        self.check(self.lib.cudnnCreate(ctypes.byref(self.handle)), "cudnnCreate")
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        self.check(self.lib.cudnnSetStream(self.handle, stream), "cudnnSetStream")

    def check(self, status: int, what: str) -> None:
        if status:
            msg = ctypes.create_string_buffer(1024)
            self.lib.cudnnGetLastErrorString(msg, ctypes.c_size_t(1024))
            raise CudnnError(f"{what}: status {status}: {msg.value.decode(errors='replace')}")

    def desc(self, kind: int, attrs: list, finalize: bool = True) -> ctypes.c_void_p:
        d = ctypes.c_void_p()
        self.check(self.lib.cudnnBackendCreateDescriptor(kind, ctypes.byref(d)), f"create {kind}")
        for name, typ, values in attrs:
            ctype = {
                T_HANDLE: ctypes.c_void_p, T_DTYPE: ctypes.c_int32, T_BOOL: ctypes.c_bool,
                T_INT64: ctypes.c_int64, T_FLOAT: ctypes.c_float, T_VOIDP: ctypes.c_void_p,
                T_CONVMODE: ctypes.c_int32, T_HEUR: ctypes.c_int32, T_PWMODE: ctypes.c_int32,
                T_DESC: ctypes.c_void_p,
            }[typ]  # fmt: skip
            values = [v.value if isinstance(v, ctypes.c_void_p) else v for v in values]
            arr = (ctype * len(values))(*values)
            self.check(
                self.lib.cudnnBackendSetAttribute(d, name, typ, ctypes.c_int64(len(values)), arr),
                f"set attribute {name} of descriptor kind {kind}",
            )
        if finalize:
            self.check(self.lib.cudnnBackendFinalize(d), f"finalize descriptor kind {kind}")
        return d

    def tensor(self, uid: int, dtype: int, dims: list, strides: list, virtual: bool = False):
        attrs = [
            (901, T_DTYPE, [dtype]), (902, T_INT64, dims), (903, T_INT64, strides),
            (906, T_INT64, [uid]), (900, T_INT64, [16]),
        ]  # fmt: skip
        if virtual:
            attrs.append((907, T_BOOL, [True]))
        return self.desc(D_TENSOR, attrs)

    def pointwise(self, mode: int, x, y, b=None):
        pw = self.desc(D_POINTWISE, [(0, T_PWMODE, [mode]), (1, T_DTYPE, [FLOAT])])
        attrs = [(750, T_DESC, [pw]), (751, T_DESC, [x]), (753, T_DESC, [y])]
        if b is not None:
            attrs.append((752, T_DESC, [b]))
        return self.desc(D_OP_POINTWISE, attrs)

    def plans(self, ops: list, limit: int) -> list[tuple[ctypes.c_void_p, int]]:
        """Execution plans of cuDNN's heuristics for the graph of ``ops``, with workspace sizes
        (those that fail to build are skipped)."""
        graph = self.desc(D_OPGRAPH, [(800, T_HANDLE, [self.handle]), (801, T_DESC, ops)])
        cfgs: list = []
        for mode in (0, 2):  # (cuDNN's instant heuristics, then its fallback list)
            heur = self.desc(D_HEUR, [(201, T_DESC, [graph]), (200, T_HEUR, [mode])])
            made = [self.desc(D_ENGINECFG, [], finalize=False) for _ in range(limit)]
            arr = (ctypes.c_void_p * limit)(*[c.value for c in made])
            count = ctypes.c_int64()
            self.check(
                self.lib.cudnnBackendGetAttribute(
                    heur, 202, T_DESC, ctypes.c_int64(limit), ctypes.byref(count), arr
                ),
                "heuristics' results",
            )
            cfgs += made[: count.value]
        out, errors = [], []
        for cfg in cfgs[: 2 * limit]:
            try:
                plan = self.desc(D_PLAN, [(400, T_HANDLE, [self.handle]), (401, T_DESC, [cfg])])
            except CudnnError as exc:
                errors.append(str(exc))
                continue
            ws = ctypes.c_int64()
            n = ctypes.c_int64()
            self.check(
                self.lib.cudnnBackendGetAttribute(
                    plan, 402, T_INT64, ctypes.c_int64(1), ctypes.byref(n), ctypes.byref(ws)
                ),
                "workspace size",
            )
            out.append((plan, ws.value))
        if not out:
            raise CudnnError(
                f"none of {len(cfgs)} engine configurations built"
                + (f"; first error: {errors[0]}" if errors else "")
            )
        return out

    def pack(self, uids: list[int], ptrs: list[int], workspace: int) -> ctypes.c_void_p:
        """A variant pack: the graph's tensors' unique ids and their device pointers."""
        return self.desc(
            D_VARPACK,
            [(1000, T_INT64, uids), (1001, T_VOIDP, ptrs), (1003, T_VOIDP, [workspace or None])],
        )

    def execute(self, plan: ctypes.c_void_p, pack: ctypes.c_void_p) -> None:
        self.check(self.lib.cudnnBackendExecute(self.handle, plan, pack), "execute")


def _nhwc(n: int, c: int, h: int, w: int) -> tuple[list, list]:
    return [n, c, h, w], [h * w * c, 1, w * c, c]


def _time(fn, reps: int, inner: int = 5) -> float:
    """Milliseconds a call: the median over ``reps`` of ``inner`` calls between two events (the
    GPU runs ahead of the launches, so their host cost stays out)."""
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def _variant(cd: Cudnn, kind: str, shape: tuple, batch: int, args: argparse.Namespace):
    """(time in ms, relative L2 error) of one variant on one shape, or a string saying why not."""
    import torch

    cin, cout, k, stride, hw, _ = shape
    pad = k // 2
    out_hw = (hw + 2 * pad - k) // stride + 1
    g = torch.Generator(device="cuda").manual_seed(hash((kind, shape)) & 0xFFFF)
    x32 = torch.randn(batch, cin, hw, hw, device="cuda", generator=g)
    w32 = torch.randn(cout, cin, k, k, device="cuda", generator=g) / (cin * k * k) ** 0.5
    bias = torch.randn(cout, device="cuda", generator=g) * 0.1
    eight = torch.int8 if kind == "int8" else torch.float8_e4m3fn
    top = 127.0 if kind == "int8" else 448.0
    sx, sw = float(x32.abs().max()) / top, float(w32.abs().max()) / top
    if kind == "int8":
        xq = (x32 / sx).round().clamp(-127, 127).to(torch.int8)
        wq = (w32 / sw).round().clamp(-127, 127).to(torch.int8)
    else:
        xq, wq = (x32 / sx).to(eight), (w32 / sw).to(eight)
    xq = xq.contiguous(memory_format=torch.channels_last)
    wq = wq.contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.conv2d(
        xq.float() * sx, wq.float() * sw, stride=stride, padding=pad
    )  # (float32, from the same 8-bit values)
    epi = kind in ("fp8_epi", "fp8_out8")
    if epi:
        ref = torch.relu(ref + bias.view(1, -1, 1, 1))
    out8 = kind == "fp8_out8"
    sy = float(ref.abs().max()) / 448.0 if out8 else 1.0
    y = torch.empty(
        batch, cout, out_hw, out_hw, device="cuda",
        dtype=torch.float8_e4m3fn if out8 else torch.half,
    ).contiguous(memory_format=torch.channels_last)  # fmt: skip

    dtype8 = INT8 if kind == "int8" else E4M3
    xd = cd.tensor(1, dtype8, *_nhwc(batch, cin, hw, hw))
    wd = cd.tensor(2, dtype8, *_nhwc(cout, cin, k, k))
    conv = cd.desc(
        D_CONV,
        [(100, T_DTYPE, [INT32 if kind == "int8" else FLOAT]), (101, T_CONVMODE, [1]),
         (106, T_INT64, [2]), (102, T_INT64, [1, 1]), (103, T_INT64, [stride, stride]),
         (105, T_INT64, [pad, pad]), (104, T_INT64, [pad, pad])],
    )  # fmt: skip
    ydims = _nhwc(batch, cout, out_hw, out_hw)
    uids, ptrs = [1, 2], [xq.data_ptr(), wq.data_ptr()]
    if not epi:
        yd = cd.tensor(3, HALF, *ydims)
        alpha = sx * sw
        ops = [
            cd.desc(
                D_OP_CONV_FWD,
                [(704, T_DESC, [xd]), (703, T_DESC, [wd]), (705, T_DESC, [yd]),
                 (702, T_DESC, [conv]), (700, T_FLOAT, [alpha]), (701, T_FLOAT, [0.0])],
            )
        ]  # fmt: skip
        uids.append(3)
        ptrs.append(y.data_ptr())
    else:
        acc = cd.tensor(10, FLOAT, *ydims, virtual=True)
        scaled = cd.tensor(11, FLOAT, *ydims, virtual=True)
        biased = cd.tensor(12, FLOAT, *ydims, virtual=True)
        scale_t = torch.tensor([sx * sw], device="cuda").view(1, 1, 1, 1)
        bias_t = bias.view(1, cout, 1, 1).contiguous()
        sd = cd.tensor(4, FLOAT, [1, 1, 1, 1], [1, 1, 1, 1])
        bd = cd.tensor(5, FLOAT, [1, cout, 1, 1], [cout, 1, 1, 1])
        ops = [
            cd.desc(
                D_OP_CONV_FWD,
                [(704, T_DESC, [xd]), (703, T_DESC, [wd]), (705, T_DESC, [acc]),
                 (702, T_DESC, [conv]), (700, T_FLOAT, [1.0]), (701, T_FLOAT, [0.0])],
            ),
            cd.pointwise(PW_MUL, acc, scaled, sd),
            cd.pointwise(PW_ADD, scaled, biased, bd),
        ]  # fmt: skip
        uids += [4, 5]
        ptrs += [scale_t.data_ptr(), bias_t.data_ptr()]
        if out8:
            relu = cd.tensor(13, FLOAT, *ydims, virtual=True)
            inv_t = torch.tensor([1.0 / sy], device="cuda").view(1, 1, 1, 1)
            invd = cd.tensor(6, FLOAT, [1, 1, 1, 1], [1, 1, 1, 1])
            yd = cd.tensor(3, E4M3, *ydims)
            ops += [cd.pointwise(PW_RELU, biased, relu), cd.pointwise(PW_MUL, relu, yd, invd)]
            uids.append(6)
            ptrs.append(inv_t.data_ptr())
        else:
            yd = cd.tensor(3, HALF, *ydims)
            ops.append(cd.pointwise(PW_RELU, biased, yd))
        uids.append(3)
        ptrs.append(y.data_ptr())
    try:
        plans = cd.plans(ops, args.plans)
    except CudnnError as exc:
        return f"no plan: {exc}"
    best = None
    for plan, ws in plans:
        workspace = torch.empty(max(ws, 1), dtype=torch.uint8, device="cuda")
        wptr = workspace.data_ptr() if ws else 0
        try:
            pack = cd.pack(uids, ptrs, wptr)
            y.view(torch.uint8 if y.element_size() == 1 else torch.int16).zero_()
            cd.execute(plan, pack)
            torch.cuda.synchronize()
        except CudnnError as exc:
            best = best or f"execute failed: {exc}"
            continue
        err = norm_rel_torch([y.float() * sy], [ref])
        tolerance = 0.07 if out8 else 1e-2
        if not err <= tolerance:
            best = best if isinstance(best, tuple) else f"wrong: rel. L2 {err:.2e}"
            continue
        ms = _time(lambda p=plan, v=pack: cd.execute(p, v), args.reps)
        if not isinstance(best, tuple) or ms < best[0]:
            best = (ms, err)
    return best or "no plan ran"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--variants", default="fp8,fp8_epi,fp8_out8,int8")
    ap.add_argument("--plans", type=int, default=8)
    ap.add_argument("--shapes", type=int, default=len(SHAPES), help="the first N shapes only")
    args = ap.parse_args()
    import torch

    torch.backends.cudnn.benchmark = True
    cd = Cudnn()
    print(f"cuDNN {cd.version}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    variants = [v for v in args.variants.split(",") if v]
    totals = {"fp16": 0.0, "fp16_epi": 0.0, **{v: 0.0 for v in variants}}
    complete = dict.fromkeys(variants, True)
    header = ["shape", "x", "fp16 ms", "fp16+bias+ReLU ms"] + [f"{v} ms" for v in variants]
    print(" | ".join(header))
    for shape in SHAPES[: args.shapes]:
        cin, cout, k, stride, hw, count = shape
        pad = k // 2
        x = torch.randn(args.batch, cin, hw, hw, device="cuda", dtype=torch.half)
        x = x.contiguous(memory_format=torch.channels_last)
        w = torch.randn(cout, cin, k, k, device="cuda", dtype=torch.half) / (cin * k * k) ** 0.5
        w = w.contiguous(memory_format=torch.channels_last)
        b = torch.randn(cout, device="cuda", dtype=torch.half)
        fp16 = _time(
            lambda x=x, w=w, s=stride, p=pad: torch.nn.functional.conv2d(x, w, stride=s, padding=p),
            args.reps,
        )
        fp16_epi = _time(
            lambda x=x, w=w, b=b, s=stride, p=pad: torch.relu_(
                torch.nn.functional.conv2d(x, w, b, stride=s, padding=p)
            ),
            args.reps,
        )
        totals["fp16"] += count * fp16
        totals["fp16_epi"] += count * fp16_epi
        cells = [f"{cin}->{cout} {k}x{k}/{stride} @{hw}", str(count), f"{fp16:.3f}",
                 f"{fp16_epi:.3f}"]  # fmt: skip
        for v in variants:
            try:
                got = _variant(cd, v, shape, args.batch, args)
            except CudnnError as exc:
                got = f"error: {exc}"
            if isinstance(got, tuple):
                totals[v] += count * got[0]
                base = fp16 if v in ("fp8", "int8") else fp16_epi
                cells.append(f"{got[0]:.3f} ({base / got[0]:.2f}x, err {got[1]:.1e})")
            else:
                complete[v] = False
                cells.append(got[:300])
        print(" | ".join(cells), flush=True)
    print(f"\nResNet-50's convolutions but the stem, batch {args.batch}, weighted by use:")
    print(f"  fp16 (torch, cuDNN): {totals['fp16']:.2f} ms")
    print(f"  fp16 with bias and ReLU (torch, cuDNN): {totals['fp16_epi']:.2f} ms")
    for v in variants:
        base = totals["fp16"] if v in ("fp8", "int8") else totals["fp16_epi"]
        if complete[v]:
            print(f"  {v}: {totals[v]:.2f} ms ({base / totals[v]:.2f}x)")
        else:
            print(f"  {v}: not every shape ran")


if __name__ == "__main__":
    main()

"""Whether Hopper WGMMA GEMMs of CUTLASS's kind carry 8-bit layers past fp16 on this GPU: the
kernels compiled ahead of time by ``benchmarks/cutlass_gemm_build.py`` (FP8 E4M3 operands, the
scale and ReLU in the epilogue, an E4M3 or fp16 output; the same kernel in fp16 for comparison)
against cuBLAS's fp16 GEMM, ``torch._scaled_mm`` and, for ResNet-50's layers, the fp16
convolution the fp16 engine runs (cuDNN, channels-last).

    python benchmarks/cutlass_gemm.py [--lib build/cutlass_gemm] [--reps 30] [--batch 256]

Shapes: ResNet-50's convolutions but the stem at ``--batch`` (a k x k convolution as the GEMM
M = batch * output pixels, N = out channels, K = k * k * in channels; for 3x3 layers that GEMM
reads an explicit im2col matrix, nine times the input, so it bounds what an implicit-GEMM
kernel with the same main loop would take) and BERT-base's four GEMMs at 64 x 128 tokens.
Every CUTLASS result is first checked against float32 arithmetic on the same 8-bit values (one
E4M3 step in relative L2 for an E4M3 output, 2e-3 for fp16); a kernel that disagrees is reported
and not timed. Times: the median of ``--reps`` groups of five calls between CUDA events.
Kernels that change the example's stage counts stalled the GPU at some K: ``--isolate 60``
measures each shape in a child process that is killed when it takes longer.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

from benchmarks._common import graph_time_ms, norm_rel_torch  # noqa: E402
from benchmarks.conv_8bit_cudnn import SHAPES  # noqa: E402
from benchmarks.conv_8bit_cudnn import _time as _time_events  # noqa: E402

from tensorkiln.errors import KernelError  # noqa: E402
from tensorkiln.kernels.cuda.cutlass_fp8 import (  # noqa: E402
    VectorArg,
    launch,
    load_cudart,
    load_kernel,
    tensor_arg,
)

BERT = ((8192, 2304, 768, 1), (8192, 768, 768, 1), (8192, 3072, 768, 1), (8192, 768, 3072, 1))


class CutlassGemms:
    """The exported kernels of one build: ``run(name, a, b, d, scale)`` launches
    ``d = op(scale * a @ b.T)`` on torch's current stream; with the per-channel epilogue
    ``run(name, a, b, d, 0.0, col, bias)``, ``d = op(a @ b.T * col + bias)``; with the residual
    one ``run(name, a, b, d, z_scale, col, bias, z)``, ``d = op(a @ b.T * col + bias + z *
    z_scale)``."""

    def __init__(self, folder: Path) -> None:
        import torch

        torch.zeros(1, device="cuda")
        load_cudart()
        manifest = json.loads((folder / "manifest.json").read_text())
        self.lib = ctypes.CDLL(str(folder / manifest["library"]), mode=ctypes.RTLD_GLOBAL)
        # (the GEMMs: a conv kernel's A is an NHWC image, which qconv_3x3.py times)
        self.kernels = {k["name"]: k for k in manifest["kernels"] if not k.get("conv")}
        self._entries = {}
        for name, k in self.kernels.items():
            for t in ("a", "b", "c", "res") if k["epilogue"] == "residual" else ("a", "b", "c"):
                if k["tensors"].get(t) != [2, 2]:  # (the TensorArg layout this loader passes)
                    raise RuntimeError(f"{name}: tensor {t} is not a dynamic 2-D row-major one")
            self._entries[name] = load_kernel(self.lib, name, k["entry"], str(folder))

    def run(self, name: str, a, b, d, scale: float, col=None, bias=None, z=None) -> None:
        import torch

        structs = [tensor_arg(a), tensor_arg(b), tensor_arg(d)]
        epilogue = self.kernels[name]["epilogue"]
        if epilogue in ("channel", "residual"):
            for v in (col, bias):
                if v is None or v.dtype != torch.float32 or v.shape != (d.shape[1],):
                    raise ValueError("the per-channel epilogue takes two float32 vectors of N")
                structs.append(VectorArg(v.data_ptr(), (v.shape[0],)))
        if epilogue == "residual":
            if z is None or z.shape != d.shape or z.dtype != torch.float8_e4m3fn:
                raise ValueError("the residual epilogue takes an E4M3 residual of D's shape")
            structs.append(tensor_arg(z))
        launch(self._entries[name], name, structs, scale)


def _shapes(batch: int):
    for cin, cout, k, stride, hw, count in SHAPES:
        out_hw = (hw + 2 * (k // 2) - k) // stride + 1
        label = f"{cin}->{cout} {k}x{k}/{stride} @{hw}"
        yield label, (batch * out_hw * out_hw, cout, cin * k * k, count), (cin, cout, k, stride, hw)
    for m, n, k, count in BERT:
        yield f"BERT {m}x{n}x{k}", (m, n, k, count), None


def _selected(args: argparse.Namespace) -> list:
    """The shapes this run measures: those whose label holds ``--only``, the first ``--shapes``."""
    shapes = [s for s in _shapes(args.batch) if args.only in s[0]]
    return shapes[: args.shapes or None]


def _isolated(args: argparse.Namespace) -> None:
    """Each shape in a child process (this script with ``--shape-index``) under a timeout: the
    rows as they come, a stalled shape reported and skipped, the weighted sums of the rest."""
    import subprocess

    argv, skip = [], False
    for a in sys.argv[1:]:  # (the same options, less --isolate and its value)
        if skip:
            skip = False
            continue
        if a == "--isolate":
            skip = True
            continue
        if not a.startswith("--isolate="):
            argv.append(a)
    totals: dict[str, float] = {}
    header_done = False
    for i, (label, *_) in enumerate(_selected(args)):
        cmd = [sys.executable, str(Path(__file__).resolve()), *argv, "--shape-index", str(i)]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.isolate,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},  # (what it printed before a stall)
            )  # fmt: skip
        except subprocess.TimeoutExpired as exc:
            partial = exc.stdout.decode() if isinstance(exc.stdout, bytes) else exc.stdout or ""
            for line in partial.splitlines():
                if line.startswith(
                    "  "
                ):  # (with --every: the kernels that ran, the one that did not)
                    print(line)
            print(f"{label} | stalled: the child was killed after {args.isolate:.0f} s", flush=True)
            continue
        for line in done.stdout.splitlines():
            if line.startswith("ROW "):
                got = json.loads(line[4:])
                for key, t in got["row"].items():
                    name = f"{got['group']}:{key}"
                    totals[name] = totals.get(name, 0.0) + got["count"] * t
            elif line.startswith("shape | ") or ", torch " in line:
                if not header_done:
                    print(line)
            elif (line.startswith("  ") and " on " in line) or " | " in line:
                print(line)  # (the child's own weighted sums are left out: the parent adds up)
        header_done = header_done or done.returncode == 0
        if done.returncode:
            print(f"{label} | failed: {done.stderr.strip().splitlines()[-1:]}", flush=True)
    print("\nWeighted by use, over the shapes that finished:")
    for key, t in sorted(totals.items()):
        print(f"  {key}: {t:.3f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", type=Path, default=ROOT / "build" / "cutlass_gemm")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--shapes", type=int, default=0, help="the first N shapes only")
    ap.add_argument(
        "--graph",
        action="store_true",
        help="time calls replayed from a CUDA graph (no launch cost), as engines run",
    )
    ap.add_argument("--only", default="", help="the shapes whose label holds this, e.g. BERT")
    ap.add_argument("--every", action="store_true", help="print every kernel's time")
    ap.add_argument("--all-k", action="store_true",
                    help="run the variants with other stage counts (k2, e, s) at every K, not only "
                         "where K is 64 (such variants stalled the GPU at K = 576 and 256)")  # fmt: skip
    ap.add_argument("--isolate", type=float, default=0.0, metavar="SECONDS",
                    help="measure each shape in a child process killed after SECONDS, so a "
                         "kernel that stalls the GPU costs one shape, not the run")  # fmt: skip
    ap.add_argument("--shape-index", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.isolate > 0:
        _isolated(args)
        return
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    _time = graph_time_ms if args.graph else _time_events
    gemms = CutlassGemms(args.lib)
    print(
        f"{torch.cuda.get_device_name()}, torch {torch.__version__}, kernels: {len(gemms.kernels)}"
    )
    kinds = sorted(
        {
            (k["a"], k["c"], k["epilogue"], k.get("activation", "relu"))
            for k in gemms.kernels.values()
        }
    )
    acts = {"relu": torch.relu, "none": lambda v: v, "gelu": F.gelu, "gelu_erf": F.gelu,
            "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}  # fmt: skip
    e4m3 = torch.float8_e4m3fn
    dt = {"fp8": e4m3, "f16": torch.half, "i8": torch.int8}
    header = ["shape", "x", "conv fp16", "cuBLAS fp16", "_scaled_mm fp8->f16"]
    header += [f"CUTLASS {a}->{c} {e} {act} (tile)" for a, c, e, act in kinds]
    print(" | ".join(header))
    totals: dict[str, float] = {}
    chosen = _selected(args)
    if args.shape_index >= 0:
        chosen = chosen[args.shape_index : args.shape_index + 1]
    for label, (m, n, k, count), conv in chosen:
        g = torch.Generator(device="cuda").manual_seed(m * 7 + n * 3 + k)
        a32 = torch.randn(m, k, device="cuda", generator=g)
        b32 = torch.randn(n, k, device="cuda", generator=g)
        a8, b8 = a32.to(e4m3), b32.to(e4m3)
        a16, b16 = a8.half(), b8.half()
        scale = 1.0 / k**0.5
        acc = a8.float() @ b8.float().T
        col = scale * (0.5 + torch.rand(n, device="cuda", generator=g))
        bias = 0.5 * torch.randn(n, device="cuda", generator=g)
        z = torch.randn(m, n, device="cuda", generator=g).to(e4m3)
        z_scale = 0.5
        pre = {
            "scalar": scale * acc,
            "channel": acc * col + bias,
            "residual": acc * col + bias + z.float() * z_scale,
        }
        del acc
        pre_i8 = a_i8 = b_i8 = None
        if any(kind[0] == "i8" for kind in kinds):  # int8 operands: int32 sums, per channel
            a_i8 = torch.randint(-64, 65, (m, k), device="cuda", generator=g, dtype=torch.int8)
            b_i8 = torch.randint(-64, 65, (n, k), device="cuda", generator=g, dtype=torch.int8)
            col_i8 = col / 64.0
            pre_i8 = {"channel": (a_i8.double() @ b_i8.double().T).float() * col_i8 + bias}
        cells = [label, str(count)]
        row: dict[str, float] = {}
        if conv is not None:
            cin, cout, kk, stride, hw = conv
            x = torch.randn(args.batch, cin, hw, hw, device="cuda", dtype=torch.half)
            x = x.contiguous(memory_format=torch.channels_last)
            w = torch.randn(cout, cin, kk, kk, device="cuda", dtype=torch.half)
            w = w.contiguous(memory_format=torch.channels_last)
            row["conv fp16"] = _time(
                lambda x=x, w=w, s=stride, p=kk // 2: F.conv2d(x, w, stride=s, padding=p), args.reps
            )
            del x, w
        row["cuBLAS fp16"] = _time(lambda a=a16, b=b16: F.linear(a, b), args.reps)
        one = torch.ones((), device="cuda")
        row["_scaled_mm"] = _time(
            lambda a=a8, b=b8, one=one: torch._scaled_mm(a, b.T, one, one, out_dtype=torch.half),
            args.reps,
        )
        for key in ("conv fp16", "cuBLAS fp16", "_scaled_mm"):
            cells.append(f"{row[key]:.3f}" if key in row else "-")
        for a_kind, c_kind, epi, act in kinds:
            vecs = (col, bias, z)
            if a_kind == "i8":
                if epi != "channel":
                    continue
                want = acts[act](pre_i8[epi])
                vecs = (col_i8, bias, z)
            else:
                want = acts[act](pre[epi])
            if epi == "channel" and act.startswith("gelu"):  # (an output scale after the GELU)
                want = want * scale
            if c_kind == "fp8":
                want = want.to(e4m3).float()
            elif c_kind == "i8":  # (QuantizeLinear's: half to even, saturated)
                want = torch.round(want).clamp(-128, 127)
            s = z_scale if epi == "residual" else scale
            best = None
            a_in, b_in = {"fp8": (a8, b8), "i8": (a_i8, b_i8)}.get(a_kind, (a16, b16))
            for name, kern in gemms.kernels.items():
                if (kern["a"], kern["c"], kern["epilogue"], kern.get("activation", "relu")) != (
                    a_kind,
                    c_kind,
                    epi,
                    act,
                ):
                    continue
                changed = kern["k_steps"] != 4 or kern["epi_tile"] or kern.get("epi_stages", 4) != 4
                if k > 64 and changed and not args.all_k:
                    continue  # (such variants stalled the GPU at K = 576 and 256; see --all-k)
                if epi == "residual" and (n % kern["tile"][1] or m % kern["tile"][0]):
                    continue  # (the residual's tile copy is not bounded by the tensor)
                d = torch.empty(m, n, device="cuda", dtype=dt[c_kind])
                if args.every:
                    print(f"  {name} on {label}: launched", flush=True)
                try:
                    gemms.run(name, a_in, b_in, d, s, *vecs)
                    torch.cuda.synchronize()
                except (RuntimeError, ValueError, KernelError) as exc:
                    print(f"  {name} on {label}: {exc}")
                    continue
                err = norm_rel_torch([d.float()], [want])
                limit = {"fp8": 2.0**-6, "i8": 1e-2}.get(c_kind, 2e-3)
                if not err <= limit:
                    print(f"  {name} on {label}: relative L2 {err:.2e} over {limit:.1e}, not timed")
                    continue
                t = _time(lambda name=name, a_in=a_in, b_in=b_in, d=d, s=s, v=vecs: (
                    gemms.run(name, a_in, b_in, d, s, *v)), args.reps)  # fmt: skip
                if args.every:
                    print(f"  {name} on {label}: {t:.3f} ms")
                if best is None or t < best[0]:
                    best = (t, kern["tag"], err)
            key = f"{a_kind}->{c_kind} {epi} {act}"
            if best is None:
                cells.append("none ran")
            else:
                row[key] = best[0]
                cells.append(f"{best[0]:.3f} ({best[1]}, err {best[2]:.1e})")
        group = "resnet" if conv is not None else "bert"
        for key, t in row.items():
            totals[f"{group}:{key}"] = totals.get(f"{group}:{key}", 0.0) + count * t
        print(" | ".join(cells), flush=True)
        if args.shape_index >= 0:
            print("ROW " + json.dumps({"group": group, "count": count, "row": row}), flush=True)
        del a32, b32, a8, b8, a16, b16, pre, col, bias, z, pre_i8, a_i8, b_i8
        torch.cuda.empty_cache()
    print("\nWeighted by use (ResNet-50: each layer times how often the network runs it):")
    for key, t in sorted(totals.items()):
        print(f"  {key}: {t:.3f} ms")


if __name__ == "__main__":
    main()

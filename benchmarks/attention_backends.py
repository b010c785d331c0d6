"""BERT's attention with a key padding mask on the GPU: the library's flash kernel (the tactics
an engine times) beside PyTorch's scaled_dot_product_attention with each backend that takes a
mask (cuDNN's, the memory-efficient one, and SDPA's own choice), on the same operands.

    python benchmarks/attention_backends.py [--batch 64] [--seq 128] [--heads 12] [--reps 20]

Operands as a BERT engine holds them: Q, K and V strided views of one [B, S, 3 * H * D] float16
projection (heads split out without copies), an additive float16 key padding mask [B, 1, 1, S]
(finfo.min at padded keys; each sequence keeps a random 3/4 to all of its keys). Every variant's
output is first checked against float32 arithmetic on the same values (relative L2 under 1e-2;
one that disagrees or fails is reported and not timed). Times: ms a call, each call inside a
CUDA graph of 20, the median of ``--reps`` replays (benchmarks/norm_quant.py's timing). With
``--e4m3`` the flash kernel also writes its output quantized, as an 8-bit engine's attention
does (SDPA's would need a QuantizeLinear after it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parents[1] / "src"),
]

from benchmarks.norm_quant import _time  # noqa: E402

from tensorkiln.kernels.cuda.tactics_attention import SHORT_TILES  # noqa: E402
from tensorkiln.kernels.triton import flash_attention as flash  # noqa: E402


def _operands(b: int, s: int, h: int, d: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(b, s, 3 * h * d, device="cuda", generator=g).half()
    q, k, v = (qkv[..., i * h * d : (i + 1) * h * d].unflatten(-1, (h, d)).transpose(1, 2)
               for i in range(3))  # fmt: skip
    keep = torch.randint(3 * s // 4, s + 1, (b,), device="cuda", generator=g)
    padded = torch.arange(s, device="cuda")[None, :] >= keep[:, None]
    mask = torch.where(padded, torch.finfo(torch.float16).min, 0.0).half().reshape(b, 1, 1, s)
    return q, k, v, mask


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--e4m3", action="store_true", help="also the flash kernel writing E4M3")
    args = ap.parse_args(argv)
    b, s, h, d = args.batch, args.seq, args.heads, args.head_dim
    q, k, v, mask = _operands(b, s, h, d, seed=5)
    scale = d**-0.5
    scores = (q.float() @ k.float().transpose(-1, -2)) * scale + mask.float()
    want = torch.softmax(scores, dim=-1) @ v.float()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; [B, H, S, D] = "
          f"[{b}, {h}, {s}, {d}] float16, key padding mask [{b}, 1, 1, {s}]")  # fmt: skip
    print("variant | ms | rel L2 to float32")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def sdpa(backend):
        def run():
            if backend is None:
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=scale)
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, mask, scale=scale)

        return run

    def tk(block_m: int, stages: int, quantized=None, persistent: int = 0):
        def run():
            return flash.attention(q, k, v, mask, scale=scale, mask_kind="additive",
                                   block_m=block_m, stages=stages, quantized=quantized,
                                   persistent=persistent)  # fmt: skip

        return run

    variants = {f"tensorkiln flash m{m}{'_s3' if st == 3 else ''}": tk(m, st)
                for m in (64, 128) for st in (2, 3)}  # fmt: skip
    if s <= flash.SHORT_KEYS:  # the persistent one-block kernel: programs an SM, loop stages
        variants |= {f"tensorkiln short m{m} x{p}{'_s3' if st == 3 else ''}": tk(m, st, None, p)
                     for m in (64, 128) for p in (1, 2, 3, 4, 6, 8) for st in (2, 3)}  # fmt: skip
    variants |= {
        "SDPA (its choice)": sdpa(None),
        "SDPA cuDNN": sdpa(SDPBackend.CUDNN_ATTENTION),
        "SDPA memory-efficient": sdpa(SDPBackend.EFFICIENT_ATTENTION),
    }
    y_scale = (want.abs().max() / 448).float().reshape(())
    if args.e4m3:
        for m in (64, 128):
            variants[f"tensorkiln flash m{m}_s3 E4M3 out"] = tk(
                m, 3, (torch.float8_e4m3fn, y_scale)
            )
        if s <= flash.SHORT_KEYS:  # (the short kernel's tactics)
            for m, p, st in SHORT_TILES:
                variants[f"tensorkiln short m{m} x{p}{'_s3' if st == 3 else ''} E4M3 out"] = tk(
                    m, st, (torch.float8_e4m3fn, y_scale), p
                )
    for name, fn in variants.items():
        try:
            got = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # (a backend that does not take these operands here)
            print(f"{name} | - | {type(exc).__name__}: {str(exc)[:160]}")
            continue
        got = got.float() * (y_scale if got.dtype == torch.float8_e4m3fn else 1.0)
        err = float((got - want).norm() / want.norm())
        if not err < (6e-2 if name.endswith("E4M3 out") else 1e-2):  # (E4M3: 3 mantissa bits)
            print(f"{name} | - | {err:.1e}: disagrees, not timed")
            continue
        print(f"{name} | {_time(fn, args.reps):.4f} | {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

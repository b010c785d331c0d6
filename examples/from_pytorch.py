"""From a PyTorch module to a tensorkiln engine and back, in one script.

    python examples/from_pytorch.py

A small convolutional network (written here in torch.nn) is compiled with a dynamic batch of 1
to 64, checked against eager PyTorch at three batch sizes, timed against it, saved, loaded and
run again. On a machine with an NVIDIA GPU it builds an fp16 engine on the GPU; elsewhere it
builds for the CPU.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import torch

import tensorkiln.torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.features = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.BatchNorm2d(32), torch.nn.ReLU(),
            torch.nn.Conv2d(32, 64, 3, stride=2, padding=1), torch.nn.BatchNorm2d(64),
            torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
        )  # fmt: skip
        self.head = torch.nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def median_ms(fn, x: torch.Tensor, runs: int = 20) -> float:
    times = []
    for _ in range(runs):
        if x.is_cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(x)
        if x.is_cuda:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def main() -> int:
    gpu = torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    model = Net().eval().to(device)
    dtype = torch.float16 if gpu else torch.float32
    if gpu:
        model = model.half()
    batch = torch.export.Dim("batch", min=1, max=64)
    example = torch.randn(8, 3, 32, 32, device=device, dtype=dtype)
    fast = tensorkiln.torch.compile(
        model, (example,), precision="fp16" if gpu else "fp32", dynamic_shapes=({0: batch},)
    )
    print(f"built: {fast.engine!r}")
    worst = 0.0
    with torch.no_grad():
        for n in (1, 8, 64):
            x = torch.randn(n, 3, 32, 32, device=device, dtype=dtype)
            want, got = model(x).float(), fast(x).float()
            worst = max(worst, float((got - want).norm() / want.norm()))
    print(f"relative L2 difference from eager PyTorch, batches 1/8/64: {worst:.2e}")
    x = torch.randn(64, 3, 32, 32, device=device, dtype=dtype)
    with torch.no_grad():
        eager, engine = median_ms(model, x), median_ms(fast, x)
    print(f"batch 64: eager {eager:.3f} ms, tensorkiln {engine:.3f} ms (median of 20)")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "net.tkm"
        tensorkiln.torch.save(fast, path)
        again = tensorkiln.torch.load(path)
        same = torch.equal(again(x), fast(x))
    print(f"saved and loaded: same outputs: {same}")
    tolerance = 5e-3 if gpu else 1e-4
    return 0 if worst < tolerance and same else 1


if __name__ == "__main__":
    sys.exit(main())

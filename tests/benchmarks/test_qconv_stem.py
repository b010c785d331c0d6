"""benchmarks/qconv_stem.py's logic on the CPU (Triton's interpreter, a 32-pixel image, a
stand-in timer): every tactic of the stem's convolution agrees with cudnn_fp16's output (float32
on the CPU) and is timed, every pool tactic equals the default kernel; the times themselves
are the GPU's business."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import qconv_stem as bench  # noqa: E402


@pytest.mark.parametrize("dtype", ["int8", "fp8"])
def test_every_stem_tactic_is_checked_then_timed(dtype: str) -> None:
    kind = torch.int8 if dtype == "int8" else torch.float8_e4m3fn
    timed = []

    def timer(fn, reps: int) -> float:
        fn()
        timed.append(reps)
        return 0.125

    rows = bench.stem_rows(kind, 1, 3, side=32, device="cpu", timer=timer)
    convs = [r for r in rows if r.split(" ")[1] == "conv"]
    pools = [r for r in rows if r.split(" ")[1] == "pool"]
    assert len(convs) == 1 + len(bench.conv_stem.CONFIGS), rows
    assert all(r.endswith(")") and "0.1250 ms" in r for r in convs), rows
    assert "the reference here" in convs[0]
    nonzero = float(convs[0].split("here, ")[1].split("%")[0])
    assert 20 < nonzero < 100, convs[0]  # (after ReLU about half: the check means something)
    assert [r.split(" pool ")[1].split(":")[0] for r in pools] == [
        "default",
        "triton",
        "triton_p128",
    ]
    assert all("(equal)" in r for r in pools), rows
    fused = [r for r in rows if r.split(" ")[1] == "stem+pool"]
    assert len(fused) == len(bench.conv_stem.POOL_CONFIGS), rows
    # (checked against the pool of the fastest convolution, then timed: 0.125 ms against the
    # convolution's and the pool's 0.125 each)
    assert all("2.00x the fastest convolution and pool apart" in r for r in fused), rows
    assert all("0.000% more than a step off" in r for r in fused), rows
    assert timed == [3] * (len(convs) + len(pools) + len(fused))

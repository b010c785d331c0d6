"""math_mode sets torch's process-wide math switches for a run and restores what it found."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tensorkiln.runtime.mathmode import math_mode  # noqa: E402

SWITCHES = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
    (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
)


def _state() -> tuple[bool, ...]:
    return tuple(getattr(obj, name) for obj, name in SWITCHES)


@pytest.mark.parametrize("precision", ["fp32", "tf32", "fp16", "bf16"])
def test_switches_for_the_run_then_restored(precision) -> None:
    before = _state()
    with math_mode(precision):
        tf32_matmul, tf32_conv, fp16_reduce, bf16_reduce = _state()
        assert tf32_matmul == tf32_conv == (precision == "tf32")
        assert not fp16_reduce and not bf16_reduce  # fp32 accumulation in reduced-type GEMMs
    assert _state() == before


def test_restored_after_an_error() -> None:
    before = _state()
    with pytest.raises(RuntimeError), math_mode("tf32"):
        raise RuntimeError("a failing layer")
    assert _state() == before

"""The cudnn_fused ConvAct tactic (kernels/cuda/tactics_conv.py): which layers it takes, and on a
GPU its results against the numpy reference ConvAct on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.tactics import LayerSpec, get_tactic  # noqa: E402

TACTIC = get_tactic("ConvAct", "tensorkiln", "cudnn_fused")
GEOMETRY = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]}


def _spec(attrs, dtype="float16", device="cuda", residual=True, x=(4, 16, 14, 14)):
    shapes = [x, (32, x[1], 3, 3), (32,)] + ([(4, 32, 7, 7)] if residual else [])
    return LayerSpec(
        "ConvAct", "tensorkiln", attrs, tuple(shapes), (dtype,) * len(shapes), device=device
    )


def test_it_takes_relu_convolutions_on_cuda_devices_only():
    relu = {"activation": "Relu", **GEOMETRY}
    assert TACTIC.applies(_spec(relu))
    assert TACTIC.applies(_spec(relu, "bfloat16", residual=False))
    assert not TACTIC.applies(_spec(relu, device="cpu"))
    assert not TACTIC.applies(_spec({**GEOMETRY, "activation": "Sigmoid"}))
    assert not TACTIC.applies(_spec({**relu, "residual_order": "act_add"}))
    assert not TACTIC.applies(_spec({**relu, "pads": [1, 1, 0, 0]}))
    assert not TACTIC.applies(_spec({**relu, "auto_pad": "SAME_UPPER"}))
    assert not TACTIC.applies(_spec(relu, x=(4, 16, 14)))  # 1-D


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("dtype", [np.float16, np.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("residual", [True, False], ids=["residual", "plain"])
def test_it_computes_conv_act_on_the_gpu(dtype, residual):
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 16, 14, 14)).astype(dtype)
    w = (rng.standard_normal((32, 16, 3, 3)) / 12).astype(dtype)
    b = rng.standard_normal(32).astype(dtype)
    args = [x, w, b] + ([rng.standard_normal((4, 32, 7, 7)).astype(dtype)] if residual else [])
    attrs = {"activation": "Relu", **GEOMETRY}
    wide = [a.astype(np.float32) for a in args]
    want = invoke(lookup("ConvAct", "tensorkiln", 1, "reference"), wide, attrs, 1)[0]
    cl = torch.channels_last
    tensors = [to_torch(a, "cuda") for a in args]
    tensors = [t.contiguous(memory_format=cl) if t.ndim == 4 else t for t in tensors]
    got = to_numpy(TACTIC.fn(*tensors, **attrs)).astype(np.float64)
    tol = 1e-2 if dtype == np.float16 else 1e-4
    assert np.linalg.norm(got - want) <= tol * np.linalg.norm(want)

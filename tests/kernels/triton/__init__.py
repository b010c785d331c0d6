"""Triton tactics against the numpy reference kernels (through Triton's interpreter without a GPU).

:func:`check` runs one tactic of an op and the op's reference kernel on the same fresh random
inputs: float32 within 1e-4 relative (an absolute floor at the output's scale), float16/bfloat16
inputs against the reference run on the same values in float32, within 1e-2 of the output's norm.
It also asserts the tactic's ``supports`` accepts the layer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

try:
    import torch
except ImportError:  # the test modules skip
    torch = None

RTOL = 1e-4
DEVICE = (
    "cuda" if torch is not None and torch.cuda.is_available() else "cpu"
)  # CPU tensors run through the interpreter
HALF_TOL = 1e-2


def rand(*shape: int, dtype=np.float32) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(dtype)  # fresh on every run


def check(
    op: str,
    domain: str,
    tactic_name: str,
    args: list,
    attrs: dict | None = None,
    *,
    device: str = DEVICE,
    transform=None,
) -> np.ndarray:
    """Run tactic ``tactic_name`` of ``op`` and the reference kernel on ``args`` (numpy, all of one
    float dtype, None for omitted inputs); assert they agree. ``transform`` maps each device tensor
    (to pass a strided view). Returns the tactic's output."""
    from tensorkiln.kernels.cuda.convert import to_numpy, to_torch
    from tensorkiln.kernels.registry import invoke, lookup
    from tensorkiln.kernels.tactics import LayerSpec, get_tactic

    attrs = attrs or {}
    tactic = get_tactic(op, domain, tactic_name)
    assert tactic is not None, f"no tactic {tactic_name} of {op}"
    spec = LayerSpec(
        op,
        domain,
        attrs,
        tuple(None if a is None else a.shape for a in args),
        tuple(None if a is None else a.dtype.name for a in args),
        device=device,
    )
    assert tactic.applies(spec), f"{tactic_name} does not take {spec}"
    dtype = next(a.dtype for a in args if a is not None)
    narrow = dtype != np.float32
    wide = [None if a is None else a.astype(np.float32) for a in args]
    expected = invoke(lookup(op, domain, 22, "reference"), wide if narrow else args, attrs, 1)[0]
    tensors = [None if a is None else to_torch(a, device) for a in args]
    if transform is not None:
        tensors = [None if t is None else transform(t) for t in tensors]
    before = [None if t is None else t.clone() for t in tensors]
    got = tactic.fn(*tensors, **attrs)
    assert isinstance(got, torch.Tensor)
    for t, b in zip(tensors, before):
        same = t is None or torch.allclose(t, b, rtol=0, atol=0, equal_nan=True)
        assert same, f"{tactic_name} modified an input"
    got = to_numpy(got)
    assert got.shape == expected.shape, f"shape {got.shape}, reference {expected.shape}"
    assert got.dtype == dtype, f"dtype {got.dtype}, inputs {dtype}"
    if narrow:
        g, e = got.astype(np.float64), expected.astype(np.float64)
        err = np.linalg.norm(g - e)
        assert err <= HALF_TOL * max(np.linalg.norm(e), 1e-30), f"error {err:.3g}"
    else:
        scale = float(np.abs(expected).max()) if expected.size else 0.0
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=RTOL * scale)
    return got


def compile_child(code: str, root: Path, cache: Path, *args: str) -> dict:
    """Run ``code`` (which compiles kernels for sm_90 and prints one JSON line) in a fresh
    Python with no GPU visible and a Triton cache of its own, outside the interpreter, with the
    repository's root as its first argument and ``args`` after it; its JSON."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(cache), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", code, str(root), *args], capture_output=True,
                          text=True, env=env, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])

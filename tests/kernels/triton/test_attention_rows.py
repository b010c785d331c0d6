"""The empty-row rule of tensorkiln.Attention in one Triton kernel (kernels/triton/attention_rows.py)
against the numpy reference attention, on fresh random inputs with rows that see no key.

The kernel runs through Triton's interpreter on CPU tensors here (on the GPU the cuda Attention
kernel calls it after SDPA); its result must equal the reference's zeros exactly and leave every
other row as it was.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402
from tensorkiln.kernels.triton import attention_rows as rows  # noqa: E402
from tests.kernels.triton import DEVICE  # noqa: E402

B, H, SQ, SK, D = 3, 2, 5, 37, 70  # (SK and D past one block: the loops run)

MASKS = [(B, 1, 1, SK), (B, H, SQ, SK), (1, 1, SQ, SK), (SQ, SK), (B, 1, SQ, SK), (SK,)]


def _mask(shape, kind: str, rng) -> np.ndarray:
    """A random mask with about half the keys hidden and some rows hiding every key."""
    hidden = rng.random(shape) < 0.5
    flat = hidden.reshape(-1, shape[-1])
    flat[:: max(2, len(flat) // 2)] = True  # whole rows hidden (not all of them, when several)
    if kind == "bool":
        return ~hidden
    return np.where(hidden, -np.inf, rng.standard_normal(shape)).astype(np.float32)


@pytest.mark.parametrize("kind", ["bool", "additive"])
@pytest.mark.parametrize("shape", MASKS, ids=["x".join(map(str, s)) for s in MASKS])
def test_rows_that_see_no_key_are_zeros(shape, kind):
    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((B, H, n, D)).astype(np.float32) for n in (SQ, SK, SK))
    mask = _mask(shape, kind, rng)
    attrs = {"mask_kind": kind, "input_layout": "bhsd", "output_layout": "bhsd"}
    want = invoke(lookup("Attention", "tensorkiln", 1, "reference"), [q, k, v, mask], attrs, 1)[0]
    assert (want == 0).all(axis=-1).any(), "the draw has no empty row"
    # the kernel on an output whose empty rows hold garbage (as SDPA may leave them)
    y = np.where(want == 0, rng.standard_normal(want.shape), want).astype(np.float32)
    t = torch.from_numpy(y).to(DEVICE)
    m = torch.from_numpy(mask).to(DEVICE)
    assert rows.applies(t, m)
    got = rows.zero_empty_rows_(t, m, kind)
    assert got is t
    np.testing.assert_array_equal(t.cpu().numpy(), want)


def test_a_strided_output_and_half_precision():
    """The "bsd" output layout is a permuted view of [B, Sq, H, D]; float16 values."""
    rng = np.random.default_rng()
    mask = _mask((B, 1, 1, SK), "additive", rng).astype(np.float16)
    base = torch.from_numpy(rng.standard_normal((B, SQ, H, D)).astype(np.float16)).to(DEVICE)
    before = base.clone()
    view = base.permute(0, 2, 1, 3)  # [B, H, Sq, D] over [B, Sq, H, D]
    rows.zero_empty_rows_(view, torch.from_numpy(mask).to(DEVICE), "additive")
    empty = np.isneginf(mask.astype(np.float32)).all(axis=-1).reshape(B)
    got, old = base.cpu().numpy(), before.cpu().numpy()
    for b in range(B):
        if empty[b]:
            assert not got[b].any()
        else:
            np.testing.assert_array_equal(got[b], old[b])


def test_shapes_the_kernel_does_not_take():
    y = torch.zeros(B, H, SQ, D)
    assert not rows.applies(y, torch.zeros(2, 1, 1, SK))  # batch 2 against 3
    assert not rows.applies(y, torch.zeros(1, 1, 1, 1, SK))  # rank 5
    assert not rows.applies(torch.zeros(H, SQ, D), torch.zeros(SK))  # 3-D output


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("kind", ["bool", "additive"])
def test_the_cuda_attention_kernel_takes_it_on_the_gpu(kind):
    """The registered cuda Attention kernel, float16 on the GPU, padding mask with empty rows."""
    from tensorkiln.kernels.cuda.convert import to_numpy, to_torch

    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((B, H, n, 64)).astype(np.float16) for n in (SQ, 128, 128))
    mask = _mask((B, 1, 1, 128), kind, rng)
    if kind != "bool":
        mask = mask.astype(np.float16)
    attrs = {"mask_kind": kind, "input_layout": "bhsd", "output_layout": "bhsd"}
    wide = [a.astype(np.float32) if a.dtype == np.float16 else a for a in (q, k, v, mask)]
    want = invoke(lookup("Attention", "tensorkiln", 1, "reference"), wide, attrs, 1)[0]
    cuda = lookup("Attention", "tensorkiln", 1, "cuda")
    got = to_numpy(invoke(cuda, [to_torch(a, "cuda") for a in (q, k, v, mask)], attrs, 1)[0])
    empty = (want == 0).all(axis=-1)
    assert empty.any() and not np.isnan(got).any()
    assert not got[empty].any()
    err = np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want)
    assert err < 1e-2


def test_a_kernel_failure_falls_back_to_torch_with_a_warning(monkeypatch):
    from tensorkiln.kernels.cuda import fused_attention as fa

    monkeypatch.setattr(fa, "_ROWS_KERNEL", True)
    with pytest.warns(RuntimeWarning, match="empty-row kernel failed"):
        fa._rows_kernel_failed(RuntimeError("no compiler here"))
    assert fa._ROWS_KERNEL is False

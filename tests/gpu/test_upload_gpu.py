"""Uploads of numpy inputs on the cuda backend (kernels/cuda/convert.upload): an array in
page-locked memory that the caller holds unchanged for the run is sent from where it lies, and
anything else is staged first; either way the device receives the array's values."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _pinned(shape, dtype=np.float32) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    raw = torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("held", [False, True])
@pytest.mark.parametrize("pinned", [False, True])
def test_an_upload_carries_the_arrays_values(held, pinned):
    from tensorkiln.kernels.cuda.convert import upload

    rng = np.random.default_rng()
    want = rng.standard_normal((4, 3, 17, 9)).astype(np.float32)
    x = _pinned(want.shape) if pinned else np.empty_like(want)
    x[...] = want
    t = upload(x, "cuda", held=held)
    torch.cuda.synchronize()
    np.testing.assert_array_equal(t.cpu().numpy(), want)
    if not held:  # (staged: the array may change at once without reaching the device)
        t = upload(x, "cuda")
        x[...] = np.nan
        torch.cuda.synchronize()
        np.testing.assert_array_equal(t.cpu().numpy(), want)


def test_a_served_model_run_from_its_pinned_staging_buffer_is_right(tmp_path):
    """The server's path: rows joined into this thread's page-locked buffer, run as CUDA graphs
    with numpy in and out (inputs sent from the buffer in place), against the reference
    backend; the buffer rewritten between batches."""
    from tensorkiln.builder import Builder
    from tensorkiln.serve.model import ServedModel
    from tensorkiln.serve.repository import ModelRepository
    from tests.serve.test_repository import DIGITS, _model

    _model(tmp_path / "repo", config="max_batch_size: 16 optimization { cuda { graphs: true } }")
    entry = ModelRepository(tmp_path / "repo").read("digits")
    served = ServedModel.load(entry, entry.versions[-1], backend="cuda", cache_dir=tmp_path / "c")
    assert served._pinned and served.graph_batches
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    rng = np.random.default_rng()
    for rows in ((1,), (2, 3), (5, 1, 2), (16,), (1,)):
        reqs = [{"input": rng.standard_normal((n, 1, 8, 8)).astype(np.float32)} for n in rows]
        for feeds, got in zip(reqs, served.infer_batch(reqs), strict=True):
            want = direct.infer(feeds)["logits"]
            np.testing.assert_allclose(got["logits"], want, rtol=1e-4, atol=1e-4 * abs(want).max())

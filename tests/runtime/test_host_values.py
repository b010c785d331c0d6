"""Shape arithmetic of dynamic-shape engines runs on the device and is mirrored on the host, so
no kernel waits for the device to learn a shape (and the engine can be captured as a CUDA graph).

The check counts host reads of values the host did not know; on a GPU each is a synchronization.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")

import tensorkiln  # noqa: E402
from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.kernels.cuda import convert  # noqa: E402
from tests.passes.test_dynamic_axes import _export_dynamic, token_feeds  # noqa: E402
from tests.passes.util import model  # noqa: E402


def _misses_of(ctx, feeds) -> tuple[int, dict]:
    convert.HOST_READ_MISSES[0] = 0
    out = ctx.infer(feeds)
    return convert.HOST_READ_MISSES[0], out


def _cuda_engine(m):
    config = BuilderConfig(tactic_sources=set())
    return Builder("cuda", device="cpu").build(m, config, progress=False)


def test_reshape_to_a_computed_shape_needs_no_device_read() -> None:
    # y = Reshape(x, Concat(Shape(x)[0], [-1])) with x[N, 3, 4]: the shape is computed at run time
    n = helper.make_node
    nodes = [
        n("Shape", ["x"], ["s"]),
        n("Gather", ["s", "zero"], ["n0"], axis=0),
        n("Unsqueeze", ["n0", "axes"], ["n1"]),
        n("Concat", ["n1", "minus1"], ["shape"], axis=0),
        n("Reshape", ["x", "shape"], ["r"]),
        n("Relu", ["r"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array([0], np.int64), "axes"),
        numpy_helper.from_array(np.array([-1], np.int64), "minus1"),
    ]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 12])],
        inits,
    )
    ctx = _cuda_engine(m).create_execution_context()
    for batch in (2, 5):
        x = np.random.default_rng(batch).standard_normal((batch, 3, 4)).astype(np.float32)
        misses, out = _misses_of(ctx, {"x": x})
        assert misses == 0
        np.testing.assert_array_equal(out["y"], np.maximum(x.reshape(batch, 12), 0))


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dynamic_axes_transformers_read_no_device_values(name, tmp_path) -> None:
    path = _export_dynamic(name, tmp_path)
    plain = tensorkiln.Runner(path)
    ctx = _cuda_engine(path).create_execution_context()
    rng = np.random.default_rng()
    for n, s in [(1, 5), (3, 13)]:
        feeds = token_feeds(n, s, rng)
        misses, got = _misses_of(ctx, feeds)
        assert misses == 0
        want = plain.infer(feeds)
        for k in want:
            scale = float(np.abs(want[k]).max())
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)


@pytest.mark.parametrize(
    "value",
    [
        np.array([3, 128, 768], dtype=np.int64),
        np.array(7, dtype=np.int64),
        np.array([[1.5, -2.25], [0.0, 3.0]], dtype=np.float32),
        np.array([True, False, True]),
        np.array([-5, 250], dtype=np.int32),
    ],
)
def test_capture_time_uploads_are_made_by_fills(value) -> None:
    """While a CUDA graph is captured, small host arrays (shapes, scalars) are written into a new
    tensor element by element (no host-to-device copy for the graph to repeat)."""
    value = value if value.ndim == 0 else np.random.default_rng().permutation(value)
    got = convert._filled(value, torch.device("cpu"))
    assert got.dtype == convert.torch_dtype(value.dtype) and tuple(got.shape) == value.shape
    np.testing.assert_array_equal(got.numpy(), value)


def test_capture_time_upload_refuses_large_arrays() -> None:
    big = np.random.default_rng().standard_normal(convert.HOST_VALUES_LIMIT + 1)
    with pytest.raises(RuntimeError, match="captured"):
        convert._filled(big.astype(np.float32), torch.device("cpu"))

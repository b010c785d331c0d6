"""Index-driven reference kernels (indexing.py) against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest

import tensorkiln.kernels.reference.indexing  # noqa: F401  (registers the kernels)
from tests.kernels.ort_oracle import check_against_ort, run_kernel

rng = np.random.default_rng()


def rand(*shape: int, dtype=np.float32) -> np.ndarray:
    return np.asarray(rng.standard_normal(shape) + 0.5, dtype=dtype)


def index(low: int, high: int, *shape: int, dtype=np.int64) -> np.ndarray:
    """Random indices in [low, high)."""
    return np.asarray(rng.integers(low, high, size=shape), dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Gathers


@pytest.mark.parametrize("axis", [0, 1, 2, -1])
@pytest.mark.parametrize("idx_shape", [(), (4,), (2, 3)])
@pytest.mark.parametrize("dtype", [np.int64, np.int32])
def test_gather(axis, idx_shape, dtype):
    data = rand(3, 4, 5)
    n = data.shape[axis]
    check_against_ort(
        "Gather", {"d": data, "i": index(-n, n, *idx_shape, dtype=dtype)}, {"axis": axis}
    )


def test_gather_out_of_range_raises():
    with pytest.raises(IndexError, match="index 3 is out of range for axis 0 of size 3"):
        run_kernel("Gather", {"d": rand(3, 2), "i": np.array([0, 3], np.int64)})


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("idx_shape", [(3, 4, 5), (2, 4, 1), (6, 2, 3)])
def test_gather_elements(axis, idx_shape):
    data = rand(3, 4, 5)
    idx_shape = list(idx_shape)
    n = data.shape[axis]
    for d in range(3):  # other axes may not exceed data's
        if d != axis % 3:
            idx_shape[d] = min(idx_shape[d], data.shape[d])
    inputs = {"d": data, "i": index(-n, n, *idx_shape)}
    check_against_ort("GatherElements", inputs, {"axis": axis})


@pytest.mark.parametrize(
    "data_shape, idx_shape, batch_dims",
    [
        ((4, 5), (3, 2), 0),
        ((4, 5, 6), (2, 3, 1), 0),
        ((4, 5, 6), (7, 3), 0),
        ((2, 5, 6), (2, 4, 1), 1),
        ((2, 3, 5, 6), (2, 3, 2), 2),
        ((2, 3, 5, 6), (2, 3, 4, 2), 2),
    ],
)
def test_gather_nd(data_shape, idx_shape, batch_dims):
    data = rand(*data_shape)
    k = idx_shape[-1]
    cols = [index(0, data_shape[batch_dims + j], *idx_shape[:-1]) for j in range(k)]
    inputs = {"d": data, "i": np.stack(cols, axis=-1)}
    check_against_ort("GatherND", inputs, {"batch_dims": batch_dims})


# ---------------------------------------------------------------------------------------------
# Scatters


def _distinct_along(axis: int, idx_shape: tuple, size: int) -> np.ndarray:
    """Indices that are distinct along ``axis`` (so that 'none' has one defined answer)."""
    perm = np.argsort(rng.random((*idx_shape[:axis], size, *idx_shape[axis + 1 :])), axis=axis)
    return np.take(perm, np.arange(idx_shape[axis]), axis=axis).astype(np.int64)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_scatter_elements(reduction, axis):
    data = rand(4, 5, 6)
    idx_shape = (3, 4, 5)
    ax = axis % 3
    if reduction == "none":
        idx = _distinct_along(ax, idx_shape, data.shape[ax])
    else:
        idx = index(-data.shape[ax], data.shape[ax], *idx_shape)
    inputs = {"d": data, "i": idx, "u": rand(*idx_shape)}
    check_against_ort("ScatterElements", inputs, {"axis": axis, "reduction": reduction}, opset=18)


def test_scatter_deprecated_alias():
    data = rand(3, 4)
    inputs = {"d": data, "i": _distinct_along(1, (3, 2), 4), "u": rand(3, 2)}
    check_against_ort("Scatter", inputs, {"axis": 1}, opset=9)


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize(
    "data_shape, idx_shape", [((6,), (4, 1)), ((5, 4, 3), (3, 2)), ((5, 4, 3), (2, 2, 3))]
)
def test_scatter_nd(reduction, data_shape, idx_shape):
    k = idx_shape[-1]
    n_rows = int(np.prod(idx_shape[:-1]))
    if reduction == "none":  # distinct addresses
        flat = rng.permutation(int(np.prod(data_shape[:k])))[:n_rows]
        idx = np.stack(np.unravel_index(flat, data_shape[:k]), axis=-1).reshape(idx_shape)
    else:  # with duplicates
        cols = [index(0, data_shape[j], n_rows) for j in range(k)]
        idx = np.stack(cols, axis=-1).reshape(idx_shape)
    updates = rand(*idx_shape[:-1], *data_shape[k:])
    inputs = {"d": rand(*data_shape), "i": idx.astype(np.int64), "u": updates}
    check_against_ort("ScatterND", inputs, {"reduction": reduction}, opset=18)


def test_scatter_nd_bad_updates_shape_raises():
    inputs = {"d": rand(4, 3), "i": np.array([[1]], np.int64), "u": rand(1, 4)}
    with pytest.raises(ValueError, match="updates shape"):
        run_kernel("ScatterND", inputs, opset=18)


def _tensor_scatter_loop(past, update, write_indices, mode, axis):
    """The spec's pseudocode, element by element (an independent oracle)."""
    out = past.copy()
    axis %= past.ndim
    for prefix in np.ndindex(past.shape[:axis]):
        for s in range(update.shape[axis]):
            pos = write_indices[prefix[0]] + s
            if mode == "circular":
                pos %= past.shape[axis]
            out[(*prefix, pos)] = update[(*prefix, s)]
    return out


@pytest.mark.parametrize("mode", ["linear", "circular"])
@pytest.mark.parametrize("axis", [-2, 1, 2])
@pytest.mark.parametrize("with_indices", [True, False])
def test_tensor_scatter(mode, axis, with_indices):
    past = rand(3, 4, 8, 5)
    ushape = list(past.shape)
    ushape[axis] = 3
    update = rand(*ushape)
    max_len = past.shape[axis]
    high = max_len if mode == "circular" else max_len - 3 + 1
    starts = index(0, high, 3) if with_indices else np.zeros(3, np.int64)
    inputs = {"past": past, "update": update, "w": starts if with_indices else None}
    (got,) = run_kernel("TensorScatter", inputs, {"mode": mode, "axis": axis}, opset=24)
    np.testing.assert_array_equal(got, _tensor_scatter_loop(past, update, starts, mode, axis))
    check_against_ort("TensorScatter", inputs, {"mode": mode, "axis": axis}, opset=24)


def test_tensor_scatter_linear_overflow_raises():
    inputs = {"past": rand(2, 4, 3), "u": rand(2, 2, 3), "w": np.array([0, 3], np.int64)}
    with pytest.raises(IndexError, match="sequence length 4"):
        run_kernel("TensorScatter", inputs, {"axis": 1}, opset=24)


# ---------------------------------------------------------------------------------------------
# OneHot, NonZero, Unique, Compress, ReverseSequence


@pytest.mark.parametrize("axis", [-1, 0, 1, -3])
@pytest.mark.parametrize(  # type pairs onnxruntime implements
    "idx_dtype, depth_dtype",
    [(np.int64, np.int64), (np.int32, np.float32), (np.float32, np.float32)],
)
def test_one_hot(axis, idx_dtype, depth_dtype):
    depth = 6
    inputs = {
        "i": index(-depth - 2, depth + 2, 3, 4).astype(idx_dtype),  # some out of range
        "depth": np.array(depth, depth_dtype),
        "v": rand(2),
    }
    check_against_ort("OneHot", inputs, {"axis": axis}, opset=11)


@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), (0, 3)])
@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.bool_])
def test_nonzero(shape, dtype):
    x = (index(0, 3, *shape) * (index(0, 2, *shape))).astype(dtype)
    check_against_ort("NonZero", {"x": x})


@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("n_outputs", [1, 4])
def test_unique(sorted_, axis, n_outputs):
    x = index(0, 3, 6, 4).astype(np.float32)
    if axis is not None:  # make some slices repeat
        x = np.concatenate([x, np.take(x, [1, 0, 1], axis=axis)], axis=axis)
    attrs = {"sorted": sorted_} if axis is None else {"sorted": sorted_, "axis": axis}
    check_against_ort("Unique", {"x": x}, attrs, n_outputs=n_outputs, opset=11)


@pytest.mark.parametrize("axis", [None, 0, 1, -1])
@pytest.mark.parametrize("cond_len", ["full", "short"])
def test_compress(axis, cond_len):
    x = rand(4, 5)
    length = x.size if axis is None else x.shape[axis]
    if cond_len == "short":
        length -= 2
    cond = index(0, 2, length).astype(bool)
    attrs = {} if axis is None else {"axis": axis}
    check_against_ort("Compress", {"x": x, "c": cond}, attrs)


@pytest.mark.parametrize("batch_axis, time_axis", [(1, 0), (0, 1)])
def test_reverse_sequence(batch_axis, time_axis):
    batch, steps = 4, 6
    shape = [0, 0, 3]
    shape[batch_axis], shape[time_axis] = batch, steps
    lens = index(1, steps + 1, batch)
    inputs = {"x": rand(*shape), "lens": lens}
    check_against_ort("ReverseSequence", inputs, {"batch_axis": batch_axis, "time_axis": time_axis})

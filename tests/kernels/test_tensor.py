"""Data-movement reference kernels (tensor.py) against onnxruntime on fresh random inputs."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from tests.kernels.ort_oracle import check_against_ort, one_node_model, run_kernel, run_ort

rng = np.random.default_rng()


def rand(*shape: int, dtype=np.float32) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        return np.asarray(rng.integers(1, 100, size=shape), dtype=dtype)
    return np.asarray(rng.standard_normal(shape) + 0.5, dtype=dtype)


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Reshape, Flatten, Squeeze, Unsqueeze, Transpose


@pytest.mark.parametrize(
    "in_shape, target, allowzero",
    [
        ((2, 3, 4), (4, 6), 0),
        ((2, 3, 4), (-1,), 0),
        ((2, 3, 4), (0, -1), 0),
        ((2, 3, 4), (0, 0, 2, 2), 0),
        ((2, 3, 4), (3, -1, 2), 0),
        ((0, 3, 4), (0, 3, 4), 1),
        ((0, 3, 4), (3, 0), 1),
        ((2, 1, 4), (8,), 1),
    ],
)
@pytest.mark.parametrize("opset", [13, 21])
def test_reshape(in_shape, target, allowzero, opset):
    opset = max(opset, 14) if allowzero else opset  # allowzero exists from opset 14
    attrs = {"allowzero": allowzero} if opset >= 14 else {}
    check_against_ort("Reshape", {"x": rand(*in_shape), "s": i64(*target)}, attrs, opset=opset)


def test_reshape_returns_a_view():
    x = rand(2, 6)
    (y,) = run_kernel("Reshape", {"x": x, "s": i64(3, 4)})
    assert np.shares_memory(x, y)


@pytest.mark.parametrize("target", [(5, 5), (-1, -1), (0, 0, 0, 7)])
def test_reshape_bad_shape_raises(target):
    with pytest.raises(ValueError, match="Reshape"):
        run_kernel("Reshape", {"x": rand(2, 12), "s": i64(*target)})


@pytest.mark.parametrize("axis", [0, 1, 2, 3, -1, -3])
def test_flatten(axis):
    check_against_ort("Flatten", {"x": rand(2, 3, 4)}, {"axis": axis}, opset=13)


@pytest.mark.parametrize("axes", [None, [0], [2, -1], [-5]])
@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze(axes, opset):
    x = rand(1, 3, 1, 4, 1)
    if axes is None:
        check_against_ort("Squeeze", {"x": x}, opset=opset)
    elif opset < 13:
        check_against_ort("Squeeze", {"x": x}, {"axes": axes}, opset=opset)
    else:
        check_against_ort("Squeeze", {"x": x, "axes": i64(*axes)}, opset=opset)


def test_squeeze_non_unit_axis_raises():
    with pytest.raises(ValueError, match="size is not 1"):
        run_kernel("Squeeze", {"x": rand(2, 3), "axes": i64(1)})


@pytest.mark.parametrize("axes", [[0], [2], [-1], [0, 3], [4, 0, 2], [-2, 1]])
@pytest.mark.parametrize("opset", [11, 13])
def test_unsqueeze(axes, opset):
    x = rand(3, 4)
    if opset < 13:
        check_against_ort("Unsqueeze", {"x": x}, {"axes": axes}, opset=opset)
    else:
        check_against_ort("Unsqueeze", {"x": x, "axes": i64(*axes)}, opset=opset)


@pytest.mark.parametrize("perm", [None, [0, 1, 2, 3], [3, 2, 1, 0], [0, 2, 3, 1], [1, 0, 3, 2]])
def test_transpose(perm):
    attrs = {} if perm is None else {"perm": perm}
    check_against_ort("Transpose", {"x": rand(2, 3, 4, 5)}, attrs)


# ---------------------------------------------------------------------------------------------
# Concat, Split, Slice, Expand, Tile


@pytest.mark.parametrize("axis", [0, 1, 2, -1, -3])
def test_concat(axis):
    shapes = []
    for extra in (1, 3, 0):
        shape = [2, 3, 4]
        shape[axis] = extra
        shapes.append(shape)
    inputs = {f"x{i}": rand(*s) for i, s in enumerate(shapes)}
    check_against_ort("Concat", inputs, {"axis": axis})


def test_concat_mismatch_raises():
    with pytest.raises(ValueError, match="Concat"):
        run_kernel("Concat", {"a": rand(2, 3), "b": rand(3, 3)}, {"axis": 1})


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("opset", [11, 13, 18])
def test_split_sizes(axis, opset):
    x = rand(6, 6, 6)
    sizes = [1, 3, 2]
    if opset < 13:
        check_against_ort("Split", {"x": x}, {"axis": axis, "split": sizes}, n_outputs=3, opset=11)
    else:
        check_against_ort("Split", {"x": x, "s": i64(*sizes)}, {"axis": axis}, n_outputs=3)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_split_equal_parts(n):
    check_against_ort("Split", {"x": rand(4, 6)}, {"axis": 1}, n_outputs=n, opset=13)


@pytest.mark.parametrize("dim, n", [(7, 3), (5, 2), (6, 4), (4, 4)])
def test_split_num_outputs_uneven(dim, n):
    attrs = {"axis": 0, "num_outputs": n}
    check_against_ort("Split", {"x": rand(dim, 3)}, attrs, n_outputs=n, opset=18)


def test_split_uneven_without_num_outputs_raises():
    with pytest.raises(ValueError, match="divisible"):
        run_kernel("Split", {"x": rand(7)}, n_outputs=2, opset=13)


SLICE_CASES = [
    ((0, 1), (3, 4), None, None),
    ((1,), (-1,), (1,), None),
    ((-100, 2), (100, 4), (0, 2), (1, 1)),
    ((-1, 0), (-100, 5), (0, 2), (-1, 2)),
    ((10,), (-10,), (-1,), (-3,)),
    ((2, 0, 4), (0, 5, 1), (0, 1, 2), (-1, 3, -2)),
    ((3,), (3,), (1,), (1,)),
]


@pytest.mark.parametrize("starts, ends, axes, steps", SLICE_CASES)
def test_slice(starts, ends, axes, steps):
    inputs = {"x": rand(5, 6, 7), "starts": i64(*starts), "ends": i64(*ends)}
    inputs["axes"] = None if axes is None and steps is None else i64(*(axes or range(len(starts))))
    if steps is not None:
        inputs["steps"] = i64(*steps)
    elif inputs["axes"] is None:
        del inputs["axes"]
    check_against_ort("Slice", inputs, opset=13)


def test_slice_int64_extremes():
    big, small = np.iinfo(np.int64).max, np.iinfo(np.int64).min
    inputs = {
        "x": rand(4, 5),
        "s": i64(big, 1),
        "e": i64(small, big),
        "a": i64(0, 1),
        "p": i64(-1, 2),
    }
    check_against_ort("Slice", inputs, opset=13)


def test_slice_opset1_attributes():
    attrs = {"starts": [1, -3], "ends": [100, -1], "axes": [0, 2]}
    check_against_ort("Slice", {"x": rand(4, 5, 6)}, attrs, opset=9)


@pytest.mark.parametrize(
    "in_shape, target", [((3, 1), (2, 1, 6)), ((1,), (4,)), ((2, 3), (3,)), ((4, 1, 2), (1, 5, 1))]
)
def test_expand(in_shape, target):
    check_against_ort("Expand", {"x": rand(*in_shape), "s": i64(*target)})


def test_expand_incompatible_raises():
    with pytest.raises(ValueError, match="broadcast"):
        run_kernel("Expand", {"x": rand(3, 2), "s": i64(4, 4)})


@pytest.mark.parametrize("reps", [(1, 1, 1), (2, 1, 3), (0, 2, 1), (3, 3, 2)])
def test_tile(reps):
    check_against_ort("Tile", {"x": rand(2, 3, 4, dtype=np.int64), "r": i64(*reps)})


# ---------------------------------------------------------------------------------------------
# Pad, CenterCropPad


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize(
    "pads, axes",
    [
        ((1, 2, 0, 3, 1, 2, 0, 1), None),
        ((0, 0, 2, 2, 0, 0, 1, 1), None),
        ((2, 1, 3, 0), (1, 3)),
        ((1, 2), (-1,)),
        ((-1, 0, 2, 1, -2, 0), (1, 2, 3)),
    ],
)
def test_pad(mode, pads, axes):
    inputs = {"x": rand(2, 4, 5, 6), "pads": i64(*pads)}
    inputs["value"] = np.array(rng.standard_normal(), dtype=np.float32)
    if axes is not None:
        inputs["axes"] = i64(*axes)
    check_against_ort("Pad", inputs, {"mode": mode}, opset=19)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge"])
def test_pad_opset11_and_attribute_form(mode):
    x = rand(3, 4, dtype=np.int32)
    check_against_ort("Pad", {"x": x, "pads": i64(1, 2, 2, 1)}, {"mode": mode}, opset=11)
    attrs = {"mode": mode, "pads": [1, 2, 2, 1], "value": 1.5}  # Pad-2 is float only
    check_against_ort("Pad", {"x": x.astype(np.float32)}, attrs, opset=2)


def test_pad_reflect_wider_than_axis_raises():
    with pytest.raises(ValueError, match="reflect pads"):
        run_kernel("Pad", {"x": rand(3, 2), "pads": i64(0, 2, 0, 0)}, {"mode": "reflect"})


def test_squeeze_empty_axes_input_squeezes_all():
    check_against_ort("Squeeze", {"x": rand(1, 2, 1), "axes": i64()}, opset=13)


@pytest.mark.parametrize(
    "in_shape, target, axes",
    [
        ((5, 6, 3), (3, 4, 3), None),
        ((5, 6, 3), (8, 9, 3), None),
        ((5, 6, 3), (4, 9), [0, 1]),
        ((3, 5, 6), (7, 2), [-2, -1]),
    ],
)
def test_center_crop_pad(in_shape, target, axes):
    attrs = {} if axes is None else {"axes": axes}
    check_against_ort("CenterCropPad", {"x": rand(*in_shape), "s": i64(*target)}, attrs, opset=18)


# ---------------------------------------------------------------------------------------------
# Shape, Size, constants, Identity, Range, EyeLike, Trilu


@pytest.mark.parametrize(
    "start, end", [(None, None), (1, None), (None, -1), (-2, None), (1, 3), (-10, 10), (3, 1)]
)
def test_shape(start, end):
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    check_against_ort("Shape", {"x": rand(2, 3, 4, 5)}, attrs)


@pytest.mark.parametrize("in_shape", [(), (0, 3), (2, 3, 4)])
def test_size(in_shape):
    check_against_ort("Size", {"x": rand(*in_shape)})


def _run_with_tensor_attr(op, inputs, name, value, opset=21):
    model = one_node_model(op, inputs, {name: numpy_helper.from_array(value)}, opset=opset)
    (expected,) = run_ort(model, inputs)
    (got,) = run_kernel(op, inputs, {name: value}, opset=opset)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.int32, np.bool_])
@pytest.mark.parametrize("target", [(2, 3), (4,), (0, 2), ()])
def test_constant_of_shape(dtype, target):
    value = np.array([rng.integers(1, 9)], dtype=dtype)
    _run_with_tensor_attr("ConstantOfShape", {"s": i64(*target)}, "value", value)


def test_constant_of_shape_default_is_float_zero():
    check_against_ort("ConstantOfShape", {"s": i64(3, 2)})


@pytest.mark.parametrize(
    "name, value",
    [("value_float", 2.5), ("value_floats", [1.0, -2.0]), ("value_int", 7), ("value_ints", [3, 4])],
)
def test_constant_scalar_attrs(name, value):
    check_against_ort("Constant", {}, {name: value}, opset=13)


def test_constant_tensor_value():
    _run_with_tensor_attr("Constant", {}, "value", rand(3, 4))


def test_identity_passes_sequences_and_optionals():
    check_against_ort("Identity", {"x": rand(3, 2)})
    seq = [rand(2), rand(3)]
    (got,) = run_kernel("Identity", {"x": seq})
    assert len(got) == 2 and all(a is b for a, b in zip(got, seq))
    assert run_kernel("Identity", {"x": None}) == [None]


@pytest.mark.parametrize(
    "start, limit, delta, dtype",
    [
        (3, 9, 3, np.int64),
        (10, 4, -2, np.int32),
        (0, 10, 3, np.int16),
        (5, 5, 1, np.int64),
        (1.5, 8.2, 0.7, np.float32),
        (-2.0, -9.0, -1.3, np.float64),
        (0.0, 100.0, 0.1, np.float32),
    ],
)
def test_range(start, limit, delta, dtype):
    inputs = {n: np.array(v, dtype=dtype) for n, v in (("s", start), ("l", limit), ("d", delta))}
    check_against_ort("Range", inputs, opset=11, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape, k", [((4, 4), 0), ((3, 5), 1), ((5, 3), -2), ((3, 4), 7)])
@pytest.mark.parametrize("dtype", [None, 7])
def test_eye_like(shape, k, dtype):
    attrs = {"k": k} if dtype is None else {"k": k, "dtype": dtype}
    check_against_ort("EyeLike", {"x": rand(*shape)}, attrs)


@pytest.mark.parametrize("upper", [0, 1])
@pytest.mark.parametrize("k", [None, 0, 1, -2, 10, -10])
@pytest.mark.parametrize("shape", [(4, 4), (2, 3, 5), (5, 3)])
def test_trilu(upper, k, shape):
    inputs = {"x": rand(*shape)}
    if k is not None:
        inputs["k"] = np.array(k, dtype=np.int64)
    check_against_ort("Trilu", inputs, {"upper": upper}, opset=14)


# ---------------------------------------------------------------------------------------------
# DepthToSpace, SpaceToDepth


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
@pytest.mark.parametrize("b, shape", [(2, (2, 8, 3, 4)), (3, (1, 18, 2, 2)), (1, (1, 3, 2, 2))])
def test_depth_to_space(mode, b, shape):
    check_against_ort("DepthToSpace", {"x": rand(*shape)}, {"blocksize": b, "mode": mode}, opset=13)


@pytest.mark.parametrize("b, shape", [(2, (2, 3, 4, 6)), (3, (1, 2, 6, 3))])
def test_space_to_depth(b, shape):
    check_against_ort("SpaceToDepth", {"x": rand(*shape)}, {"blocksize": b}, opset=13)


@pytest.mark.parametrize("mode", ["DCR", "CRD"])
def test_space_to_depth_inverts_depth_to_space(mode):
    # onnxruntime lacks SpaceToDepth's mode (opset 28); check it undoes DepthToSpace instead.
    x = rand(2, 3, 4, 6)
    attrs = {"blocksize": 2, "mode": mode}
    (packed,) = run_kernel("SpaceToDepth", {"x": x}, attrs, opset=28)
    (expected,) = run_ort(
        one_node_model("DepthToSpace", {"x": packed}, attrs, opset=13), {"x": packed}
    )
    np.testing.assert_array_equal(expected, x)


def test_opset1_forms_of_tile_and_reshape():
    """Tile-1 (tiles along one axis) and Reshape-1 (shape attribute): one kernel each, told the
    opset; onnxruntime starts at opset 7, so the expectation is written out with numpy."""
    rng = np.random.default_rng()
    x = rand(2, 3, 4)
    axis, tiles = int(rng.integers(-3, 3)), int(rng.integers(0, 4))
    (y,) = run_kernel("Tile", {"x": x, "t": i64(tiles), "a": i64(axis)}, opset=1)
    expected = np.concatenate([x] * tiles, axis=axis) if tiles else np.take(x, [], axis=axis)
    np.testing.assert_array_equal(y, expected)
    (z,) = run_kernel("Reshape", {"x": x}, {"shape": [4, 0, -1]}, opset=1)
    np.testing.assert_array_equal(z, x.reshape(4, 3, 2))
    with pytest.raises(ValueError, match="Tile: repeats"):
        run_kernel("Tile", {"x": x, "r": i64(2, 2)}, opset=6)

"""The cuda backend's data-movement, indexing and sequence kernels against the numpy reference,
on fresh random inputs (on the GPU when there is one, else on torch CPU tensors)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch  # noqa: E402
from tensorkiln.kernels.registry import invoke, lookup  # noqa: E402

rng = np.random.default_rng()
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape: int, dtype=np.float32) -> np.ndarray:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return rng.integers(0, 2, size=shape).astype(bool)
    if dtype.kind in "iu":
        hi = min(np.iinfo(dtype).max, 1000)
        lo = 0 if dtype.kind == "u" else -hi
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
    return (rng.standard_normal(shape) * 3).astype(dtype)


def tt(a):
    """A host value as the cuda kernels take it (tensors on the CPU; lists for sequences)."""
    if isinstance(a, list):
        return [tt(x) for x in a]
    if isinstance(a, np.ndarray) and a.ndim == 0:
        return to_torch(a.reshape(1), DEVICE).reshape(())
    return to_torch(a, DEVICE)


def run(op, args, attrs=None, n_outputs=1, opset=24, torch_args=None):
    """Both backends' outputs: (cuda outputs as numpy, reference outputs)."""
    attrs = attrs or {}
    ref = invoke(lookup(op, "", opset, "reference"), args, attrs, n_outputs)
    dev_args = torch_args if torch_args is not None else [tt(a) for a in args]
    got = invoke(lookup(op, "", opset, "cuda"), dev_args, attrs, n_outputs)
    return got, ref


def check(op, args, attrs=None, n_outputs=1, opset=24, torch_args=None):
    got, ref = run(op, args, attrs, n_outputs, opset, torch_args)
    assert len(got) == len(ref)
    for g, r in zip(got, ref):
        if isinstance(r, list):
            assert isinstance(g, list) and len(g) == len(r)
            pairs = list(zip(g, r))
        else:
            pairs = [(g, r)]
        for gi, ri in pairs:
            assert isinstance(gi, torch.Tensor), f"{op}: output is {type(gi)}, not a tensor"
            gn = to_numpy(gi)
            assert gn.dtype == ri.dtype, f"{op}: dtype {gn.dtype} != {ri.dtype}"
            assert gn.shape == ri.shape, f"{op}: shape {gn.shape} != {ri.shape}"
            np.testing.assert_array_equal(gn, ri)
    return got


def i64(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int64)


def same_storage(a, b) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


# ---------------------------------------------------------------------------------------------
# Views


def test_shape_ops_return_views():
    x = tt(rand(2, 3, 4))
    cases = [
        ("Reshape", [x, tt(i64(4, -1))], {}),
        ("Flatten", [x], {"axis": 2}),
        ("Unsqueeze", [x, tt(i64(-1, 0))], {}),
        ("Transpose", [x], {"perm": [2, 0, 1]}),
        ("Slice", [x, tt(i64(1, -3)), tt(i64(100, 4)), tt(i64(1, -1)), tt(i64(1, 2))], {}),
    ]
    for op, args, attrs in cases:
        (y,) = invoke(lookup(op, "", 24, "cuda"), args, attrs, 1)
        assert same_storage(x, y), op
    (y,) = invoke(lookup("Squeeze", "", 24, "cuda"), [tt(rand(2, 1, 3))], {}, 1)
    parts = invoke(lookup("Split", "", 24, "cuda"), [x, tt(i64(1, 3))], {"axis": 2}, 2)
    assert all(same_storage(x, p) for p in parts)


@pytest.mark.parametrize(
    "starts, ends, axes, steps",
    [
        ((-1, 0), (-100, 5), (1, 2), (-1, 2)),
        ((4, 10**10), (0, -(10**10)), (2, 0), (-2, -1)),
        ((0,), (-1,), (-1,), (-3,)),  # empty
        ((2, 1), (1, 3), None, None),
    ],
)
def test_slice_negative_steps_and_clamping(starts, ends, axes, steps):
    x = rand(4, 5, 6, dtype=np.float16)
    args = [x, i64(*starts), i64(*ends)]
    if axes is not None:
        args += [i64(*axes), i64(*steps)]
    check("Slice", args)
    # a non-contiguous input
    xt = tt(rand(6, 5, 4)).permute(2, 1, 0)
    check("Slice", [to_numpy(xt), *args[1:]], torch_args=[xt, *[tt(a) for a in args[1:]]])


# ---------------------------------------------------------------------------------------------
# Pad, CenterCropPad, Expand, Tile, DepthToSpace


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
@pytest.mark.parametrize("dtype", [np.float16, np.int32, np.uint16, np.bool_])
def test_pad_modes(mode, dtype):
    x = rand(3, 4, 5, dtype=dtype)
    pads = i64(1, 0, 2, 2, -1, 3)
    check("Pad", [x, pads, np.array(rand(1, dtype=dtype)[0])], {"mode": mode})
    check("Pad", [x, i64(0, 1, 1, -1), None, i64(-1, 0)], {"mode": mode})


def test_pad_wrap_larger_than_axis_and_attribute_form():
    check("Pad", [rand(2, 3), i64(0, 5, 1, 7)], {"mode": "wrap"})
    check("Pad", [rand(2, 3)], {"pads": [1, 0, 0, 2], "value": 1.5}, opset=2)


def test_center_crop_pad_expand_tile_depth_to_space():
    check("CenterCropPad", [rand(5, 4, 3), i64(2, 7)], {"axes": [0, -1]})
    check("Expand", [rand(3, 1, dtype=np.uint32), i64(2, 1, 4)])
    check("Tile", [rand(2, 3, dtype=np.int8), i64(2, 1)])
    check("Tile", [rand(2, 3), i64(0, 3)])
    x = rand(2, 8, 3, 3, dtype=np.float16)
    for mode in ("DCR", "CRD"):
        check("DepthToSpace", [x], {"blocksize": 2, "mode": mode})
        check("SpaceToDepth", [rand(2, 3, 4, 6)], {"blocksize": 2, "mode": mode})


def test_concat_split_uneven_and_empty():
    check("Concat", [rand(2, 0, 3), rand(2, 4, 3), rand(2, 1, 3)], {"axis": -2})
    check("Split", [rand(7, 2)], {"num_outputs": 3}, n_outputs=3, opset=18)
    check("Split", [rand(7, 2), i64(0, 7, 0)], {"axis": 0}, n_outputs=3)


# ---------------------------------------------------------------------------------------------
# Shape, Size, Constant, ConstantOfShape, Range, EyeLike, Trilu


def test_shape_and_size_are_int64_tensors():
    x = tt(rand(2, 3, 4))
    for op, attrs in [("Shape", {"start": -2}), ("Shape", {"end": 1}), ("Size", {})]:
        got = check(op, [to_numpy(x)], attrs)[0]
        assert got.device == x.device


def test_constant_on_device_and_strings_on_host():
    (f,) = invoke(lookup("Constant", "", 24, "cuda"), [], {"value_floats": [1.0, 2.5]}, 1)
    assert isinstance(f, torch.Tensor) and f.dtype == torch.float32
    (s,) = invoke(lookup("Constant", "", 24, "cuda"), [], {"value_strings": ["a", "b"]}, 1)
    assert isinstance(s, np.ndarray) and s.dtype == object
    check("Constant", [], {"value": rand(3, dtype=np.uint16)})
    check("Constant", [], {"value": np.array(2.5, dtype=np.float16)})
    check("Constant", [], {"value_int": 3})


def test_constant_of_shape():
    check("ConstantOfShape", [i64(2, 0, 3)])
    check("ConstantOfShape", [i64()], {"value": np.array([7], dtype=np.int8)})
    check("ConstantOfShape", [i64(3, 2)], {"value": rand(1, dtype=np.float16)})


@pytest.mark.parametrize(
    "dtype, start, limit, delta",
    [
        (np.int32, -7, 20, 3),
        (np.int64, 10, -3, -4),
        (np.int16, 5, 5, 1),
        (np.float32, 0.1, 7.3, 0.37),
        (np.float64, 3.0, -1.0, -0.3),
        (np.float16, 0.5, 9.0, 0.7),
    ],
)
def test_range(dtype, start, limit, delta):
    check("Range", [np.array(v, dtype=dtype) for v in (start, limit, delta)])


def test_eye_like_and_trilu():
    check("EyeLike", [rand(4, 6)], {"k": 2})
    check("EyeLike", [rand(5, 3, dtype=np.int32)], {"k": -1, "dtype": 9})
    for k in (-2, 0, 3):
        check("Trilu", [rand(2, 4, 5, dtype=np.uint32), np.array(k)], {"upper": 0})
        check("Trilu", [rand(4, 5, dtype=np.float16), np.array(k)])


# ---------------------------------------------------------------------------------------------
# Gathers


@pytest.mark.parametrize("dtype", [np.float16, np.uint64, np.bool_])
def test_gather_negative_and_scalar_indices(dtype):
    x = rand(4, 5, 3, dtype=dtype)
    idx = rng.integers(-5, 5, size=(2, 3))
    check("Gather", [x, idx], {"axis": 1})
    check("Gather", [x, np.array(-2, dtype=np.int32)], {"axis": -1})
    xt = tt(rand(3, 5, 4, dtype=dtype)).permute(2, 1, 0)  # non-contiguous data
    check("Gather", [to_numpy(xt), idx], {"axis": 1}, torch_args=[xt, tt(idx)])


@pytest.mark.parametrize(
    "indices, axis, view",
    [
        (np.array(1, np.int64), 1, True),  # a Q/K/V split: one slice, a view
        (np.array(-1, np.int32), 0, True),
        (i64(1, 2, 3), 2, True),  # a run of consecutive indices: narrow
        (i64(-3, -2), 1, True),
        (i64(2, 0), 1, False),  # any other order: index_select
        (np.array([[0, 1]], np.int64), 1, False),
    ],
)
def test_gather_at_indices_known_on_the_host_is_a_view(indices, axis, view):
    """Indices whose values the host knows (constants, mirrored shape arithmetic) that pick one
    slice or a consecutive run give a view of the data, with the reference's values."""
    from tensorkiln.kernels.cuda.convert import remember_host_values

    x = rand(3, 4, 5, dtype=np.float32)
    data, idx = tt(x), tt(indices)
    remember_host_values(idx, indices)
    (got,) = check("Gather", [x, indices], {"axis": axis}, torch_args=[data, idx])
    assert same_storage(got, data) == view


def test_gather_index_out_of_range_is_clamped_not_a_fault():
    (y,) = invoke(lookup("Gather", "", 24, "cuda"), [tt(i64(1, 2, 3)), tt(i64(7, -9))], {}, 1)
    assert y.tolist() == [3, 1]


@pytest.mark.parametrize("constant", [False, True])
def test_gather_wraps_negatives_and_clamps_the_rest(constant):
    # every index from -size-3 to size+3, as the reference wraps them and the module doc clamps
    from tensorkiln.kernels.cuda.convert import _KEPT, mark_constant

    x = rand(5, 3, dtype=np.float32)
    raw = rng.permutation(np.arange(-8, 9)).astype(np.int64)
    idx = tt(raw)
    if constant:  # (an engine's constant, or a value kept per input shape)
        mark_constant(idx)
    gather = lookup("Gather", "", 24, "cuda")
    want = x[np.clip(np.where(raw < 0, raw + 5, raw), 0, 4)]
    for _ in range(2):
        (y,) = invoke(gather, [tt(x), idx], {}, 1)
        np.testing.assert_array_equal(y.numpy(), want)
    # the wrapped indices of a constant are made once and kept with it
    assert (idx in _KEPT) == constant


def test_gather_elements_and_gather_nd():
    x = rand(4, 5, 6, dtype=np.uint16)
    idx = rng.integers(-5, 5, size=(3, 5, 2))
    check("GatherElements", [x, idx], {"axis": 1})
    idx = np.stack([rng.integers(-4, 4, size=(2, 3)), rng.integers(0, 5, size=(2, 3))], -1)
    check("GatherND", [x, idx])
    x = rand(2, 3, 4, 5)
    idx = np.stack([rng.integers(-3, 3, size=(2, 3)), rng.integers(0, 4, size=(2, 3))], -1)
    check("GatherND", [x, idx], {"batch_dims": 1})
    check("GatherND", [x, np.array([[1, -1, 2, 0]])])  # single elements


# ---------------------------------------------------------------------------------------------
# Scatters


@pytest.mark.parametrize("reduction", ["none", "add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.float64])
def test_scatter_elements_reductions_with_duplicates(reduction, dtype):
    data = rand(4, 6, dtype=dtype)
    if reduction == "none":  # duplicate writes are order-dependent: use a permutation
        idx = np.stack([rng.permutation(6)[:4] - 6 for _ in range(4)])
    else:
        idx = rng.integers(-6, 6, size=(4, 4))
    upd = rand(4, 4, dtype=dtype)
    check("ScatterElements", [data, idx, upd], {"axis": -1, "reduction": reduction})


@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
@pytest.mark.parametrize("dtype", [np.int64, np.uint16, np.bool_])
def test_scatter_nd_reductions_with_duplicates(reduction, dtype):
    data = rand(5, 3, 2, dtype=dtype)
    idx = rng.integers(-5, 5, size=(6, 1))
    upd = rand(6, 3, 2, dtype=dtype)
    check("ScatterND", [data, idx, upd], {"reduction": reduction})


def test_scatter_nd_and_scatter():
    data = rand(4, 5, dtype=np.float16)
    idx = np.array([[0, -1], [3, 2], [-2, 0]])
    check("ScatterND", [data, idx, rand(3, dtype=np.float16)])
    idx = np.stack([rng.permutation(4)[:2] for _ in range(5)], 1)
    check("Scatter", [data, idx, rand(2, 5, dtype=np.float16)], {"axis": 0}, opset=10)


@pytest.mark.parametrize("mode", ["linear", "circular"])
def test_tensor_scatter(mode):
    cache = rand(3, 2, 8, 4, dtype=np.float16)
    update = rand(3, 2, 3, 4, dtype=np.float16)
    starts = np.array([0, 5, 2] if mode == "linear" else [6, 7, 0], dtype=np.int64)
    check("TensorScatter", [cache, update, starts], {"mode": mode})
    check("TensorScatter", [cache, update], {"mode": mode})


# ---------------------------------------------------------------------------------------------
# OneHot, NonZero, Unique, Compress, ReverseSequence


def test_one_hot():
    idx = rng.integers(-6, 8, size=(3, 4))
    values = np.array([-1, 5], dtype=np.int32)
    for axis in (-1, 0, 1):
        check("OneHot", [idx, np.array(6), values], {"axis": axis})
    check("OneHot", [idx.astype(np.float32) + 0.4, np.array(5.7), rand(2, dtype=np.float16)])


@pytest.mark.parametrize("dtype", [np.float32, np.uint16, np.bool_])
def test_nonzero(dtype):
    x = rand(3, 4, 5, dtype=dtype) * (rng.random((3, 4, 5)) > 0.5).astype(dtype)
    check("NonZero", [x])
    check("NonZero", [np.array(3, dtype=dtype)])
    check("NonZero", [np.zeros((0, 3), dtype=dtype)])


@pytest.mark.parametrize("sorted_", [0, 1])
@pytest.mark.parametrize("dtype", [np.float16, np.int64, np.uint32])
def test_unique(sorted_, dtype):
    x = rng.integers(0, 6, size=(4, 7)).astype(dtype)
    check("Unique", [x], {"sorted": sorted_}, n_outputs=4)
    rows = np.concatenate([x, x[::2], x[1:2]])[rng.permutation(7)]
    check("Unique", [rows], {"sorted": sorted_, "axis": 0}, n_outputs=4)
    check("Unique", [x[:, :5] % 2], {"sorted": sorted_, "axis": -1}, n_outputs=4)
    check("Unique", [np.zeros(0, dtype=dtype)], {"sorted": sorted_}, n_outputs=4)


def test_compress_and_reverse_sequence():
    x = rand(4, 5, dtype=np.int8)
    check("Compress", [x, np.array([1, 0, 1], dtype=bool)], {"axis": 1})
    check("Compress", [x, rng.random(11) > 0.5])
    check("Compress", [x, np.zeros(4, dtype=bool)], {"axis": -2})
    seq = rand(5, 3, 2, dtype=np.float16)
    check("ReverseSequence", [seq, np.array([5, 0, 3])], {"batch_axis": 1, "time_axis": 0})
    check("ReverseSequence", [seq, np.array([1, 2, 2, 3, 0])], {"batch_axis": 0, "time_axis": 1})
    seq = rand(4, 2, 3, dtype=np.uint64)
    check("ReverseSequence", [seq, np.array([4, 1])], {"batch_axis": 1, "time_axis": 0})


# ---------------------------------------------------------------------------------------------
# Sequences and optionals


def test_sequence_ops():
    parts = [rand(2, 3), rand(1, 3), rand(4, 3)]
    check("SequenceConstruct", parts)
    check("SequenceAt", [parts, np.array(-1)])
    check("SequenceErase", [parts, np.array(0)])
    check("SequenceErase", [parts])
    check("SequenceInsert", [parts, rand(5, 3), np.array(-2)])
    check("SequenceInsert", [[], rand(5, 3)])
    (n,) = check("SequenceLength", [parts])
    assert n.dtype == torch.int64 and n.dim() == 0
    check("ConcatFromSequence", [parts], {"axis": -2})
    check("ConcatFromSequence", [[rand(2, 3) for _ in range(3)]], {"axis": -1, "new_axis": 1})


def test_sequence_inputs_are_not_mutated():
    parts = [tt(rand(2)), tt(rand(2))]
    for op, args in [
        ("SequenceErase", [parts, tt(np.array(0))]),
        ("SequenceInsert", [parts, tt(rand(2))]),
    ]:
        invoke(lookup(op, "", 24, "cuda"), args, {}, 1)
        assert len(parts) == 2


def test_split_to_sequence():
    x = rand(7, 4, dtype=np.float16)
    check("SplitToSequence", [x], {"axis": 0, "keepdims": 0})
    check("SplitToSequence", [x], {"axis": -1})
    check("SplitToSequence", [x, np.array(3)], {"axis": 0})
    check("SplitToSequence", [x, i64(1, 0, 3)], {"axis": 1})


def test_optionals():
    x = rand(3)
    (has,) = check("OptionalHasElement", [x])
    assert has.dtype == torch.bool and bool(has)
    got = invoke(lookup("OptionalHasElement", "", 24, "cuda"), [None], {}, 1)[0]
    assert isinstance(got, torch.Tensor) and not bool(got)
    check("OptionalGetElement", [x])
    check("Optional", [[rand(2), rand(1)]])
    assert invoke(lookup("Optional", "", 24, "cuda"), [], {"type": None}, 1) == [None]


def test_opset1_forms_of_reshape_slice_tile():
    """Reshape-1 and Slice-1 take attributes, Tile-1 tiles one axis: the one kernel of each op."""
    x = rand(2, 3, 4)
    axis, tiles = int(rng.integers(-3, 3)), int(rng.integers(0, 4))
    check("Tile", [x, i64(tiles), i64(axis)], opset=1)
    check("Reshape", [x], {"shape": [0, -1, 2]}, opset=1)
    check("Slice", [x], {"starts": [1, -3], "ends": [100, -1], "axes": [0, 2]}, opset=1)

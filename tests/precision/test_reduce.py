"""reduce_precision: float16/bfloat16 engines keep their float32 edges and compute inside in the
reduced type; Before/Expected structure and numbers against the float32 reference."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.ir import DType
from tensorkiln.precision import reduce_precision
from tensorkiln.runtime import Runner
from tests.passes.util import graph_of, model, ops

F = TensorProto.FLOAT
RNG = np.random.default_rng(5)


def _mlp():
    w = RNG.standard_normal((16, 8)).astype(np.float32)
    b = RNG.standard_normal(8).astype(np.float32)
    mask = np.array([0.0, -3.4e38], np.float32)  # a "minus infinity" mask constant
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["r"]),
        helper.make_node("Cast", ["r"], ["c"], to=F),
        helper.make_node("ReduceMax", ["mask"], ["m"], keepdims=1),
        helper.make_node("Add", ["c", "m"], ["y"]),
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((w, "w"), (b, "b"), (mask, "mask"))]
    return model(
        nodes,
        [helper.make_tensor_value_info("x", F, ["N", 16])],
        [helper.make_tensor_value_info("y", F, ["N", 8])],
        inits,
    )


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_structure_and_edges(dtype: DType) -> None:
    g = graph_of(_mlp())
    changed = reduce_precision(g, dtype)
    assert changed > 0
    # Expected: a Cast in, the body in the reduced type, a Cast out; float32 at the edges.
    assert ops(g) == ["Cast", "MatMul", "Add", "Relu", "Cast", "ReduceMax", "Add", "Cast"]
    assert g.inputs[0].dtype == DType.FLOAT and g.outputs[0].dtype == DType.FLOAT
    assert g.nodes[0].attrs["to"] == dtype.value and g.nodes[-1].attrs["to"] == DType.FLOAT.value
    assert g.nodes[4].attrs["to"] == dtype.value  # the model's own Cast to float32 follows along
    inner = [v for n in g.nodes[1:-1] for v in n.outputs]
    assert all(v.dtype == dtype for v in inner), [(v.name, v.dtype) for v in inner]
    consts = {v.name: v.const for v in g.initializers}
    assert all(c.dtype == dtype.numpy for c in consts.values())
    # the -3.4e38 constant saturates to the type's lowest finite value instead of -inf
    assert np.isfinite(consts["mask"].astype(np.float32)).all()
    assert consts["mask"][1] == ml_dtypes.finfo(dtype.numpy).min


@pytest.mark.parametrize("dtype", [DType.FLOAT16, DType.BFLOAT16])
def test_numbers_match_float32(dtype: DType) -> None:
    m = _mlp()
    x = RNG.standard_normal((4, 16)).astype(np.float32)
    want = Runner(m).infer({"x": x})["y"]
    g = graph_of(m)
    reduce_precision(g, dtype)
    got = Runner(g).infer({"x": x})["y"]
    assert got.dtype == np.float32 and got.shape == want.shape
    finite = want > -1e30  # the masked constant differs by design (saturated, not -3.4e38)
    err = np.linalg.norm(got[finite] - want[finite]) / np.linalg.norm(want[finite])
    assert err < (1e-2 if dtype == DType.FLOAT16 else 3e-2)


def test_resize_scales_stay_float32() -> None:
    scales = np.array([1, 1, 2, 2], np.float32)
    nodes = [helper.make_node("Resize", ["x", "", "scales"], ["y"], mode="linear")]
    m = model(
        nodes,
        [helper.make_tensor_value_info("x", F, [1, 2, 3, 3])],
        [helper.make_tensor_value_info("y", F, [1, 2, 6, 6])],
        [numpy_helper.from_array(scales, "scales")],
    )
    g = graph_of(m)
    reduce_precision(g, DType.FLOAT16)
    resize = next(n for n in g.nodes if n.op == "Resize")
    assert resize.inputs[0].dtype == DType.FLOAT16
    assert resize.inputs[2].const.dtype == np.float32
    x = RNG.standard_normal((1, 2, 3, 3)).astype(np.float32)
    want = Runner(m).infer({"x": x})["y"]
    got = Runner(g).infer({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


def test_rejects_other_dtypes() -> None:
    with pytest.raises(ValueError, match="float16 or bfloat16"):
        reduce_precision(graph_of(_mlp()), DType.FLOAT)

"""Bad input gives a clear error of tensorkiln's own type, never a crash or a deep traceback."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.errors import (
    GraphError,
    InputError,
    ModelLoadError,
    TensorkilnError,
    UnsupportedOpError,
)


def _mlp(opset: int = 17) -> onnx.ModelProto:
    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "w")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])]
    graph = helper.make_graph(nodes, "mlp", [x], [y], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def test_a_good_model_runs_and_matches_numpy(tmp_path):
    model = _mlp()
    path = tmp_path / "mlp.onnx"
    onnx.save(model, path)
    x = np.random.default_rng().standard_normal((5, 4)).astype(np.float32)
    w = numpy_helper.to_array(model.graph.initializer[0])
    out = tensorkiln.run_onnx(path, {"x": x})
    np.testing.assert_allclose(out["y"], np.maximum(x @ w, 0), rtol=1e-6, atol=1e-5)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="does not exist"):
        tensorkiln.import_onnx(tmp_path / "nope.onnx")


@pytest.mark.parametrize("keep", [0.1, 0.5, 0.9, 0.99])
def test_truncated_file(tmp_path, keep):
    data = _mlp().SerializeToString()
    path = tmp_path / "cut.onnx"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(TensorkilnError) as info:
        tensorkiln.import_onnx(path)
    assert "cut.onnx" in str(info.value) or "graph" in str(info.value)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="empty"):
        tensorkiln.import_onnx(path)


def test_random_bytes(tmp_path):
    rng = np.random.default_rng()
    for i in range(25):
        path = tmp_path / f"random{i}.onnx"
        path.write_bytes(
            rng.integers(0, 256, size=int(rng.integers(1, 4096)), dtype=np.uint8).tobytes()
        )
        with pytest.raises(ModelLoadError):
            tensorkiln.import_onnx(path)


def test_unknown_op_names_node_op_domain_and_opset():
    model = _mlp()
    model.graph.node[1].op_type = "Relux"
    model.graph.node[1].name = "act"
    with pytest.raises(UnsupportedOpError) as info:
        tensorkiln.Runner(model)
    msg = str(info.value)
    assert "'act'" in msg and "'Relux'" in msg and "ai.onnx" in msg and "opset 17" in msg
    assert "Relu" in msg  # the close match is suggested


def test_unknown_domain_lists_supported_domains():
    model = _mlp()
    model.graph.node[1].domain = "com.example"
    model.opset_import.append(helper.make_opsetid("com.example", 1))
    with pytest.raises(UnsupportedOpError) as info:
        tensorkiln.Runner(model)
    assert "com.example" in str(info.value) and "Supported domains" in str(info.value)


def test_opset_newer_than_onnx_knows():
    model = _mlp(opset=onnx.defs.onnx_opset_version() + 5)
    with pytest.raises(ModelLoadError, match="opset"):
        tensorkiln.import_onnx(model)


def test_dangling_input_names_the_node():
    model = _mlp()
    model.graph.node[1].input[0] = "nowhere"
    with pytest.raises(GraphError, match="nowhere"):
        tensorkiln.import_onnx(model)


def _external_model(tmp_path):
    model = _mlp()
    onnx.save(
        model,
        tmp_path / "ext.onnx",
        save_as_external_data=True,
        all_tensors_to_one_file=True,
        location="ext.onnx.data",
        size_threshold=0,
    )
    return tmp_path / "ext.onnx"


def test_external_data_loads(tmp_path):
    path = _external_model(tmp_path)
    x = np.random.default_rng().standard_normal((2, 4)).astype(np.float32)
    ref = onnx.load(path)
    w = numpy_helper.to_array(ref.graph.initializer[0])
    out = tensorkiln.run_onnx(path, {"x": x})
    np.testing.assert_allclose(out["y"], np.maximum(x @ w, 0), rtol=1e-6, atol=1e-5)


def test_missing_external_data_file(tmp_path):
    path = _external_model(tmp_path)
    (tmp_path / "ext.onnx.data").unlink()
    with pytest.raises(ModelLoadError, match=r"ext\.onnx\.data.*not found"):
        tensorkiln.import_onnx(path)


def test_truncated_external_data_file(tmp_path):
    path = _external_model(tmp_path)
    data = tmp_path / "ext.onnx.data"
    data.write_bytes(data.read_bytes()[:10])
    with pytest.raises(ModelLoadError, match="truncated"):
        tensorkiln.import_onnx(path)


def test_external_data_outside_model_folder_is_refused(tmp_path):
    path = _external_model(tmp_path)
    model = onnx.load(path, load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = "../../etc/passwd"
    onnx.save(model, path)
    with pytest.raises(ModelLoadError, match="outside"):
        tensorkiln.import_onnx(path)


@pytest.fixture
def runner():
    return tensorkiln.Runner(_mlp())


def test_wrong_input_name(runner):
    x = np.ones((2, 4), np.float32)
    with pytest.raises(InputError, match=r"unknown input name.*'X'.*'x'"):
        runner.infer({"X": x})


def test_missing_input(runner):
    with pytest.raises(InputError, match=r"missing input.*'x'"):
        runner.infer({})


def test_wrong_input_dtype(runner):
    with pytest.raises(InputError, match=r"'x' expects dtype float32.*got float64"):
        runner.infer({"x": np.ones((2, 4))})


def test_wrong_input_rank(runner):
    with pytest.raises(InputError, match="'x' expects rank 2"):
        runner.infer({"x": np.ones((2, 4, 1), np.float32)})


def test_wrong_input_size(runner):
    with pytest.raises(InputError, match=r"axis 1: 5 != 4"):
        runner.infer({"x": np.ones((2, 5), np.float32)})


def test_inconsistent_symbolic_dims():
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 2])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, ["N", 2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2])
    graph = helper.make_graph([helper.make_node("Add", ["a", "b"], ["y"])], "g", [a, b], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InputError, match=r"'N' = 3.*'N' = 2"):
        tensorkiln.run_onnx(
            model, {"a": np.ones((2, 2), np.float32), "b": np.ones((3, 2), np.float32)}
        )


def test_kernel_failure_names_the_node():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, None)
    s = helper.make_tensor_value_info("s", TensorProto.INT64, None)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Reshape", ["x", "s"], ["y"], name="bad_reshape")
    model = helper.make_model(
        helper.make_graph([node], "g", [x, s], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    with pytest.raises(TensorkilnError, match="bad_reshape"):
        tensorkiln.run_onnx(model, {"x": np.ones((2, 3), np.float32), "s": np.array([4, 4])})


def test_incompatible_static_shapes_fail_at_import():
    a = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])
    b = helper.make_tensor_value_info("b", TensorProto.FLOAT, [4, 5])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")
    model = helper.make_model(
        helper.make_graph([node], "g", [a, b], [y]), opset_imports=[helper.make_opsetid("", 17)]
    )
    with pytest.raises(GraphError, match=r"'mm'.*3 != 4"):
        tensorkiln.import_onnx(model)


@pytest.mark.parametrize(("dims", "index"), [([1 << 50], 0), ([3], 5)])
def test_sparse_initializer_with_impossible_dims_or_index(dims, index):
    """A sparse tensor's dense size and indices come from the file: bounded, never a traceback."""
    values = numpy_helper.from_array(np.ones(1, np.float32), "s")
    indices = numpy_helper.from_array(np.array([index], np.int64), "i")
    sparse = helper.make_sparse_tensor(values, indices, dims)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, None)
    node = helper.make_node("Add", ["x", "s"], ["y"])
    graph = helper.make_graph([node], "g", [x], [y], sparse_initializer=[sparse])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(ModelLoadError, match="sparse tensor 's'"):
        tensorkiln.import_onnx(model)

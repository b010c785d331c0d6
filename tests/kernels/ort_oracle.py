"""Check one reference kernel against onnxruntime on the same inputs.

    check_against_ort("Relu", {"X": x}, opset=14)

builds a one-node ONNX model, runs it in onnxruntime (the independent oracle), calls the kernel the
registry picks for that opset directly, and compares every output.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from tensorkiln.kernels.registry import lookup, node_kwargs


def one_node_model(
    op: str,
    inputs: dict[str, np.ndarray | None],
    attrs: dict | None = None,
    *,
    n_outputs: int = 1,
    opset: int = 21,
    domain: str = "",
) -> onnx.ModelProto:
    """A model of one node whose graph inputs are the non-None entries of ``inputs``."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    outs = [f"out{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outs, domain=domain, **(attrs or {}))
    graph_inputs = [
        helper.make_tensor_value_info(
            name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape)
        )
        for name, value in inputs.items()
        if value is not None
    ]
    graph_outputs = [helper.make_value_info(o, onnx.TypeProto()) for o in outs]
    graph = helper.make_graph([node], "one_node", graph_inputs, graph_outputs)
    opsets = [helper.make_opsetid("", opset)]
    if domain:
        opsets.append(helper.make_opsetid(domain, 1))
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run_ort(model: onnx.ModelProto, inputs: dict[str, np.ndarray | None]) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(
        model.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    feeds = {k: v for k, v in inputs.items() if v is not None}
    return sess.run(None, feeds)


def run_kernel(
    op: str,
    inputs: dict[str, np.ndarray | None],
    attrs: dict | None = None,
    *,
    n_outputs: int = 1,
    opset: int = 21,
    domain: str = "",
) -> list:
    entry = lookup(op, domain, opset)
    kwargs = node_kwargs(entry, dict(attrs or {}), n_outputs)  # as the executor calls it
    result = entry.fn(*inputs.values(), **kwargs)
    return list(result) if isinstance(result, tuple) else [result]


def check_against_ort(
    op: str,
    inputs: dict[str, np.ndarray | None],
    attrs: dict | None = None,
    *,
    n_outputs: int = 1,
    opset: int = 21,
    rtol: float = 1e-5,
    atol: float = 1e-6,
) -> list:
    """Run ``op`` in onnxruntime and through the reference kernel; assert the outputs agree."""
    model = one_node_model(op, inputs, attrs, n_outputs=n_outputs, opset=opset)
    expected = run_ort(model, inputs)
    got = run_kernel(op, inputs, attrs, n_outputs=n_outputs, opset=opset)
    for i, (g, e) in enumerate(zip(got, expected)):
        g = np.asarray(g)
        assert g.shape == e.shape, f"{op} output {i}: shape {g.shape} != onnxruntime's {e.shape}"
        assert g.dtype == e.dtype, f"{op} output {i}: dtype {g.dtype} != onnxruntime's {e.dtype}"
        if e.dtype.kind in "fc":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{op} output {i}")
        else:
            np.testing.assert_array_equal(g, e, err_msg=f"{op} output {i}")
    return got

"""fuse_squeeze_excite and the tensorkiln.SqueezeExcite kernels, against onnxruntime and the
unfused graph."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.kernels.reference.fused_se import squeeze_excite as reference
from tensorkiln.passes import PassManager
from tests.passes.util import assert_structure, graph_of, model, ops, run

ort = pytest.importorskip("onnxruntime")

F = TensorProto.FLOAT
mk = helper.make_node


def _init(name: str, arr: np.ndarray):
    return numpy_helper.from_array(np.asarray(arr, np.float32), name)


def _se_model(
    pool: str = "ReduceMean",
    act: str = "Relu",
    gate: str = "HardSigmoid",
    swap: bool = False,
    opset: int = 17,
    extra_output: str | None = None,
    stride: int = 1,
    c: int = 16,
    s: int = 4,
):
    rng = np.random.default_rng()
    inits = [
        _init("w1", rng.standard_normal((s, c, 1, 1)) * 0.5),
        _init("b1", rng.standard_normal(s)),
        _init("w2", rng.standard_normal((c, s, 1, 1)) * 0.5),
        _init("b2", rng.standard_normal(c)),
    ]
    nodes = []
    if pool == "GlobalAveragePool":
        nodes.append(mk("GlobalAveragePool", ["x"], ["p"]))
    elif opset >= 18:
        inits.append(numpy_helper.from_array(np.array([2, 3], np.int64), "axes"))
        nodes.append(mk("ReduceMean", ["x", "axes"], ["p"], keepdims=1))
    else:
        nodes.append(mk("ReduceMean", ["x"], ["p"], axes=[2, 3], keepdims=1))
    nodes.append(mk("Conv", ["p", "w1", "b1"], ["h0"], strides=[stride, stride]))
    if act == "Swish":
        nodes += [mk("Sigmoid", ["h0"], ["hs"]), mk("Mul", ["h0", "hs"], ["h"])]
    else:
        nodes.append(mk(act, ["h0"], ["h"]))
    nodes.append(mk("Conv", ["h", "w2", "b2"], ["g0"]))
    if gate == "HardSigmoid":
        nodes.append(mk("HardSigmoid", ["g0"], ["g"], alpha=1 / 6, beta=0.5))
    else:
        nodes.append(mk(gate, ["g0"], ["g"]))
    nodes.append(mk("Mul", ["g", "x"] if swap else ["x", "g"], ["y"]))
    outputs = [helper.make_tensor_value_info("y", F, None)]
    if extra_output:
        outputs.append(helper.make_tensor_value_info(extra_output, F, None))
    x = helper.make_tensor_value_info("x", F, ["n", c, 6, 7])
    return model(nodes, [x], outputs, inits, opset=opset)


CASES = [
    {},
    {"pool": "GlobalAveragePool", "act": "Swish", "gate": "Sigmoid"},
    {"swap": True, "opset": 18},
    {"act": "LeakyRelu", "gate": "Sigmoid", "c": 20, "s": 5},
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_se_block_fuses_and_matches_onnxruntime(case: dict) -> None:
    m = _se_model(**case)
    graph = graph_of(m)
    PassManager(3).run(graph)
    assert ops(graph) == ["tensorkiln.SqueezeExcite"]
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in (1, 3):
        x = np.random.default_rng().standard_normal((n, case.get("c", 16), 6, 7)).astype(np.float32)
        got = run(graph, {"x": x})["y"]
        (want,) = session.run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * float(np.abs(want).max()))


@pytest.mark.parametrize(
    "case",
    [{"extra_output": "p"}, {"extra_output": "h"}, {"extra_output": "g"}, {"stride": 2}],
    ids=str,
)
def test_se_block_with_a_reader_outside_or_a_strided_fc_is_left_alone(case: dict) -> None:
    graph = graph_of(_se_model(**case))
    PassManager(3).run(graph)
    assert "tensorkiln.SqueezeExcite" not in ops(graph)


def test_gate_of_another_tensor_is_left_alone() -> None:
    m = _se_model()
    mul = m.graph.node[-1]
    mul.input[0] = "x2"  # the gate scales a tensor other than the pooled one
    m.graph.input.append(helper.make_tensor_value_info("x2", F, ["n", 16, 6, 7]))
    graph = graph_of(m)
    PassManager(3).run(graph)
    assert "tensorkiln.SqueezeExcite" not in ops(graph)


def test_cuda_kernel_on_cpu_tensors_matches_the_reference() -> None:
    torch = pytest.importorskip("torch")
    from tensorkiln.kernels.cuda.fused_se import squeeze_excite

    rng = np.random.default_rng()
    x = rng.standard_normal((2, 24, 5, 5)).astype(np.float32)
    w1 = rng.standard_normal((6, 24, 1, 1)).astype(np.float32)
    w2 = rng.standard_normal((24, 6, 1, 1)).astype(np.float32)
    b2 = rng.standard_normal(24).astype(np.float32)
    attrs = {"activation": "Clip", "activation_min": 0.0, "activation_max": 6.0, "gate": "Sigmoid"}
    want = reference(x, w1, None, w2, b2, **attrs)
    t = torch.from_numpy
    got = squeeze_excite(t(x), t(w1), None, t(w2), t(b2), **attrs).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="W2 must be"):
        squeeze_excite(t(x), t(w1), None, t(w1), None)


def test_fusion_is_for_the_reference_and_cpu_backends_only() -> None:
    for backend, fused in ((None, True), ("reference", True), ("cpu", True), ("cuda", False)):
        graph = graph_of(_se_model())
        PassManager(3, backend=backend).run(graph)
        assert ("tensorkiln.SqueezeExcite" in ops(graph)) == fused, backend


def test_se_block_before_and_expected() -> None:
    """SiLU written out after the first FC: recognised first, then taken by ConvAct, then by SE."""
    m = _se_model(pool="GlobalAveragePool", act="Swish", gate="Sigmoid")
    graph = graph_of(m)
    x = np.random.default_rng().standard_normal((2, 16, 6, 7)).astype(np.float32)
    before = run(graph, {"x": x})["y"]
    pm = PassManager(3, backend="reference")
    pm.run(graph)
    se = mk("SqueezeExcite", ["x", "w1", "b1", "w2", "b2"], ["y"], domain="tensorkiln")
    attrs = {"activation": "Swish", "activation_alpha": 1.0, "gate": "Sigmoid"}
    se.attribute.extend(helper.make_attribute(k, v) for k, v in attrs.items())
    inputs, outputs = list(m.graph.input), list(m.graph.output)
    expected = graph_of(model([se], inputs, outputs, list(m.graph.initializer), fused=True))
    assert_structure(graph, expected)
    assert pm.stats["fuse_silu"] == 1 and pm.stats["fuse_squeeze_excite"] == 1
    np.testing.assert_allclose(run(graph, {"x": x})["y"], before, rtol=1e-5, atol=1e-6)

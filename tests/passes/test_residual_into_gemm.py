"""fold_residual_into_gemm: a transformer block's residual add moves into the GEMM before the
LayerNorm (GemmAct's fourth input Z), so the GEMM writes the sum and the LayerNorm reads it alone.

Checked against onnxruntime on the models as written (a pre-LN block, GPT-2's form: the GEMMs
read the tokens flattened through Reshapes and the sum feeds the next block; a post-LN block,
BERT's: 3-D MatMul + Add), built on the reference and cuda backends (the cuda kernels on CPU
tensors here), and the kernels' residual against numpy.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tests.passes.util import model

S, N = 6, 16


def _vi(name, shape):
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)


def _const(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


def _pre_ln(rng) -> onnx.ModelProto:
    """Two GPT-2 blocks' halves: y1 = LN(x + gemm(x)); y2 = LN(s1 + gemm(y1)), where s1 = x +
    gemm(x) is read by the second block as well; the GEMMs on [B*S, N] rows through Reshapes."""
    nodes, inits = [], [_const("rows", np.array([-1, N], np.int64)),
                        _const("tokens", np.array([-1, S, N], np.int64))]  # fmt: skip
    prev, stream = "x", "x"
    for k in range(2):
        w = (rng.standard_normal((N, N)) / 4).astype(np.float32)
        inits += [_const(f"w{k}", w), _const(f"b{k}", rng.standard_normal(N).astype(np.float32)),
                  _const(f"g{k}", rng.uniform(0.5, 1.5, N).astype(np.float32)),
                  _const(f"be{k}", rng.standard_normal(N).astype(np.float32))]  # fmt: skip
        nodes += [
            helper.make_node("Reshape", [prev, "rows"], [f"h{k}"]),
            helper.make_node("Gemm", [f"h{k}", f"w{k}", f"b{k}"], [f"p{k}"]),
            helper.make_node("Reshape", [f"p{k}", "tokens"], [f"q{k}"]),
            helper.make_node("Add", [stream, f"q{k}"] if k else [f"q{k}", stream], [f"s{k}"]),
            helper.make_node("LayerNormalization", [f"s{k}", f"g{k}", f"be{k}"], [f"y{k}"],
                             axis=-1, epsilon=1e-5),
        ]  # fmt: skip
        prev, stream = f"y{k}", f"s{k}"
    return model(nodes, [_vi("x", ["B", S, N])], [_vi("y1", ["B", S, N])], inits)


def post_ln(rng, n: int = N, head: int = 0) -> onnx.ModelProto:
    """BERT's output sub-block: LN(x + (MatMul(x, W) + b)) on [B, S, n], twice (the first LN's
    output read by the next GEMM and as the next residual); ``head``: then a MatMul to that
    many features, the output "out" (else "y1")."""
    nodes, inits, prev = [], [], "x"
    for k in range(2):
        inits += [_const(f"w{k}", (rng.standard_normal((n, n)) / 4).astype(np.float32)),
                  _const(f"b{k}", rng.standard_normal(n).astype(np.float32)),
                  _const(f"g{k}", rng.uniform(0.5, 1.5, n).astype(np.float32)),
                  _const(f"be{k}", rng.standard_normal(n).astype(np.float32))]  # fmt: skip
        nodes += [
            helper.make_node("MatMul", [prev, f"w{k}"], [f"m{k}"]),
            helper.make_node("Add", [f"m{k}", f"b{k}"], [f"p{k}"]),
            helper.make_node("Add", [f"p{k}", prev], [f"s{k}"]),
            helper.make_node("LayerNormalization", [f"s{k}", f"g{k}", f"be{k}"], [f"y{k}"],
                             axis=-1, epsilon=1e-5),
        ]  # fmt: skip
        prev = f"y{k}"
    if not head:
        return model(nodes, [_vi("x", ["B", S, n])], [_vi("y1", ["B", S, n])], inits)
    nodes.append(helper.make_node("MatMul", [prev, "w_out"], ["out"]))
    inits.append(_const("w_out", (rng.standard_normal((n, head)) / 5).astype(np.float32)))
    return model(nodes, [_vi("x", ["B", S, n])], [_vi("out", ["B", S, head])], inits)


def _ort(m: onnx.ModelProto, x: np.ndarray) -> np.ndarray:
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("backend", ["reference", "cpu", "cuda"])
@pytest.mark.parametrize("form", ["pre-ln", "post-ln"])
def test_the_residual_moves_into_the_gemm(tmp_path, backend: str, form: str) -> None:
    if backend != "reference":
        pytest.importorskip("torch")
    rng = np.random.default_rng()
    m = (_pre_ln if form == "pre-ln" else post_ln)(rng)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    builder = Builder(backend, device="cpu") if backend == "cuda" else Builder(backend)
    engine = builder.build(path, BuilderConfig())
    assert builder.last_report.passes.get("fold_residual_into_gemm") == 2
    gemms = [n for n in engine.graph.nodes if n.op == "GemmAct"]
    norms = [n for n in engine.graph.nodes if n.op == "LayerNorm"]
    assert len(gemms) == 2 and all(len(n.inputs) == 4 and n.inputs[3] is not None for n in gemms)
    assert len(norms) == 2 and all(len(n.inputs) <= 3 or n.inputs[3] is None for n in norms)
    loaded = Engine.load(_saved(engine, tmp_path))  # (the fourth input survives the file)
    assert [len(n.inputs) for n in loaded.graph.nodes if n.op == "GemmAct"] == [4, 4]
    for batch in (1, 3):
        x = rng.standard_normal((batch, S, N)).astype(np.float32)
        for e in (engine, loaded):
            got = e.create_execution_context().infer({"x": x})["y1"]
            np.testing.assert_allclose(got, _ort(m, x), rtol=1e-4, atol=1e-4)


def _saved(engine, tmp_path):
    path = tmp_path / "m.engine"
    engine.save(path)
    return path


def test_a_quantized_build_keeps_the_residual_in_the_layer_norm(tmp_path) -> None:
    """QGemmAct takes no residual: an INT8 build leaves the add where it was, and quantizes."""
    rng = np.random.default_rng()
    m = post_ln(rng)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    config = BuilderConfig()
    config.set_flag("int8")
    config.calibration_data = [{"x": rng.standard_normal((4, S, N)).astype(np.float32)}]
    builder = Builder("reference")
    engine = builder.build(path, config)
    assert "fold_residual_into_gemm" not in builder.last_report.passes
    assert [n.op for n in engine.graph.nodes].count("QGemmAct") == 2
    x = rng.standard_normal((2, S, N)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y1"]
    want = _ort(m, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.05


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_gemm_act_adds_its_residual(backend: str) -> None:
    """GemmAct(A, B, C, Z) = A @ B + C + Z for a 2-D and a 3-D A (numpy's float64 product as
    the oracle); a residual with an activation, or of another shape, is refused by name."""
    from tensorkiln.kernels.registry import invoke, lookup

    rng = np.random.default_rng()
    entry = lookup("GemmAct", "tensorkiln", 1, backend)
    convert = (lambda a: a) if backend == "reference" else _torch_cpu
    back = (lambda a: a) if backend == "reference" else (lambda t: t.numpy())
    b = rng.standard_normal((8, 5)).astype(np.float32)
    c = rng.standard_normal(5).astype(np.float32)
    for a_shape in ((7, 8), (2, 3, 8)):
        a = rng.standard_normal(a_shape).astype(np.float32)
        z = rng.standard_normal((*a_shape[:-1], 5)).astype(np.float32)
        got = back(invoke(entry, [convert(v) for v in (a, b, c, z)], {}, 1)[0])
        want = a.astype(np.float64) @ b + c + z
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    a = rng.standard_normal((7, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"residual Z .* without activation"):
        invoke(entry, [convert(v) for v in (a, b, c, np.ones((7, 5), np.float32))],
               {"activation": "Relu"}, 1)  # fmt: skip
    with pytest.raises(ValueError, match="residual Z has shape"):
        invoke(entry, [convert(v) for v in (a, b, c, np.ones((7, 4), np.float32))], {}, 1)


def _torch_cpu(a: np.ndarray):
    torch = pytest.importorskip("torch")
    return torch.from_numpy(np.ascontiguousarray(a))


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
@pytest.mark.parametrize("form", ["pre-ln", "post-ln"])
def test_the_residual_in_a_float16_engine(tmp_path, form: str, device: str) -> None:
    """fp16: the precision pass narrows the residual with the GEMM's other operands, and the
    engine agrees with onnxruntime to float16's rounding; on the GPU with tactics tuned (the
    residual goes in as cuBLASLt's C where a cuBLASLt algorithm won), on the CPU through the
    cuda kernels on CPU tensors."""
    pytest.importorskip("torch")
    rng = np.random.default_rng()
    m = (_pre_ln if form == "pre-ln" else post_ln)(rng)
    path = tmp_path / "m.onnx"
    onnx.save(m, path)
    config = BuilderConfig()
    config.set_flag("fp16")
    builder = Builder("cuda", device=device)
    engine = builder.build(path, config)
    assert builder.last_report.passes.get("fold_residual_into_gemm") == 2
    gemms = [n for n in engine.graph.nodes if n.op == "GemmAct"]
    assert all(v.dtype.name == "FLOAT16" for n in gemms for v in n.inputs if v is not None)
    batch, tol = (64, 1e-2) if device == "cuda" else (3, 5e-3)
    x = rng.standard_normal((batch, S, N)).astype(np.float32)
    got = np.asarray(engine.create_execution_context().infer({"x": x})["y1"], np.float32)
    want = _ort(m, x)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < tol

"""The autotuner on values in each op's domain: an RMS norm's variance is never negative in a real
model, so a layer that takes its square root must not be tuned (and rejected) on NaNs.

The cuda backend's kernels run on CPU tensors here, and the real Triton tactics through Triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET where there is no GPU).
"""

from __future__ import annotations

import contextlib
import io
import re
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.cli.main import main as cli_main  # noqa: E402
from tensorkiln.tactics import autotune  # noqa: E402
from tests.kernels.ort_oracle import run_ort  # noqa: E402
from tests.passes.util import model  # noqa: E402

F = TensorProto.FLOAT
D = 16


def rms_norm_model():
    """T5's RMS norm as exported: w * (x * 1 / sqrt(mean(x^2) + eps))."""
    rng = np.random.default_rng()
    w = (rng.standard_normal(D) * 0.1 + 1).astype(np.float32)
    nodes = [
        helper.make_node("Pow", ["x", "two"], ["sq"]),
        helper.make_node("ReduceMean", ["sq", "axes"], ["var"], keepdims=1),
        helper.make_node("Add", ["var", "eps"], ["ve"]),
        helper.make_node("Sqrt", ["ve"], ["sd"]),
        helper.make_node("Div", ["one", "sd"], ["inv"]),
        helper.make_node("Mul", ["x", "inv"], ["xn"]),
        helper.make_node("Mul", ["w", "xn"], ["y"]),
    ]
    consts = {"two": 2.0, "eps": 1e-6, "one": 1.0}
    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in consts.items()]
    inits += [
        numpy_helper.from_array(np.array([-1], np.int64), "axes"),
        numpy_helper.from_array(w, "w"),
    ]
    inputs = [helper.make_tensor_value_info("x", F, [2, 8, D])]
    outputs = [helper.make_tensor_value_info("y", F, [2, 8, D])]
    return model(nodes, inputs, outputs, inits, opset=18)


def _build(m, config=None):
    builder = Builder("cuda", device="cpu")
    engine = builder.build(m, config or BuilderConfig(optimization_level=3), progress=False)
    return engine, builder.last_report


def _pointwise(engine) -> list[dict]:
    return [x for x in engine.layers if x["op"] == "tensorkiln.Pointwise" and x.get("candidates")]


def test_rms_norm_is_tuned_on_the_graphs_own_values() -> None:
    m = rms_norm_model()
    engine, _ = _build(m)
    layers = _pointwise(engine)
    assert layers, engine.layers
    for layer in layers:
        assert "fallback" not in layer and "rejected" not in layer, layer
        assert set(layer["timings_ms"]) == {"default", "triton"}
    x = np.random.default_rng().standard_normal((2, 8, D)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_drawn_inputs_are_compared_where_the_oracle_is_finite(monkeypatch) -> None:
    """When the graph's own values stop (here the first node fails on the tuner's inputs, as a
    model may on inputs it does not accept), the norm's layer sees a drawn variance, negative in
    places: every implementation gives NaN there alike, and they are compared elsewhere."""
    from tensorkiln.tactics import inputs

    failed = []

    def invoke(entry, args, attrs, n_out, scope):
        if entry.op == "Pow":
            failed.append(entry.op)
            raise RuntimeError("not on these inputs")
        return autotune.invoke(entry, args, attrs, n_out, scope)

    monkeypatch.setattr(inputs, "invoke", invoke)
    m = rms_norm_model()
    engine, _ = _build(m)
    assert failed
    layers = _pointwise(engine)
    assert layers, engine.layers
    for layer in layers:
        assert "fallback" not in layer and "rejected" not in layer, layer
        assert set(layer["timings_ms"]) == {"default", "triton"}
    x = np.random.default_rng().standard_normal((2, 8, D)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def export_tiny_t5(path) -> tuple:
    """A tiny random T5 encoder exported by torch.onnx to ``path``: (module, token ids)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4,
        relative_attention_num_buckets=8,
    )  # fmt: skip
    net = transformers.T5EncoderModel(config).eval()
    ids = np.random.default_rng().integers(0, 64, (1, 12))
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            net, (torch.from_numpy(ids),), str(path), input_names=["input_ids"],
            output_names=["h"], dynamo=False, opset_version=17,
        )  # fmt: skip
    return net, ids


def test_t5_encoder_builds_at_level_3(tmp_path) -> None:
    """T5's RMS norms become Pointwise layers, each tuned on the variance the model computes."""
    path = tmp_path / "t5.onnx"
    net, ids = export_tiny_t5(path)
    engine, _ = _build(str(path))
    norms = [x for x in _pointwise(engine) if "layer_norm" in x["name"]]
    assert norms, engine.layers
    for layer in norms:
        assert "fallback" not in layer and "default" in layer["timings_ms"], layer
    got = engine.create_execution_context().infer({"input_ids": ids})["h"]
    want = net(torch.from_numpy(ids)).last_hidden_state.detach().numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def _nan_oracle(entry, node, args, n_out, scope):
    out = autotune.invoke(entry, args, node.attrs, n_out, scope)
    return [torch.full_like(o, float("nan")) for o in out]


def _failing_time(*args, **kwargs):
    raise RuntimeError("no timer here")


@pytest.mark.parametrize(
    ("target", "replacement", "why"),
    [
        ("_oracle", _nan_oracle, "no finite output"),
        ("_time", _failing_time, "default kernel failed.*no timer here"),
    ],
)
def test_a_tuning_problem_keeps_the_default(monkeypatch, tmp_path, target, replacement, why):
    """The build goes on with the default kernel and says why, and caches no measurement."""
    monkeypatch.setattr(autotune, target, replacement)
    m = rms_norm_model()
    config = BuilderConfig(optimization_level=3)
    config.timing_cache = str(tmp_path / "timing.cache")
    engine, report = _build(m, config)
    layers = _pointwise(engine)
    assert layers
    for layer in layers:
        assert layer["tactic"] == layer["tactic_eager"] == "default"
        assert re.search(why, layer["fallback"]), layer
    assert "kept the default kernel" in report.summary()
    # the reason travels in the engine file and `inspect` shows it
    engine.save(tmp_path / "m.engine")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli_main(["inspect", str(tmp_path / "m.engine")]) == 0
    assert re.search(f"default kept: .*{why}", out.getvalue()), out.getvalue()
    x = np.random.default_rng().standard_normal((2, 8, D)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-5)


def test_relative_error_compares_where_the_oracle_is_finite() -> None:
    rng = np.random.default_rng()
    want = torch.from_numpy(rng.standard_normal(64))
    want[::7] = float("nan")
    want[3] = float("inf")
    close = want + 1e-9
    assert autotune._rel_error([close], [want]) < 1e-6
    shifted = want.clone()
    shifted[1] = float("nan")  # a NaN where the oracle has a number
    assert autotune._rel_error([shifted], [want]) == float("inf")
    finite = torch.nan_to_num(want)  # a number where the oracle has NaN
    assert autotune._rel_error([finite], [want]) == float("inf")
    assert autotune._checkable([want])
    assert not autotune._checkable([torch.full((4,), float("nan"))])


def test_a_candidate_may_be_as_far_off_as_the_default_within_reason() -> None:
    tol = autotune.TOLERANCE["fp16"]
    assert autotune._bound(tol, 0.0) == tol
    assert autotune._bound(tol, 3 * tol) == 6 * tol  # a reduced-precision sum off the oracle
    assert autotune._bound(tol, 100 * tol) == 10 * tol  # a default that far off vouches little
    assert autotune._bound(tol, float("inf")) == 10 * tol
    assert autotune._bound(tol, float("nan")) == tol


def test_a_failing_constraint_check_means_the_tactic_does_not_apply(monkeypatch) -> None:
    """A tactic's supports() or estimate() that raises on an odd layer rules the tactic out (or
    scores it 0); the build goes on with the tactics that do apply."""
    from tensorkiln.kernels import tactics as registry

    def broken(spec):
        raise IndexError("an attribute this check did not expect")

    registry._load()
    table = {k: dict(v) for k, v in registry._TACTICS.items()}
    monkeypatch.setattr(registry, "_TACTICS", table)
    registry.tactic(
        "Pointwise", domain="tensorkiln", name="t_broken", supports=broken, estimate=broken
    )(lambda *a, **k: None)
    m = rms_norm_model()
    engine, _ = _build(m)
    for layer in _pointwise(engine):
        assert layer["candidates"] == ["default", "triton"], layer
    t = registry.get_tactic("Pointwise", "tensorkiln", "t_broken")
    assert t is not None and t.score(None) == 0.0
    x = np.random.default_rng().standard_normal((2, 8, D)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, run_ort(m, {"x": x})[0], rtol=1e-5, atol=1e-5)

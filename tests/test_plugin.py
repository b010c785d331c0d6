"""Plugins: custom ops in Python, built and run on every backend, checked against numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper

import tensorkiln
from tensorkiln.builder import Builder
from tensorkiln.engine import Engine
from tensorkiln.errors import EngineCompatibilityError, InputError, ShapeInferenceError
from tensorkiln.kernels.tactics import get_tactic
from tensorkiln.ops import records

HAS_TORCH = True
try:
    import torch
except ImportError:  # the reference backend needs no torch
    HAS_TORCH = False

BACKENDS = ["reference"] + (["cpu"] if HAS_TORCH else [])


def _model(domain: str, op: str, n_out: int = 1, **attrs):
    """y = Op(Relu(x)) + x (and the further outputs as they are), a symbolic batch axis."""
    outs = ["t"] + [f"o{i}" for i in range(1, n_out)]
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(op, ["r"], outs, domain=domain, **attrs),
        helper.make_node("Add", ["t", "x"], ["y"]),
    ]
    graph_outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6])]
    graph_outs += [helper.make_tensor_value_info(o, TensorProto.UNDEFINED, None) for o in outs[1:]]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6])], graph_outs
    )
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]
    return helper.make_model(graph, opset_imports=opsets)


def _scaled_tanh(domain: str, *, with_torch: bool, calls: list | None = None):
    @tensorkiln.plugin(f"{domain}::ScaledTanh", version="3", attributes={"scale": 1.0})
    def p(x, *, scale):
        return x

    @p.reference
    def _(x, *, scale):
        return (np.tanh(x) * np.float32(scale)).astype(x.dtype)

    if with_torch:

        @p.torch
        def _(x, *, scale):
            if calls is not None:
                calls.append(scale)
            return torch.tanh(x) * scale

    return p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("with_torch", [False, True] if HAS_TORCH else [False])
def test_a_plugin_builds_and_runs_like_numpy(backend, with_torch):
    domain = f"tk_test_run_{backend}_{int(with_torch)}"
    calls: list = []
    _scaled_tanh(domain, with_torch=with_torch, calls=calls)
    engine = Builder(backend).build(_model(domain, "ScaledTanh", scale=2.5), progress=False)
    ctx = engine.create_execution_context()
    for n in (1, 7):
        x = np.random.default_rng().standard_normal((n, 6)).astype(np.float32)
        y = ctx.infer({"x": x})["y"]
        y = y.cpu().numpy() if hasattr(y, "cpu") else y
        np.testing.assert_allclose(y, np.tanh(np.maximum(x, 0)) * 2.5 + x, rtol=1e-5, atol=1e-6)
    # the torch implementation runs where one was given and the backend runs torch kernels
    assert bool(calls) == (with_torch and backend == "cpu")
    assert all(s == 2.5 for s in calls)


def test_several_outputs_of_other_dtypes():
    @tensorkiln.plugin("tk_test_multi::AbsSign")
    def p(x):
        return x, x.like(dtype=np.int8)

    @p.reference
    def _(x):
        return np.abs(x), np.sign(x).astype(np.int8)

    engine = Builder("reference").build(_model("tk_test_multi", "AbsSign", n_out=2))
    x = np.random.default_rng().standard_normal((4, 6)).astype(np.float32)
    out = engine.create_execution_context().infer({"x": x})
    np.testing.assert_allclose(out["y"], np.maximum(x, 0) + x, rtol=1e-6)
    assert out["o1"].dtype == np.int8
    np.testing.assert_array_equal(out["o1"], np.sign(np.maximum(x, 0)).astype(np.int8))


def test_a_shape_rule_that_returns_no_description_is_named():
    @tensorkiln.plugin("tk_test_bad::Broken")
    def p(x):
        return (2, 3)[0]

    @p.reference
    def _(x):
        return x

    with pytest.raises(ShapeInferenceError, match=r"tk_test_bad::Broken.*TensorDesc"):
        Builder("reference").build(_model("tk_test_bad", "Broken"))


@pytest.mark.parametrize(
    ("name", "match"),
    [
        ("NoDomain", "domain::Op"),
        ("::Op", "domain::Op"),
        ("ns::1op", "domain::Op"),
        ("tensorkiln::Op", "belongs to ONNX or tensorkiln"),
        ("ai.onnx::Relu", "belongs to ONNX or tensorkiln"),
    ],
)
def test_bad_plugin_names_are_refused(name, match):
    with pytest.raises(InputError, match=match):
        tensorkiln.plugin(name)


def test_engines_record_plugins_and_refuse_to_load_without_them(tmp_path, monkeypatch):
    _scaled_tanh("tk_test_load", with_torch=False)
    engine = Builder("reference").build(_model("tk_test_load", "ScaledTanh", scale=0.5))
    path = tmp_path / "m.engine"
    engine.save(path)
    from tensorkiln.engine.engine import read_plan

    assert read_plan(path)["plugins"] == [{"name": "tk_test_load::ScaledTanh", "version": "3"}]
    x = np.random.default_rng().standard_normal((2, 6)).astype(np.float32)
    y = Engine.load(path).create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(y, np.tanh(np.maximum(x, 0)) * 0.5 + x, rtol=1e-5, atol=1e-6)

    rec = records.get("ScaledTanh", "tk_test_load")
    monkeypatch.setattr(rec, "plugin_version", "4")
    with pytest.raises(
        EngineCompatibilityError, match="plugin 'tk_test_load::ScaledTanh' version 3"
    ):
        Engine.load(path)
    monkeypatch.setattr(rec, "plugin_version", None)
    with pytest.raises(EngineCompatibilityError, match=r"not registered.*@tensorkiln.plugin"):
        Engine.load(path)


def test_a_fresh_process_without_the_plugin_is_told_how_to_register_it(tmp_path):
    _scaled_tanh("tk_test_fresh", with_torch=False)
    path = tmp_path / "m.engine"
    Builder("reference").build(_model("tk_test_fresh", "ScaledTanh")).save(path)
    code = (
        "import sys\nfrom tensorkiln.engine import Engine\n"
        "from tensorkiln.errors import EngineCompatibilityError\n"
        f"try:\n    Engine.load({str(path)!r})\nexcept EngineCompatibilityError as e:\n"
        "    print(e)\n    sys.exit(3)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "tk_test_fresh::ScaledTanh" in proc.stdout and "version='3'" in proc.stdout


def test_tactics_register_for_the_autotuner():
    p = _scaled_tanh("tk_test_tactic", with_torch=HAS_TORCH)

    @p.tactic("halved", supports=lambda spec: spec.dtypes[0] == "float32")
    def _(x, *, scale):
        return torch.tanh(x) * scale

    t = get_tactic("ScaledTanh", "tk_test_tactic", "plugin_halved")
    assert t is not None and t.fn is _
    assert "tactic halved" in repr(p)


def test_the_example_plugin_script_runs(tmp_path):
    script = Path(__file__).resolve().parents[1] / "examples" / "custom_op_plugin.py"
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "saved and loaded: same outputs: True" in proc.stdout

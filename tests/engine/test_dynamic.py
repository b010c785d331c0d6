"""Dynamic batch: one engine built with a profile (min 1, opt 4, max 16) runs every batch in range.

Shapes outside the profile, or a fixed axis given another size, raise InputError naming the input,
the shape given and the range allowed. Output shapes are known before running (get_tensor_shape).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import pytest

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.errors import InputError
from tests.engine import models as M
from tests.engine.test_roundtrip import assert_close_to_ort, assert_identical

IMAGE = (3, 12, 12)


def build_with_profile(model: onnx.ModelProto, name: str, rest: tuple[int, ...]) -> Engine:
    profile = OptimizationProfile().set_shape(name, (1, *rest), (4, *rest), (16, *rest))
    config = BuilderConfig()
    config.add_optimization_profile(profile)
    # the reference backend: outputs are compared bit for bit with run_onnx's (also numpy)
    return Engine.deserialize(Builder("reference").build(model, config).serialize())


@pytest.fixture(scope="module")
def cnn_engine() -> Engine:
    return build_with_profile(M.cnn(), "x", IMAGE)


@pytest.mark.parametrize("batch", [1, 3, 16])
def test_batches_in_profile_match(cnn_engine: Engine, batch: int) -> None:
    model = M.cnn()
    x = np.random.default_rng().standard_normal((batch, *IMAGE)).astype(np.float32)
    with cnn_engine.create_execution_context() as ctx:
        ctx.set_input_shape("x", x.shape)
        assert ctx.get_tensor_shape("y") == (batch, 10)
        got = ctx.infer({"x": x})
    assert got["y"].shape == (batch, 10)
    assert_identical(got, tensorkiln.run_onnx(model, {"x": x}), f"batch {batch}")
    assert_close_to_ort(model, {"x": x}, got)


def test_profile_is_recorded(cnn_engine: Engine) -> None:
    (spec,) = cnn_engine.inputs
    assert spec.shape == ("N", *IMAGE)
    assert spec.ranges == (((1, *IMAGE), (4, *IMAGE), (16, *IMAGE)),)


def _message(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value)


def test_batch_above_profile_is_refused(cnn_engine: Engine) -> None:
    x = np.zeros((17, *IMAGE), np.float32)
    ctx = cnn_engine.create_execution_context()
    for call in (lambda: ctx.infer({"x": x}), lambda: ctx.set_input_shape("x", x.shape)):
        with pytest.raises(InputError) as exc:
            call()
        text = _message(exc)
        assert "'x'" in text and "[17, 3, 12, 12]" in text, text
        assert "min [1, 3, 12, 12]" in text and "max [16, 3, 12, 12]" in text, text


def test_batch_zero_is_below_profile(cnn_engine: Engine) -> None:
    with pytest.raises(InputError, match=r"'x'.*\[0, 3, 12, 12\].*min \[1, 3, 12, 12\]"):
        cnn_engine.create_execution_context().infer({"x": np.zeros((0, *IMAGE), np.float32)})


@pytest.mark.parametrize("shape", [(4, 4, 12, 12), (4, 3, 12, 11), (4, 3, 12)])
def test_wrong_fixed_dim_is_refused(cnn_engine: Engine, shape: tuple[int, ...]) -> None:
    ctx = cnn_engine.create_execution_context()
    for call in (
        lambda: ctx.infer({"x": np.zeros(shape, np.float32)}),
        lambda: ctx.set_input_shape("x", shape),
    ):
        with pytest.raises(InputError) as exc:
            call()
        text = _message(exc)
        assert "'x'" in text and str(list(shape)) in text, text
        # The allowed shape is stated: the declared dims or the profile's range.
        assert re.search(r"\[N, 3, 12, 12\]|fixed at|rank 4", text), text


def test_output_shapes_before_running(cnn_engine: Engine) -> None:
    ctx = cnn_engine.create_execution_context()
    with pytest.raises(InputError, match="set the shape of input"):
        ctx.get_tensor_shape("y")
    for batch in (2, 16, 1):
        ctx.set_input_shape("x", (batch, *IMAGE))
        assert ctx.get_tensor_shape("x") == (batch, *IMAGE)
        assert ctx.get_tensor_shape("y") == (batch, 10)
    with pytest.raises(InputError, match="'nope'"):
        ctx.get_tensor_shape("nope")


def test_fixed_input_shape_needs_no_setting() -> None:
    engine = Builder().build(M.cnn(batch=2))
    ctx = engine.create_execution_context()
    assert ctx.get_tensor_shape("x") == (2, *IMAGE)
    assert ctx.get_tensor_shape("y") == (2, 10)


def test_mlp_two_outputs_every_batch() -> None:
    model = M.mlp()
    engine = build_with_profile(model, "x", (16,))
    ctx = engine.create_execution_context()
    for batch in (1, 3, 16):
        x = np.random.default_rng().standard_normal((batch, 16)).astype(np.float32)
        ctx.set_input_shape("x", x.shape)
        assert ctx.get_tensor_shape("probs") == (batch, 10)
        got = ctx.infer({"x": x})
        assert_identical(got, tensorkiln.run_onnx(model, {"x": x}), f"batch {batch}")
        assert_close_to_ort(model, {"x": x}, got)


def test_profile_naming_a_fixed_axis_wrongly_is_refused_at_build() -> None:
    profile = OptimizationProfile().set_shape("x", (1, 3, 12, 12), (4, 3, 12, 12), (16, 4, 12, 12))
    config = BuilderConfig()
    config.add_optimization_profile(profile)
    with pytest.raises(InputError, match="axis 1 is fixed at 3"):
        Builder().build(M.cnn(), config)


def test_torch_export_with_dynamic_axes(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
            self.pool = torch.nn.MaxPool2d(2)
            self.fc = torch.nn.Linear(4 * 6 * 6, 5)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(torch.relu(self.conv(x))), 1))

    torch.manual_seed(0)
    path = tmp_path / "net.onnx"
    torch.onnx.export(
        Net().eval(),
        (torch.zeros(2, *IMAGE),),
        str(path),
        input_names=["image"],
        output_names=["scores"],
        dynamic_axes={"image": {0: "batch"}, "scores": {0: "batch"}},
        dynamo=False,
    )
    model = onnx.load(path)
    engine = build_with_profile(model, "image", IMAGE)
    assert engine.inputs[0].shape == ("batch", *IMAGE)
    ctx = engine.create_execution_context()
    for batch in (1, 3, 16):
        x = np.random.default_rng().standard_normal((batch, *IMAGE)).astype(np.float32)
        ctx.set_input_shape("image", x.shape)
        assert ctx.get_tensor_shape("scores") == (batch, 5)
        got = ctx.infer({"image": x})
        assert_identical(got, tensorkiln.run_onnx(model, {"image": x}), f"batch {batch}")
        assert_close_to_ort(model, {"image": x}, got)
    with pytest.raises(InputError, match=r"'image'.*\[17, 3, 12, 12\].*max \[16, 3, 12, 12\]"):
        ctx.infer({"image": np.zeros((17, *IMAGE), np.float32)})


def _shape_arithmetic_model() -> onnx.ModelProto:
    """y = x + Range(0, Shape(x)[0])[:, None, None]: arithmetic on the dynamic batch axis that no
    rewrite removes while the axis is dynamic (position ids and masks of exported transformers
    are made this way)."""
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "zero"], ["n"], axis=0),
        helper.make_node("Range", ["zero", "n", "step"], ["ids"]),
        helper.make_node("Cast", ["ids"], ["idsf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["idsf", "axes"], ["col"]),
        helper.make_node("Add", ["x", "col"], ["y"]),
    ]
    inits = [
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "step"),
        numpy_helper.from_array(np.array([1, 2], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "shape_arithmetic",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 6])],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_a_profile_that_pins_the_batch_folds_the_shape_arithmetic(backend: str) -> None:
    """min == max in every profile: the axis is the model's own at build time, so Shape, Gather,
    Concat... fold away; the engine matches onnxruntime at that batch and refuses others."""
    pytest.importorskip("torch") if backend == "cpu" else None
    model = _shape_arithmetic_model()
    config = BuilderConfig()
    config.add_optimization_profile(OptimizationProfile().set_shape("x", *[(3, 4, 6)] * 3))
    builder = Builder(backend)
    engine = builder.build(model, config, progress=False)
    ops = {n.op for n in engine.graph.nodes}
    assert ops == {"Add"}, ops  # (the ids are a constant now)
    assert any("'x' fixed at [3, 4, 6]" in n for n in builder.last_report.notes)
    x = np.random.default_rng().standard_normal((3, 4, 6)).astype(np.float32)
    with engine.create_execution_context() as ctx:
        got = ctx.infer({"x": x})
        assert_close_to_ort(model, {"x": x}, {k: np.asarray(v) for k, v in got.items()})
        with pytest.raises(InputError, match="'x'"):
            ctx.infer({"x": x[:2]})


def test_a_profile_with_a_range_keeps_the_axis_dynamic() -> None:
    model = _shape_arithmetic_model()
    config = BuilderConfig()
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 4, 6), (3, 4, 6), (5, 4, 6))
    )
    builder = Builder("reference")
    engine = builder.build(model, config, progress=False)
    assert {"Shape", "Range"} <= {n.op for n in engine.graph.nodes}
    assert not any("fixed at" in n for n in builder.last_report.notes)
    for batch in (1, 5):
        x = np.random.default_rng().standard_normal((batch, 4, 6)).astype(np.float32)
        with engine.create_execution_context() as ctx:
            assert_close_to_ort(model, {"x": x}, ctx.infer({"x": x}))

"""The cuda builder on models with dynamic inputs: it tunes at the optimization profile's shapes,
and where no profile sizes a dynamic axis and the guess (1) does not fit the model, it refuses
with the inputs and axes to size (as TensorRT does), instead of a shape error from inside.

The cuda backend's kernels run on CPU tensors here (``Builder("cuda", device="cpu")``).
"""

from __future__ import annotations

import argparse
import contextlib
import io

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

pytest.importorskip("torch")

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.cli.build import print_report
from tensorkiln.errors import BuildError
from tests.kernels.ort_oracle import run_ort
from tests.passes.util import model

F = TensorProto.FLOAT


def detector_neck():
    """x[batch, 3, height, width] -> a strided conv branch, and a second strided conv upsampled
    back, concatenated: the branches agree at real sizes, but not at 1x1 (1x1 vs 2x2)."""
    rng = np.random.default_rng()
    w1 = (rng.standard_normal((8, 3, 3, 3)) * 0.2).astype(np.float32)
    w2 = (rng.standard_normal((8, 8, 3, 3)) * 0.2).astype(np.float32)
    conv = {"strides": [2, 2], "pads": [1, 1, 1, 1]}
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["a"], **conv),
        helper.make_node("Relu", ["a"], ["ar"]),
        helper.make_node("Conv", ["ar", "w2"], ["b"], **conv),
        helper.make_node("Resize", ["b", "", "scales"], ["c"], mode="nearest"),
        helper.make_node("Concat", ["ar", "c"], ["y"], axis=1, name="/model.11/Concat"),
    ]
    inits = [
        numpy_helper.from_array(w1, "w1"),
        numpy_helper.from_array(w2, "w2"),
        numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales"),
    ]
    x = helper.make_tensor_value_info("x", F, ["batch", 3, "height", "width"])
    return model(nodes, [x], [helper.make_tensor_value_info("y", F, None)], inits, opset=17)


def _cuda_build(m, config: BuilderConfig):
    builder = Builder("cuda", device="cpu")
    return builder.build(m, config, progress=False), builder.last_report


def _check_runs(engine, m, shapes) -> None:
    ctx = engine.create_execution_context()
    rng = np.random.default_rng()
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        got = ctx.infer({"x": x})["y"]
        np.testing.assert_allclose(got, run_ort(m, {"x": x})[0], rtol=1e-4, atol=1e-4)


def test_dynamic_image_without_a_profile_names_the_axes_to_size() -> None:
    with pytest.raises(BuildError) as info:
        _cuda_build(detector_neck(), BuilderConfig(optimization_level=3))
    msg = str(info.value)
    assert "no optimization profile" in msg and "\n" not in msg
    assert "'x' axes 0 (batch), 2 (height), 3 (width)" in msg
    assert "/model.11/Concat" in msg and "x 1x3x1x1" in msg  # where the guess failed
    assert "--opt-shapes x:<batch>x3x<height>x<width>" in msg


def test_dynamic_image_builds_and_tunes_at_the_profile() -> None:
    m = detector_neck()
    config = BuilderConfig(optimization_level=3)
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 3, 8, 8), (1, 3, 16, 16), (2, 3, 32, 32))
    )
    engine, report = _cuda_build(m, config)
    assert any(x.get("timings_ms") for x in engine.layers), engine.layers
    assert not report.notes
    _check_runs(engine, m, [(1, 3, 16, 16), (2, 3, 32, 32), (1, 3, 8, 8)])


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_nothing_timed_needs_no_profile(backend) -> None:
    """The reference backend, and the cuda one at level 0, tune nothing: they build as before."""
    m = detector_neck()
    config = BuilderConfig(optimization_level=0 if backend == "cuda" else 3)
    builder = Builder(backend, device="cpu" if backend == "cuda" else None)
    engine = builder.build(m, config, progress=False)
    assert all("timings_ms" not in x for x in engine.layers)
    _check_runs(engine, m, [(1, 3, 16, 16), (2, 3, 24, 40)])


def _dense(shape: list) -> object:
    """x[shape..., 16] -> MatMul -> Relu -> y."""
    w = (np.random.default_rng().standard_normal((16, 8)) * 0.3).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"]),
        helper.make_node("Relu", ["h"], ["y"]),
    ]
    x = helper.make_tensor_value_info("x", F, [*shape, 16])
    y = helper.make_tensor_value_info("y", F, None)
    return model(nodes, [x], [y], [numpy_helper.from_array(w, "w")])


def test_a_batch_axis_alone_builds_without_a_profile() -> None:
    m = _dense(["N"])
    engine, report = _cuda_build(m, BuilderConfig(optimization_level=3))
    assert not report.notes and not engine.build["notes"]
    _check_runs(engine, m, [(1, 16), (5, 16)])


def test_other_dynamic_axes_build_with_a_note() -> None:
    """A sequence axis of 1 fits the model: the build goes on (as it did), and says what was
    guessed."""
    m = _dense(["batch", "seq"])
    engine, report = _cuda_build(m, BuilderConfig(optimization_level=3))
    assert len(report.notes) == 1 and "'x' axes 1 (seq)" in report.notes[0]
    assert "--opt-shapes" in report.notes[0] and report.notes[0] in report.summary()
    assert engine.build["notes"] == report.notes
    _check_runs(engine, m, [(2, 7, 16)])
    # `tensorkiln build` prints the note (the CLI builds for cuda only on a GPU: its report here)
    args = argparse.Namespace(from_engine=None, model="m.onnx", output="m.engine")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_report(args, engine, report, 0.1, BuilderConfig(optimization_level=3))
    assert f"note: {report.notes[0]}" in out.getvalue().splitlines()


def test_a_profile_the_model_cannot_run_at_is_named() -> None:
    """6x6 gives 3x3 and, upsampled, 4x4: the profile's min shape does not fit the model."""
    config = BuilderConfig(optimization_level=3)
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 3, 6, 6), (1, 3, 16, 16), (2, 3, 32, 32))
    )
    with pytest.raises(BuildError) as info:
        _cuda_build(detector_neck(), config)
    msg = str(info.value)
    assert "does not run at the optimization profile's shapes" in msg and "\n" not in msg
    assert "x 1x3x6x6" in msg and "/model.11/Concat" in msg

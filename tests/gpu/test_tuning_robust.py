"""The cuda builder and autotuner on third-party model shapes, on a real GPU: a T5 encoder's RMS
norm tuned on real values at level 3 (fp32 and fp16), and a detector with symbolic image sizes,
refused without a profile (one line from the command) and tuned with one.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests/gpu/test_tuning_robust.py
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile  # noqa: E402
from tensorkiln.errors import BuildError  # noqa: E402
from tests.builder.test_dynamic_tuning import detector_neck  # noqa: E402
from tests.cli.helpers import CLI, assert_one_line_error  # noqa: E402
from tests.kernels.ort_oracle import run_ort  # noqa: E402
from tests.tactics.test_tuning_inputs import export_tiny_t5, rms_norm_model  # noqa: E402

pytestmark = pytest.mark.gpu


def _config(precision: str | None) -> BuilderConfig:
    config = BuilderConfig(optimization_level=3)
    if precision:
        config.set_flag(precision)
    return config


def _norm_layers(engine) -> list[dict]:
    return [x for x in engine.layers if x["op"] == "tensorkiln.Pointwise" and x.get("candidates")]


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_rms_norm_tunes_on_the_gpu(precision) -> None:
    m = rms_norm_model()
    engine = Builder("cuda").build(m, _config(precision), progress=False)
    layers = _norm_layers(engine)
    assert layers, engine.layers
    for layer in layers:
        assert "fallback" not in layer and "default" not in layer.get("rejected", {}), layer
        assert "triton" in layer["timings_ms"], layer
    x = np.random.default_rng().standard_normal((2, 8, 16)).astype(np.float32)
    got = engine.create_execution_context().infer({"x": x})["y"]
    assert _rel(got, run_ort(m, {"x": x})[0]) < (2e-2 if precision else 1e-5)


@pytest.mark.parametrize("precision", [None, "fp16"])
def test_t5_encoder_builds_on_the_gpu(tmp_path, precision) -> None:
    path = tmp_path / "t5.onnx"
    net, ids = export_tiny_t5(path)
    engine = Builder("cuda").build(str(path), _config(precision), progress=False)
    norms = [x for x in _norm_layers(engine) if "layer_norm" in x["name"]]
    assert norms, engine.layers
    for layer in norms:
        assert "fallback" not in layer and "default" in layer["timings_ms"], layer
    got = engine.create_execution_context().infer({"input_ids": ids})["h"]
    with torch.no_grad():
        want = net(torch.from_numpy(ids)).last_hidden_state.numpy()
    assert _rel(got, want) < (3e-2 if precision else 1e-4)


def test_detector_without_a_profile_is_refused(tmp_path, capsys) -> None:
    m = detector_neck()
    with pytest.raises(BuildError, match=r"'x' axes 0 \(batch\), 2 \(height\), 3 \(width\)"):
        Builder("cuda").build(m, _config(None), progress=False)
    path = tmp_path / "det.onnx"
    onnx.save(m, path)
    rc, _, err = CLI(capsys)("build", path, "-o", tmp_path / "d.engine", "--backend", "cuda")
    assert_one_line_error(rc, err)
    assert "--opt-shapes" in err


def test_detector_with_a_profile_is_tuned_and_runs() -> None:
    m = detector_neck()
    config = _config(None)
    config.add_optimization_profile(
        OptimizationProfile().set_shape("x", (1, 3, 32, 32), (4, 3, 64, 64), (8, 3, 128, 128))
    )
    engine = Builder("cuda").build(m, config, progress=False)
    assert any(x.get("timings_ms") for x in engine.layers), engine.layers
    ctx = engine.create_execution_context()
    rng = np.random.default_rng()
    for shape in [(4, 3, 64, 64), (1, 3, 32, 32), (8, 3, 128, 96)]:
        x = rng.standard_normal(shape).astype(np.float32)
        assert _rel(ctx.infer({"x": x})["y"], run_ort(m, {"x": x})[0]) < 1e-5, shape

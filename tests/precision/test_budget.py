"""The accuracy budget, judged by onnxruntime: the engine it builds must be within the budget of
the float32 model on the data it was measured on, with no layer kept in float32 that a loose
budget does not need; and the search's choice is checked against every subset of layers."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.errors import InputError
from tensorkiln.precision.budget import AccuracyBudget

ort = pytest.importorskip("onnxruntime")
DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits_cnn.onnx"
LAYERS = ("/0/Conv", "/3/Conv", "/6/Gemm")


@pytest.fixture(scope="module")
def batches() -> list[dict[str, np.ndarray]]:
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits

    images = (load_digits().images / 16.0).astype(np.float32)[:, None]
    order = np.random.default_rng().permutation(len(images))[:256]
    return [{"input": images[order[i : i + 64]]} for i in range(0, 256, 64)]


def _build(batches, budget=None, pins=()) -> object:
    config = BuilderConfig()
    config.set_flag("int8")
    config.calibration_data = batches
    config.calibrator = "minmax"
    config.accuracy_budget = budget
    config.layer_precisions = dict.fromkeys(pins, "fp32")
    return Builder("reference").build(DIGITS, config)


def _rel_l2(engine, batches) -> float:
    """The worst batch's relative L2 error of the engine's logits against onnxruntime's float."""
    sess = ort.InferenceSession(str(DIGITS), providers=["CPUExecutionProvider"])
    ctx = engine.create_execution_context()
    worst = 0.0
    for feed in batches:
        want = sess.run(None, feed)[0].astype(np.float64)
        got = next(iter(ctx.infer(feed).values())).astype(np.float64)
        worst = max(worst, float(np.linalg.norm(got - want) / np.linalg.norm(want)))
    return worst


def _float_layers(engine) -> set[str]:
    return {n.name for n in engine.graph.nodes if n.name in LAYERS and not n.op.startswith("Q")}


def test_budget_keeps_the_fewest_layers_and_meets_it(batches) -> None:
    errors = {}  # every subset of layers kept in float32, measured by onnxruntime
    for k in range(len(LAYERS) + 1):
        for kept in itertools.combinations(LAYERS, k):
            errors[kept] = _rel_l2(_build(batches, pins=kept), batches)
    assert errors[LAYERS] < 1e-5  # all float: the float model
    everything = errors[()]
    assert everything > 1e-4  # all quantized: visibly not
    # a budget between the best single layer and all quantized: one layer must stay float
    best_single = min(errors[(name,)] for name in LAYERS)
    budget = (best_single + everything) / 2 if best_single < everything else everything / 2
    engine = _build(batches, f"rel_l2:{budget}")
    kept = _float_layers(engine)
    assert _rel_l2(engine, batches) <= budget * 1.0001
    fewest = min(len(s) for s, e in errors.items() if e <= budget)
    assert len(kept) == fewest, (kept, errors)
    assert any("accuracy budget:" in n and "kept in float32" in n for n in engine.build["notes"])
    # a loose budget keeps nothing; a zero budget keeps everything
    assert _float_layers(_build(batches, f"rel_l2:{everything * 2}")) == set()
    assert _float_layers(_build(batches, "0")) == set(LAYERS)


def test_cosine_budget(batches) -> None:
    engine = _build(batches, "cosine:0.9999999")
    sess = ort.InferenceSession(str(DIGITS), providers=["CPUExecutionProvider"])
    ctx = engine.create_execution_context()
    for feed in batches:
        a = next(iter(ctx.infer(feed).values())).astype(np.float64).ravel()
        b = sess.run(None, feed)[0].astype(np.float64).ravel()
        assert np.dot(a, b) / (np.linalg.norm(a) * np.linalg.norm(b)) >= 0.9999999 - 1e-9


@pytest.mark.parametrize("text", ["l1:0.1", "rel_l2:-1", "cosine:1.5", "rel_l2:abc", "nan"])
def test_bad_budgets_are_named(text: str) -> None:
    with pytest.raises(InputError, match="accuracy budget"):
        AccuracyBudget.parse(text)


def test_a_budget_needs_calibration_data(tmp_path: Path, batches) -> None:
    from tensorkiln.errors import BuildError

    cache = tmp_path / "c.json"
    config = BuilderConfig()
    config.set_flag("int8")
    config.calibration_data = batches
    config.calibration_cache = str(cache)
    Builder("reference").build(DIGITS, config)
    config.calibration_data = None
    config.accuracy_budget = "0.01"
    with pytest.raises(BuildError, match="measured on calibration data"):
        Builder("reference").build(DIGITS, config)

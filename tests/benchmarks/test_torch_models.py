"""benchmarks/torch_models.py on two of its models: each row says how the model ran and agrees
with eager PyTorch; a library that is not installed is a row, not a crash."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxscript")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load():
    spec = importlib.util.spec_from_file_location("torch_models", BENCH / "torch_models.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["torch_models"] = module
    spec.loader.exec_module(module)
    return module


def test_rows_say_how_each_model_ran_and_agree(tmp_path, monkeypatch):
    bench = _load()
    models = bench.models(full=False)
    monkeypatch.setitem(models, "missing", ("nolib", lambda: __import__("no_such_library_here")))
    monkeypatch.setattr(bench, "models", lambda full: models)
    assert bench.main(["--models", "distilbert,resnet_hf,missing", "--out", str(tmp_path)]) == 0
    rows = {r["model"]: r for r in json.loads((tmp_path / "results.json").read_text())["rows"]}
    for name in ("distilbert", "resnet_hf"):
        assert rows[name]["status"] == "one engine" and rows[name]["agrees"], rows[name]
        assert rows[name]["rel_l2"] <= 1e-4
    assert rows["missing"]["status"] == "not importable here"
    text = (tmp_path / "results.md").read_text()
    assert "2 models tried: 2 as one engine that agrees with eager" in text


def test_detections_are_compared_as_sets():
    import numpy as np
    import torch

    bench = _load()
    rng = np.random.default_rng()
    n = 20
    boxes = torch.from_numpy(rng.uniform(0, 200, (n, 4)))
    scores = torch.from_numpy(np.sort(rng.uniform(0.9, 1.0, n))[::-1].copy())
    labels = torch.from_numpy(rng.integers(1, 5, n))
    want = [{"boxes": boxes, "scores": scores, "labels": labels}]
    order = torch.from_numpy(rng.permutation(n))  # the same detections in another order
    same = [{"boxes": boxes[order] + 1e-6, "scores": scores[order], "labels": labels[order]}]
    share, rel = bench._match_detections(same, want, 1e-4)
    assert share == 1.0 and 0 < rel < 1e-6
    moved = [{k: v.clone() for k, v in same[0].items()}]
    moved[0]["boxes"][:3] += 5.0  # three boxes elsewhere: no longer matches
    moved[0]["labels"][3] += 1  # one of another class
    share, _ = bench._match_detections(moved, want, 1e-4)
    assert share == (n - 4) / n
    assert bench._is_detections(want) and not bench._is_detections([boxes])

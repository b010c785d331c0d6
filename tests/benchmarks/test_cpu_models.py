"""benchmarks/cpu_models.py end to end with tiny configs: the script's checks against
onnxruntime, its table and its results file work before anyone spends minutes on the real run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_models.py"


def _load():
    spec = importlib.util.spec_from_file_location("cpu_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_agrees_with_onnxruntime(tmp_path, capsys) -> None:
    bench = _load()
    argv = ["--tiny", "--models", "mobilenet_v3_small,bert", "--batch-sizes", "1,2"]
    argv += ["--rounds", "1", "--runs", "1", "--threads", "1", "--cache", str(tmp_path / "m")]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    rows = results["models"]
    assert [(r["model"], r["batch"]) for r in rows] == [
        ("mobilenet_v3_small", 1), ("mobilenet_v3_small", 2), ("bert", 1), ("bert", 2)
    ]  # fmt: skip
    for r in rows:
        assert not r["note"] and r["max_rel_diff"] < 1e-4, r
        assert r["tensorkiln_ms"] > 0 and r["onnxruntime_ms"] > 0 and r["ratio"] > 0
        assert (r["reference_ms"] is not None) == (r["batch"] == 1)
    out = capsys.readouterr().out
    assert "| model | batch | tensorkiln cpu ms |" in out and "| bert | 2 |" in out

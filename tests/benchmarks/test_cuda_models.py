"""benchmarks/cuda_models.py end to end on torch CPU tensors with 2-layer transformers, so the
script the GPU runs is known to work before GPU time is spent on it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "cuda_models.py"


def _load():
    spec = importlib.util.spec_from_file_location("cuda_models", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_smoke_run_agrees_with_onnxruntime(tmp_path, capsys) -> None:
    bench = _load()
    argv = ["--models", "bert,gpt2", "--device", "cpu", "--tiny", "--batch-sizes", "bert=2,gpt2=2"]
    assert bench.main([*argv, "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert [r["model"] for r in results["models"]] == ["bert", "gpt2"]
    for r in results["models"]:
        assert "error" not in r, r
        assert r["fp32_max_rel_vs_ort"] < 1e-4 and r["fp16_norm_rel_vs_ort"] < 1e-2
        assert r["fp32_graph_norm_rel_vs_ort"] < 1e-4
        assert r["fp16_large_norm_rel_vs_torch_fp32"] < 1e-2
        assert set(r["b1_ms"]) == {
            "tk_fp32", "tk_fp32_graph", "tk_fp16", "tk_fp16_graph", "torch_fp32", "torch_fp16"
        }  # fmt: skip
        assert r["fp32_tensorkiln_run"]["iterations"] == 2
    out = capsys.readouterr().out
    assert "| model | fp32 max rel vs ORT |" in out and "| gpt2 |" in out


def test_memory_only_run(tmp_path, capsys) -> None:
    bench = _load()
    argv = ["--models", "bert", "--device", "cpu", "--tiny", "--batch-sizes", "bert=2"]
    assert bench.main([*argv, "--memory-only", "--out", str(tmp_path)]) == 0
    (r,) = json.loads((tmp_path / "results.json").read_text())["models"]
    assert "error" not in r, r
    assert r["fp16_large_norm_rel_vs_torch_fp32"] < 1e-2
    assert r["fp16_large_planned_peak_bytes"] > 0 and "large_per_s" not in r
    assert "| bert | 2 | - | - |" in capsys.readouterr().out

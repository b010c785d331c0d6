"""`tensorkiln inspect`: layers, IO with profile ranges, memory, target and source of an engine."""

from __future__ import annotations

import pytest

from tests.cli.helpers import assert_one_line_error
from tests.cli.test_build import _as_if_from_elsewhere


@pytest.fixture
def engine(cli, mlp, tmp_path):
    path = tmp_path / "mlp.engine"
    # level 0 keeps the model's own layers, which the assertions below name
    rc, _, err = cli("build", mlp, "-o", path, "--embed-source", "--opt-level", "0",
                     "--backend", "reference",  # (the layer names checked below are its kernels)
                     "--min-shapes", "x:1x4", "--opt-shapes", "x:2x4", "--max-shapes", "x:8x4")  # fmt: skip
    assert rc == 0, err
    return path


def test_inspect_engine_text(cli, engine):
    rc, out, err = cli("inspect", engine)
    assert rc == 0, err
    lines = out.splitlines()
    for name, op, impl in (("fc1", "MatMul", "reference:math.matmul"), ("act1", "Relu", "relu")):
        assert any(
            line.split()[:2] == [name, op] and impl in line and "f32" in line
            for line in lines
            if line.strip()
        )
    assert any(
        line.split()[:5] == ["input", "x", "FLOAT", "[N,", "4]"]
        and "min [1, 4] opt [2, 4] max [8, 4]" in line
        for line in lines
    )
    assert any(line.split()[:3] == ["output", "y", "FLOAT"] for line in lines)
    assert "layers (4)" in out and "planned peak" in out and "naive" in out
    assert "backend reference" in out and "device cpu" in out and "tensorkiln 0.1.0" in out
    assert (
        "source: mlp.onnx" in out and "embedded: yes" in out and "loads on this machine: yes" in out
    )


def test_inspect_engine_json(cli, engine):
    info = cli.json("inspect", engine, "--json")
    assert [x["name"] for x in info["layers"]] == ["fc1", "bias1", "act1", "fc2"]
    assert all(set(x) == {"name", "op", "impl", "precision"} for x in info["layers"])
    (x,) = info["inputs"]
    assert x["shape"] == ["N", 4] and x["dynamic_axes"] == [0]
    assert x["profiles"] == [{"min": [1, 4], "opt": [2, 4], "max": [8, 4]}]
    assert info["outputs"][0]["name"] == "y"
    assert info["memory"]["peak_bytes"] <= info["memory"]["naive_bytes"]
    assert info["source"]["embedded"] is True and len(info["source"]["sha256"]) == 64
    assert info["target"]["device"] == "cpu" and info["loadable_here"] is True
    assert info["weights"]["tensors"] == 3


def test_inspect_engine_from_elsewhere_says_it_does_not_load(cli, engine, tmp_path):
    foreign = _as_if_from_elsewhere(engine, tmp_path / "foreign.engine")
    rc, out, err = cli("inspect", foreign)
    assert rc == 0, err
    assert "loads on this machine: no" in out and "NVIDIA H100" in out
    assert cli.json("inspect", foreign, "--json")["loadable_here"] is False


def test_inspect_onnx_prints_the_ir(cli, mlp):
    rc, out, _ = cli("inspect", mlp)
    assert rc == 0 and "%y: f32[N,3] = MatMul(%h2, %w2)" in out
    info = cli.json("inspect", mlp, "--json")
    assert [n["op"] for n in info["nodes"]] == ["MatMul", "Add", "Relu", "MatMul"]
    assert info["inputs"] == [{"name": "x", "dtype": "FLOAT", "shape": ["N", 4]}]


def test_inspect_damaged_engine(cli, engine):
    data = bytearray(engine.read_bytes())
    data[-5] ^= 0xFF
    engine.write_bytes(bytes(data))
    rc, _, err = cli("inspect", engine)
    assert_one_line_error(rc, err)
    assert "corrupted" in err

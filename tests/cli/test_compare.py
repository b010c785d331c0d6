"""`tensorkiln compare`: tensorkiln against onnxruntime; exit 0 when outputs agree, 1 when not."""

from __future__ import annotations

import json
import sys

import numpy as np

from tests.cli.helpers import assert_one_line_error, mlp_model, two_io_model


def _table(out):
    """output name -> row cells of the comparison table."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("output"))
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith(("PASSED", "tensorkiln:")) or not line.strip():
            break
        rows[line.split()[0]] = line.split()
    return rows


def test_passes_on_a_good_model(cli, mlp, tmp_path):
    rc, out, err = cli("compare", mlp, "--shapes", "x:5x4", "--seed", "1")
    assert rc == 0, err
    assert "built in memory" in out and "PASSED" in out
    (row,) = _table(out).values()
    assert row[0] == "y" and row[-1] == "pass"
    assert float(row[1]) <= 1e-5 + 1e-3 * 10  # max abs is a number


def test_passes_with_an_engine_and_given_inputs(cli, mlp, tmp_path):
    engine = tmp_path / "e.engine"
    assert cli("build", mlp, "-o", engine, "--min-shapes", "x:1x4", "--opt-shapes", "x:2x4",
               "--max-shapes", "x:8x4")[0] == 0  # fmt: skip
    np.savez(
        tmp_path / "in.npz", x=np.random.default_rng().standard_normal((7, 4)).astype(np.float32)
    )
    rc, out, err = cli("compare", mlp, "--engine", engine, "--load-inputs", tmp_path / "in.npz")
    assert rc == 0, err
    assert str(engine) in out and "PASSED" in out


def test_fails_on_an_engine_of_a_different_model_with_the_same_io(cli, mlp, tmp_path):
    other = mlp_model(tmp_path / "other.onnx")  # same graph and IO, other weights
    engine = tmp_path / "other.engine"
    assert cli("build", other, "-o", engine)[0] == 0
    rc, out, _ = cli("compare", mlp, "--engine", engine, "--shapes", "x:4x4")
    assert rc == 1
    assert "FAIL" in _table(out)["y"]
    assert "FAILED: 1 of 1 output(s)" in out and out.rstrip().endswith(": y")
    # the JSON form says the same, with the failure line on stderr
    rc, out, err = cli("compare", mlp, "--engine", engine, "--json")
    assert rc == 1 and "FAILED" in err
    result = json.loads(out)
    assert result["passed"] is False and result["outputs"]["y"]["max_abs"] > 0
    # tolerances decide: one wide enough to cover the difference passes
    rc, out, _ = cli("compare", mlp, "--engine", engine, "--atol", "1e9")
    assert rc == 0 and "PASSED" in out


def test_several_outputs_and_integer_inputs(cli, tmp_path):
    model = two_io_model(tmp_path / "two.onnx")
    rc, out, err = cli("compare", model, "--shapes", "a:3x3,k:3")
    assert rc == 0, err
    assert set(_table(out)) == {"out", "total"}
    rc, _, err = cli("compare", model, "--atol", "-1")
    assert_one_line_error(rc, err, code=2)


def test_help_states_the_default_tolerances(cli):
    _, out, _ = cli("compare", "--help")
    assert "atol 1e-05" in out and "rtol 0.001" in out and "|a - b| <= atol + rtol * |b|" in out


def test_missing_onnxruntime_is_a_clear_error(cli, mlp, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    rc, _, err = cli("compare", mlp)
    assert_one_line_error(rc, err)
    assert "pip install onnxruntime" in err


def test_engine_with_other_inputs_is_a_clear_error(cli, mlp, tmp_path):
    model = two_io_model(tmp_path / "two.onnx")
    engine = tmp_path / "two.engine"
    assert cli("build", model, "-o", engine)[0] == 0
    rc, _, err = cli("compare", mlp, "--engine", engine)
    assert_one_line_error(rc, err)

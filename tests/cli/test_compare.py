"""`tensorkiln compare`: tensorkiln against onnxruntime; exit 0 when outputs agree, 1 when not."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.cli.compare import Criteria, error_stats
from tensorkiln.engine import format as fmt
from tests.cli.helpers import assert_one_line_error, mlp_model, ort_outputs, two_io_model


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


def _tiny_model(path, scale=1e-9):
    """y = (x @ w) * scale, fresh random w: outputs of magnitude ~scale."""
    w = np.random.default_rng().standard_normal((4, 6)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"]),
            helper.make_node("Mul", ["h", "s"], ["y"]),
        ],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 6])],
        initializer=[
            numpy_helper.from_array(w, "w"),
            numpy_helper.from_array(np.array(scale, np.float32), "s"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def _claiming(engine, model, dst):
    """A wrong engine: built from another model, but recording ``model``'s sha256 (as a buggy
    build would compute wrong outputs for the right model)."""
    plan, tensors = fmt.read(engine)
    plan = {k: v for k, v in plan.items() if k != "tensors"}
    digest = hashlib.sha256(onnx.load(model).SerializeToString()).hexdigest()
    plan["source"] = {**plan["source"], "name": model.name, "sha256": digest}
    fmt.write(dst, plan, tensors)
    return dst


def test_statistics_match_numpy_on_the_saved_outputs(cli, mlp, tmp_path):
    x = np.random.default_rng().standard_normal((5, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    saved = tmp_path / "both.npz"
    result = cli.json(
        "compare", mlp, "--json", "--load-inputs", tmp_path / "in.npz", "--save-outputs", saved
    )
    assert result["passed"] is True
    ref = ort_outputs(mlp, {"x": x})["y"].astype(np.float64)  # onnxruntime, run here
    with np.load(saved) as data:
        ours = data["tensorkiln:y"].astype(np.float64)
        np.testing.assert_array_equal(data["onnxruntime:y"], ref.astype(np.float32))
    row = result["outputs"]["y"]
    diff = np.abs(ours - ref)
    assert row["abs_error"]["max"] == pytest.approx(diff.max(), abs=1e-12)
    assert row["abs_error"]["median"] == pytest.approx(np.median(diff), abs=1e-12)
    # (equal values differ by 0, also where both are 0: a row of all-zero hidden units after
    # the ReLU gives y == 0 exactly, and 0 / 0 would make the oracle NaN)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(diff == 0, 0.0, diff / np.abs(ref))
    assert row["rel_error"]["max"] == pytest.approx(rel.max(), rel=1e-9)
    assert row["rel_l2"] == pytest.approx(np.linalg.norm(diff) / np.linalg.norm(ref), rel=1e-9)
    cos = np.dot(ours.ravel(), ref.ravel()) / (np.linalg.norm(ours) * np.linalg.norm(ref))
    assert row["cosine"] == pytest.approx(cos, abs=1e-12)
    assert row["reference"]["mean_abs"] == pytest.approx(np.abs(ref).mean(), rel=1e-9)
    assert row["ours"]["max_abs"] == pytest.approx(np.abs(ours).max(), rel=1e-9)
    assert row["rel_l2"] < 1e-6 and row["checks"]["rel_l2"]["passed"]
    assert result["criteria"]["rel_l2"] == 1e-4 and result["criteria"]["check_error_stat"] is None


def test_passes_on_a_good_model_and_prints_each_statistic(cli, mlp):
    rc, out, err = cli("compare", mlp, "--shapes", "x:5x4", "--seed", "1")
    assert rc == 0, err
    assert "built in memory" in out and "PASSED: all 1 output(s) meet rel L2 <= 0.0001" in out
    (row,) = _table(out).values()
    assert row[0] == "y" and row[-1] == "pass"
    assert float(row[1]) > 0 and float(row[7]) < 1e-6  # reference magnitude, relative L2


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


def test_an_engine_built_from_another_model_is_refused(cli, mlp, tmp_path):
    other = mlp_model(tmp_path / "other.onnx")  # same graph and IO, other weights
    engine = tmp_path / "other.engine"
    assert cli("build", other, "-o", engine)[0] == 0
    rc, _, err = cli("compare", mlp, "--engine", engine, "--shapes", "x:4x4")
    assert_one_line_error(rc, err)
    assert "was built from other.onnx" in err and "not from" in err and "mlp.onnx" in err


def test_engine_and_model_in_the_wrong_places_are_clear_errors(cli, mlp, tmp_path):
    engine = tmp_path / "e.engine"
    assert cli("build", mlp, "-o", engine)[0] == 0
    rc, _, err = cli("compare", engine)
    assert_one_line_error(rc, err)
    assert "is an engine" in err and "--engine" in err
    rc, _, err = cli("compare", mlp, "--engine", mlp)
    assert_one_line_error(rc, err)
    assert "is not a tensorkiln engine" in err


def test_wrong_outputs_of_tiny_magnitude_fail_by_default(cli, tmp_path):
    model = _tiny_model(tmp_path / "tiny.onnx")
    built = tmp_path / "other.engine"
    assert cli("build", _tiny_model(tmp_path / "other.onnx"), "-o", built)[0] == 0
    wrong = _claiming(built, model, tmp_path / "wrong.engine")
    rc, out, _ = cli("compare", model, "--engine", wrong)
    assert rc == 1
    assert "FAIL (rel L2" in " ".join(_table(out)["y"])
    assert "FAILED: 1 of 1 output(s)" in out and out.rstrip().endswith(": y")
    # JSON: the same verdict, the failure line on stderr, both sides' magnitude
    rc, out, err = cli("compare", model, "--engine", wrong, "--json")
    assert rc == 1 and "FAILED" in err
    row = json.loads(out)["outputs"]["y"]
    assert row["reference"]["max_abs"] < 1e-7 and row["rel_l2"] > 0.1
    # the absolute tolerance alone is what let such outputs pass
    rc, out, _ = cli("compare", model, "--engine", wrong, "--rel-l2", "0", "--atol", "1e-5")
    assert rc == 0 and "PASSED" in out
    # and the right engine of the tiny model passes the default
    right = tmp_path / "right.engine"
    assert cli("build", model, "-o", right)[0] == 0
    assert cli("compare", model, "--engine", right)[0] == 0


@pytest.mark.parametrize(
    ("flags", "passes"),
    [
        ([], True),  # relative L2 sees one element off by a rounding step as what it is
        (["--cosine", "0.99999"], True),
        (["--check-error-stat", "median"], True),
        (["--check-error-stat", "elemwise"], False),  # the element fails atol and rtol 1e-5
        (["--check-error-stat", "max"], False),
        (["--rel-l2", "1e-9"], False),
    ],
)
def test_one_element_off_in_a_large_output(mlp, flags, passes):
    """A large output (here onnxruntime's) with one small element off by 1e-4 of the output's
    scale: rel L2 ~1e-6, as a correct fp32 engine that rounds differently gives."""
    from tensorkiln.cli.main import _parser

    x = np.random.default_rng().standard_normal((4096, 4)).astype(np.float32)
    ref = ort_outputs(mlp, {"x": x})["y"]
    ours = ref.copy()
    i = np.unravel_index(np.argmin(np.abs(ref) + (np.abs(ref) < 1e-3)), ref.shape)
    ours[i] += np.float32(1e-4 * np.abs(ref).mean())
    args = _parser().parse_args(["compare", "m.onnx", *flags])
    row = error_stats(ours, ref, Criteria.from_args(args))
    assert 1e-8 < row["rel_l2"] < 1e-5
    assert row["passed"] is passes, row["checks"]


def test_nan_inf_and_zero_outputs():
    ref = np.array([np.nan, np.inf, -np.inf, 0.0, 1.0], np.float32)
    assert error_stats(ref.copy(), ref)["passed"]  # the same NaN and infinities agree
    ours = ref.copy()
    ours[0] = 1.0  # NaN on one side only
    row = error_stats(ours, ref)
    assert not row["passed"] and row["abs_error"]["max"] == np.inf
    zeros = np.zeros(5, np.float32)
    assert error_stats(zeros, zeros)["passed"]
    assert not error_stats(zeros + 1e-3, zeros)["passed"]  # reference 0: within atol 1e-5
    assert error_stats(zeros + 1e-6, zeros)["passed"]


def test_several_outputs_and_integer_inputs(cli, tmp_path):
    model = two_io_model(tmp_path / "two.onnx")
    rc, out, err = cli("compare", model, "--shapes", "a:3x3,k:3")
    assert rc == 0, err
    assert set(_table(out)) == {"out", "total"}
    for bad in (["--atol", "-1"], ["--cosine", "2"], ["--check-error-stat", "p99"]):
        rc, _, err = cli("compare", model, *bad)
        assert_one_line_error(rc, err, code=2)


def test_integer_outputs_must_be_equal():
    a = np.random.default_rng().integers(0, 100, (3, 5))
    assert error_stats(a, a.copy())["passed"]
    b = a.copy()
    b[1, 2] += 1
    assert error_stats(b, a)["problem"] == "values differ"


def test_help_states_the_criteria_and_defaults(cli):
    _, out, _ = cli("compare", "--help")
    assert "--rel-l2" in out and "default 0.0001" in out
    assert "--check-error-stat" in out and "elemwise" in out and "--cosine" in out


def test_missing_onnxruntime_is_a_clear_error(cli, mlp, monkeypatch):
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # import fails as if not installed
    rc, _, err = cli("compare", mlp)
    assert_one_line_error(rc, err)
    assert "pip install onnxruntime" in err


def test_engine_with_other_inputs_is_a_clear_error(cli, mlp, tmp_path):
    model = two_io_model(tmp_path / "two.onnx")
    engine = tmp_path / "two.engine"
    assert cli("build", model, "-o", engine)[0] == 0
    rc, _, err = cli("compare", mlp, "--engine", _claiming(engine, mlp, tmp_path / "c.engine"))
    assert_one_line_error(rc, err)


def test_layerwise_on_a_float_engine_passes_every_tensor(cli, mlp):
    rc, out, err = cli("compare", mlp, "--layerwise", "--shapes", "x:6x4", "--seed", "1")
    assert rc == 0, out + err
    assert "layer by layer" in out and "PASSED: all" in out
    for name in ("fc1", "fc2"):  # the optimizer's layers, named after the nodes they began with
        assert name in out

"""The `tensorkiln` command: outputs match the model, user errors exit non-zero with one message."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.cli.main import main


def _model(tmp_path):
    rng = np.random.default_rng()
    w = rng.standard_normal((4, 3)).astype(np.float32)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [x],
        [y],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, w


def test_run_with_inputs_and_outputs_files(tmp_path, capsys):
    path, w = _model(tmp_path)
    x = np.random.default_rng().standard_normal((5, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    rc = main(
        [
            "run",
            str(path),
            "--load-inputs",
            str(tmp_path / "in.npz"),
            "--save-outputs",
            str(tmp_path / "out.npz"),
            "--iterations",
            "3",
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "latency ms" in out and "median" in out and "output y: float32 [5, 3]" in out
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"], x @ w, rtol=1e-5)


def test_run_random_inputs_with_shapes(tmp_path, capsys):
    path, _ = _model(tmp_path)
    assert main(["run", str(path), "--shapes", "x:7x4", "--iterations", "2"]) == 0
    assert "output y: float32 [7, 3]" in capsys.readouterr().out


def test_user_errors_exit_1_with_one_line(tmp_path, capsys):
    path, _ = _model(tmp_path)
    cases = [
        ["run", str(tmp_path / "missing.onnx")],
        ["run", str(path), "--shapes", "x:7x5"],
        ["run", str(path), "--shapes", "nope:1x4"],
        ["run", str(path), "--shapes", "garbage"],
        ["run", str(path), "--load-inputs", str(tmp_path / "none.npz")],
        ["inspect", str(tmp_path / "missing.onnx")],
    ]
    for argv in cases:
        assert main(argv) == 1, argv
        err = capsys.readouterr().err
        assert err.startswith("tensorkiln: error: ") and "Traceback" not in err, argv


def test_inspect_and_ops(tmp_path, capsys):
    path, _ = _model(tmp_path)
    assert main(["inspect", str(path)]) == 0
    assert "%y: f32[N,3] = MatMul(%x, %w)" in capsys.readouterr().out
    assert main(["ops"]) == 0
    out = capsys.readouterr().out
    assert "ai.onnx\tConv" in out and "ai.onnx\tMatMul" in out


def test_module_entry_point_and_bad_flag():
    proc = subprocess.run(
        [sys.executable, "-m", "tensorkiln", "run", "m.onnx", "--bogus"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "unrecognized arguments" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "tensorkiln", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0 and "run" in proc.stdout

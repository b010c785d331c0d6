"""Small models, an in-process runner and checks for the `tensorkiln` command's tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.cli.main import main

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits_cnn.onnx"
FAST = ["--warmup", "0", "--iterations", "3"]  # a few timed runs, no warm-up, no minimum duration


def mlp_model(path: Path, rng: np.random.Generator | None = None) -> Path:
    """x[N,4] -> MatMul -> Add -> Relu -> MatMul -> y[N,3], fresh random weights each call."""
    rng = rng or np.random.default_rng()
    w1 = rng.standard_normal((4, 8)).astype(np.float32)
    b1 = rng.standard_normal(8).astype(np.float32)
    w2 = rng.standard_normal((8, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h0"], name="fc1"),
        helper.make_node("Add", ["h0", "b1"], ["h1"], name="bias1"),
        helper.make_node("Relu", ["h1"], ["h2"], name="act1"),
        helper.make_node("MatMul", ["h2", "w2"], ["y"], name="fc2"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializer=[
            numpy_helper.from_array(a, n) for a, n in ((w1, "w1"), (b1, "b1"), (w2, "w2"))
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def two_io_model(path: Path) -> Path:
    """Two inputs (float a[N,3], int64 k[N]) and two outputs; exercises random ints and naming."""
    nodes = [
        helper.make_node("Mul", ["a", "a"], ["sq"], name="square"),
        helper.make_node("Cast", ["k"], ["kf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Unsqueeze", ["kf", "axis"], ["ku"], name="unsqueeze"),
        helper.make_node("Add", ["sq", "ku"], ["out"], name="add"),
        helper.make_node("ReduceSum", ["out"], ["total"], keepdims=0, name="sum"),
    ]
    graph = helper.make_graph(
        nodes,
        "two_io",
        [
            helper.make_tensor_value_info("a", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("k", TensorProto.INT64, ["N"]),
        ],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, ["N", 3]),
            helper.make_tensor_value_info("total", TensorProto.FLOAT, []),
        ],
        initializer=[numpy_helper.from_array(np.array([1], np.int64), "axis")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


class CLI:
    """Runs `tensorkiln ARGS` in-process; returns (exit code, stdout, stderr)."""

    def __init__(self, capsys: pytest.CaptureFixture) -> None:
        self.capsys = capsys

    def __call__(self, *args: object) -> tuple[int, str, str]:
        self.capsys.readouterr()
        try:
            rc = main([str(a) for a in args])
        except SystemExit as exc:  # argparse usage errors and --help
            rc = exc.code
        out, err = self.capsys.readouterr()
        return rc, out, err

    def json(self, *args: object) -> dict:
        rc, out, err = self(*args)
        assert rc == 0, err
        return json.loads(out)


def assert_one_line_error(rc: int, err: str, code: int = 1) -> None:
    assert rc == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tensorkiln: error: "), err
    assert "Traceback" not in err


def ort_outputs(model: Path, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The independent reference: onnxruntime on the CPU."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))

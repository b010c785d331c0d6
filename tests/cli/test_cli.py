"""The `tensorkiln` command as a whole: entry points, help, ops, and one-line user errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from tests.cli.helpers import FAST, assert_one_line_error

COMMANDS = ["build", "run", "inspect", "compare", "trtexec", "ops"]


def test_module_entry_point_runs_and_rejects_unknown_flags():
    proc = subprocess.run(
        [sys.executable, "-m", "tensorkiln", "run", "m.onnx", "--bogus"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2
    assert_one_line_error(proc.returncode, proc.stderr, code=2)
    assert "unrecognized arguments: --bogus" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "tensorkiln", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0
    assert all(c in proc.stdout for c in COMMANDS)


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_has_help_with_examples(cli, command):
    rc, out, _ = cli(command, "--help")
    assert rc == 0
    assert "examples:" in out and f"tensorkiln {command}" in out


def test_ops_lists_the_reference_kernels(cli):
    rc, out, err = cli("ops")
    assert rc == 0 and "ai.onnx\tConv" in out and "ai.onnx\tMatMul" in out
    assert "operators" in err
    rc, out, _ = cli("ops", "--domain", "ai.onnx.ml")
    assert rc == 0 and "TreeEnsembleClassifier" in out and "\tConv\n" not in out


def test_usage_errors_exit_2_with_one_line(cli, mlp, tmp_path):
    cases = [
        ["run", mlp, "--iterations", "many"],
        ["run", mlp, "--warmup", "-1"],
        ["run", mlp, "--percentile", "90,101"],
        ["build", mlp],  # no -o
        ["build", mlp, "-o", tmp_path / "e", "--opt-level", "9"],
        ["build", mlp, "-o", tmp_path / "e", "--memory-limit", "lots"],
        ["compare", mlp, "--atol", "x"],
        ["frobnicate"],
    ]
    for argv in cases:
        rc, _, err = cli(*argv)
        assert_one_line_error(rc, err, code=2)


def test_user_errors_exit_1_with_one_line(cli, mlp, tmp_path):
    np.savez(tmp_path / "wrong.npz", z=np.zeros((2, 4), np.float32))
    (tmp_path / "junk.engine").write_bytes(b"TKENGINE" + b"\0" * 10)
    cases = [
        ["run", tmp_path / "missing.onnx"],
        ["run", mlp, "--shapes", "x:7x5"],
        ["run", mlp, "--shapes", "nope:1x4"],
        ["run", mlp, "--shapes", "garbage"],
        ["run", mlp, "--shapes", "x:2xA"],
        ["run", mlp, "--load-inputs", tmp_path / "none.npz"],
        ["run", mlp, "--load-inputs", tmp_path / "wrong.npz"],
        ["run", mlp, "--load-inputs", mlp],  # not an npz
        ["run", mlp, *FAST, "--save-outputs", tmp_path / "no" / "dir" / "out.npz"],
        ["run", tmp_path / "junk.engine"],
        ["inspect", tmp_path / "missing.onnx"],
        ["inspect", tmp_path / "junk.engine"],
        ["build", mlp, "-o", tmp_path / "no" / "dir" / "m.engine"],
    ]
    for argv in cases:
        rc, _, err = cli(*argv)
        assert_one_line_error(rc, err)


def test_verbose_before_or_after_the_command_shows_the_traceback(cli, tmp_path):
    for argv in (
        ["--verbose", "run", tmp_path / "x.onnx"],
        ["run", tmp_path / "x.onnx", "--verbose"],
    ):
        rc, _, err = cli(*argv)
        assert rc == 1 and "Traceback" in err and err.strip().endswith("does not exist")


def test_wrong_input_dtype_names_the_input(cli, mlp, tmp_path):
    np.savez(tmp_path / "in.npz", x=np.zeros((2, 4), np.float64))
    rc, _, err = cli("run", mlp, "--load-inputs", tmp_path / "in.npz")
    assert_one_line_error(rc, err)
    assert "'x'" in err and "float64" in err


def test_error_messages_show_control_characters_in_names_escaped(cli, tmp_path):
    """A name from a model file reaches the one-line error escaped, never as a terminal command."""
    name = "x\x1b[2J\x1b]0;title\x07"
    graph = helper.make_graph(
        [helper.make_node("Relu", [name], ["y"])],
        "g",
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    rc, out, err = cli("run", path, "--shapes", f"{name}:3x4")
    assert_one_line_error(rc, err)
    assert "\x1b" not in err and "\x07" not in err and "\x1b" not in out
    assert "x\\x1b[2J" in err


def test_ops_of_the_cpu_backend_are_the_cuda_backends_torch_kernels(cli):
    pytest.importorskip("torch")
    rc, cpu, _ = cli("ops", "--backend", "cpu")
    rc2, cuda, _ = cli("ops", "--backend", "cuda")
    assert rc == rc2 == 0 and cpu == cuda and "ai.onnx\tConv" in cpu

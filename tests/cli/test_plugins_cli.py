"""--plugins: the CLI imports installed modules that register custom ops, so a model with a
plugin's nodes builds and its engine runs; without them the engine is refused, naming the
plugin and the flag; anything but a module name is refused before anything is imported."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

PLUGIN = """\
import numpy as np
import tensorkiln

@tensorkiln.plugin("tk_cli_test::Cube", version="2")
def cube(x):
    return x

@cube.reference
def _(x):
    return x * x * x
"""


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    return subprocess.run([sys.executable, "-m", "tensorkiln", *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)  # fmt: skip


def test_plugins_flag_builds_and_runs_a_model_with_custom_ops(tmp_path: Path) -> None:
    (tmp_path / "cli_cube_plugin.py").write_text(PLUGIN)
    nodes = [helper.make_node("Cube", ["x"], ["c"], domain="tk_cli_test"),
             helper.make_node("Add", ["c", "x"], ["y"])]  # fmt: skip
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 3]) for n in ("x", "y")]
    model = helper.make_model(
        helper.make_graph(nodes, "g", io[:1], io[1:]),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("tk_cli_test", 2)],
    )
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    x = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)

    built = _cli(tmp_path, "build", "m.onnx", "-o", "m.engine", "--backend", "reference",
                 "--plugins", "cli_cube_plugin")  # fmt: skip
    assert built.returncode == 0, built.stderr
    ran = _cli(tmp_path, "run", "m.engine", "--plugins", "cli_cube_plugin", "--load-inputs",
               "in.npz", "--save-outputs", "out.npz")  # fmt: skip
    assert ran.returncode == 0, ran.stderr
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"], x**3 + x, rtol=1e-6)

    refused = _cli(tmp_path, "run", "m.engine")
    assert refused.returncode == 1
    assert "tk_cli_test::Cube" in refused.stderr and "--plugins" in refused.stderr
    assert "Traceback" not in refused.stderr


def test_plugins_flag_takes_module_names_only(tmp_path: Path) -> None:
    for bad, says in [("./evil.py", "not a Python module name"),
                      ("no_such_module_here", "cannot import 'no_such_module_here'")]:  # fmt: skip
        r = _cli(tmp_path, "ops", "--plugins", bad)
        assert r.returncode == 1 and says in r.stderr, r.stderr
        assert "Traceback" not in r.stderr

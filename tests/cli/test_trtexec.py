"""`tensorkiln trtexec`: trtexec's flags, end to end on small models, against onnxruntime."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.cli.common import parse_shapes
from tensorkiln.cli.trtexec import SUPPORTED, UNSUPPORTED, UsageError, parse_flags
from tensorkiln.engine import Engine
from tests.cli.helpers import assert_one_line_error, ort_outputs

FAST = ["--warmUp=0", "--iterations=3", "--duration=0"]


def _colon_named_model(path):
    """'input:0'[N,4] -> MatMul -> Relu -> 'output:0'[N,5], as TensorFlow exports name them."""
    w = np.random.default_rng().standard_normal((4, 5)).astype(np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input:0", "w"], ["h"]),
            helper.make_node("Relu", ["h"], ["output:0"]),
        ],
        "colon",
        [helper.make_tensor_value_info("input:0", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("output:0", TensorProto.FLOAT, ["N", 5])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


def test_build_save_and_run_with_a_shape_range(cli, mlp, tmp_path):
    engine = tmp_path / "mlp.engine"
    times = tmp_path / "times.json"
    rc, out, err = cli(
        "trtexec", f"--onnx={mlp}", f"--saveEngine={engine}", "--minShapes=x:1x4",
        "--optShapes=x:4x4", "--maxShapes=x:16x4", "--shapes=x:9x4", "--warmUp=0",
        "--iterations=7", "--duration=0", f"--exportTimes={times}", "--avgRuns=3",
        "--dumpProfile", "--builderOptimizationLevel=0",
    )  # fmt: skip
    assert rc == 0, err
    assert "profile 0: x min [1, 4] opt [4, 4] max [16, 4]" in out  # the build's report
    assert "input  x: float32 [9, 4] (random)" in out  # run with --shapes inside the range
    assert "per-layer profile (7 iterations)" in out and "fc1" in out
    assert out.count("average on ") == 3  # 3 + 3 + 1 runs
    assert len(json.loads(times.read_text())) == 7
    e = Engine.load(engine)
    assert e.profiles[0].shapes["x"] == ((1, 4), (4, 4), (16, 4))
    assert e.build["config"]["optimization_level"] == 0
    x = np.random.default_rng().standard_normal((11, 4)).astype(np.float32)
    got = e.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, ort_outputs(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_raw_inputs_exported_outputs_and_profile(cli, tmp_path):
    """--loadInputs (raw files, the quoted name of one input) and --exportOutput against
    onnxruntime; --exportProfile lists every layer."""
    from tests.cli.helpers import two_io_model

    model = two_io_model(tmp_path / "two.onnx")  # a float[N,3] and an int64 k[N]
    rng = np.random.default_rng()
    a = rng.standard_normal((5, 3)).astype(np.float32)
    a.tofile(tmp_path / "a.bin")
    outputs, profile = tmp_path / "out.json", tmp_path / "profile.json"
    rc, out, err = cli(
        "trtexec", f"--onnx={model}", "--shapes=a:5x3,k:5", f"--loadInputs='a':{tmp_path / 'a.bin'}",
        f"--exportOutput={outputs}", f"--exportProfile={profile}", *FAST,
    )  # fmt: skip
    assert rc == 0, err
    assert "input  a: float32 [5, 3] (raw files, random for k)" in out
    assert "per-layer profile (" not in out  # exported, not printed (no --dumpProfile)
    assert {row["op"] for row in json.loads(profile.read_text())["layers"]} >= {"ReduceSum"}
    rows = {row["name"]: row for row in json.loads(outputs.read_text())}
    assert rows["out"]["dimensions"] == "5x3" and rows["total"]["dimensions"] == ""
    # k was random: recover it from the output (out = a*a + k) and check both against onnxruntime
    got = np.array(rows["out"]["values"], np.float32).reshape(5, 3)
    k = np.rint(got[:, 0] - a[:, 0] ** 2).astype(np.int64)
    want = ort_outputs(model, {"a": a, "k": k})
    np.testing.assert_allclose(got, want["out"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(rows["total"]["values"], want["total"], rtol=1e-5)
    # a raw file of the wrong size says what it needed
    rc, _, err = cli("trtexec", f"--onnx={model}", "--shapes=a:4x3,k:4",
                     f"--loadInputs=a:{tmp_path / 'a.bin'}", *FAST)  # fmt: skip
    assert_one_line_error(rc, err)
    assert "holds 60 bytes" in err and "needs 48" in err


def test_load_engine_runs_it(cli, mlp, tmp_path):
    engine = tmp_path / "mlp.engine"
    rc, out, err = cli("trtexec", f"--onnx={mlp}", f"--saveEngine={engine}", "--shapes=x:2x4",
                       "--skipInference")  # fmt: skip
    assert rc == 0, err
    assert engine.is_file() and "throughput" not in out
    rc, out, err = cli("trtexec", f"--loadEngine={engine}", *FAST, "--percentile=50,99")
    assert rc == 0, err
    assert f"model: {engine}" in out and "output y: float32 [2, 3]" in out
    assert any(line.split()[-2:] == ["p50", "p99"] for line in out.splitlines()), out


def test_quoted_names_with_colons_and_scalars(cli, tmp_path):
    model = _colon_named_model(tmp_path / "colon.onnx")
    engine = tmp_path / "colon.engine"
    rc, out, err = cli("trtexec", f"--onnx={model}", f"--saveEngine={engine}",
                       "--shapes='input:0':3x4", *FAST)  # fmt: skip
    assert rc == 0, err
    assert "input  input:0: float32 [3, 4]" in out
    e = Engine.load(engine)
    assert e.profiles[0].shapes["input:0"][1] == (3, 4)
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    got = e.create_execution_context().infer({"input:0": x})["output:0"]
    want = ort_outputs(model, {"input:0": x})["output:0"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert parse_shapes("a:scalar,b:,'c:1':2x3") == {"a": (), "b": (), "c:1": (2, 3)}


def test_precision_flags_refuse_or_warn(cli, mlp, tmp_path):
    for flag, word in (("--int8", "int8"), ("--fp8", "fp8")):
        # trtexec's placeholder ranges: calibrated on random inputs, with a warning
        rc, out, err = cli(
            "trtexec", f"--onnx={mlp}", flag, "--skipInference", "--backend=reference"
        )
        assert rc == 0, err
        assert "ranges come from random inputs" in err and "its accuracy is not" in err
        assert f"{word}: 2 of 2 convolution/GEMM layers quantized" in out
    rc, out, err = cli(
        "trtexec", f"--onnx={mlp}", "--fp16", "--skipInference", "--backend=reference"
    )
    assert rc == 0, err
    assert err.startswith("tensorkiln: warning: ") and "float32" in err
    assert "precisions allowed: fp32;" in out
    rc, _, err = cli("trtexec", f"--onnx={mlp}", "--best", "--noTF32", "--skipInference")
    assert rc == 0 and "--best: INT8/FP8 are not implemented by the" in err


def test_timing_cache_file_is_the_builds(cli, mlp, tmp_path):
    engine, cache = tmp_path / "e.engine", tmp_path / "t.cache"
    rc, _, err = cli("trtexec", f"--onnx={mlp}", f"--saveEngine={engine}",
                     f"--timingCacheFile={cache}", "--skipInference")  # fmt: skip
    assert rc == 0, err
    assert Engine.load(engine).build["config"]["timing_cache"] == str(cache)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--memPoolSize=workspace:1024"], "trtexec flag --memPoolSize is not supported"),
        (["--loadInputs=x.bin"], "bad entry 'x.bin': expected NAME:FILE"),
        (["--dumpOutput"], "--exportOutput=FILE.json"),
        (["--int4"], "INT4 is not implemented yet"),
        (["--noSuchFlag"], "unknown trtexec flag --noSuchFlag"),
        (["--saveEngine", "m.engine"], "take their value after '='"),
        (["--fp16=1"], "takes no value"),
        (["--iterations"], "needs a value"),
        (["--iterations=ten"], "expected an integer"),
        (["--duration=-1"], "must be >= 0"),
        (["--builderOptimizationLevel=9"], "0..5"),
        (["--shapes=x:1x4", "--shapes=x:2x4"], "given twice"),
        (["--buildOnly", "--skipInference"], "given twice"),
    ],
)
def test_bad_flags_exit_2_with_one_line(cli, mlp, argv, says):
    rc, _, err = cli("trtexec", f"--onnx={mlp}", *argv)
    assert_one_line_error(rc, err, code=2)
    assert says in err, err


def test_every_unsupported_flag_is_refused_by_name():
    assert not set(UNSUPPORTED) & set(SUPPORTED)
    for name in UNSUPPORTED:
        with pytest.raises(UsageError, match=f"trtexec flag {name} is not supported"):
            parse_flags([f"{name}=1"])


def test_model_flags_must_make_sense_together(cli, mlp, tmp_path):
    engine = tmp_path / "e.engine"
    assert cli("build", mlp, "-o", engine)[0] == 0
    for argv in (
        [],
        [f"--onnx={mlp}", f"--loadEngine={engine}"],
        [f"--loadEngine={engine}", "--minShapes=x:1x4"],
        [f"--loadEngine={engine}", f"--saveEngine={tmp_path / 'n'}"],
        [f"--loadEngine={engine}", "--fp16"],  # the engine's precision was chosen at its build
    ):
        assert_one_line_error(*cli("trtexec", *argv)[::2], code=2)
    rc, _, err = cli("trtexec", f"--loadEngine={mlp}", *FAST)  # an ONNX model, not an engine
    assert_one_line_error(rc, err)
    assert f"--onnx={mlp}" in err


def test_verbose_shows_the_traceback(cli, tmp_path):
    missing = tmp_path / "missing.onnx"
    rc, _, err = cli("trtexec", f"--onnx={missing}", "--verbose")
    assert rc == 1 and "Traceback" in err and "does not exist" in err
    rc, _, err = cli("--verbose", "trtexec", f"--onnx={missing}")  # tensorkiln's, before
    assert rc == 1 and "Traceback" in err
    rc, _, err = cli("trtexec", f"--onnx={missing}")
    assert_one_line_error(rc, err)


def test_help_lists_the_supported_flags(cli):
    rc, out, _ = cli("trtexec", "--help")
    assert rc == 0
    for name in ("--onnx", "--saveEngine", "--minShapes", "--warmUp", "--avgRuns", "--verbose"):
        assert f"  {name}" in out

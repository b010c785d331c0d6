"""`tensorkiln build`: engines from ONNX models, profiles from shape flags, rebuilds from engines."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from tensorkiln.builder import Builder
from tensorkiln.cli import build as build_command
from tensorkiln.engine import Engine
from tensorkiln.engine import format as fmt
from tests.cli.helpers import assert_one_line_error, ort_outputs
from tests.precision.test_io_formats import io_model


def test_build_writes_an_engine_and_reports_phases_and_memory(cli, mlp, tmp_path):
    engine = tmp_path / "mlp.engine"
    # level 0: the layers are the model's nodes, unchanged by the graph optimizer
    rc, out, err = cli("build", mlp, "-o", engine, "--shapes", "x:5x4", "--opt-level", "0")
    assert rc == 0, err
    assert "layers: 4" in out
    for phase in ("parse", "optimize", "tactics", "memory"):
        assert phase in out
    assert "planned peak" in out and "naive sum" in out
    assert "profile 0: x min [5, 4] opt [5, 4] max [5, 4]" in out
    e = Engine.load(engine)
    assert [layer["name"] for layer in e.layers] == ["fc1", "bias1", "act1", "fc2"]
    assert e.profiles[0].shapes["x"] == ((5, 4), (5, 4), (5, 4))
    x = np.random.default_rng().standard_normal((5, 4)).astype(np.float32)
    got = e.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, ort_outputs(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_shape_ranges_and_settings_are_recorded(cli, mlp, tmp_path):
    engine = tmp_path / "mlp.engine"
    rc, _, err = cli(
        "build", mlp, "-o", engine, "--opt-level", "0", "--memory-limit", "64K",
        "--min-shapes", "x:1x4", "--opt-shapes", "x:4x4", "--max-shapes", "x:16x4",
        "--timing-cache", tmp_path / "cache.json",
    )  # fmt: skip
    assert rc == 0, err
    e = Engine.load(engine)
    assert e.profiles[0].shapes["x"] == ((1, 4), (4, 4), (16, 4))
    config = e.build["config"]
    assert config["precisions"] == ["fp32"]
    assert config["optimization_level"] == 0 and config["memory_limit"] == 64 << 10
    assert config["timing_cache"].endswith("cache.json")


@pytest.mark.parametrize("flag", ["--int8", "--fp8"])
def test_int8_and_fp8_without_calibration_are_a_clear_error(cli, mlp, tmp_path, flag):
    out = tmp_path / "e"
    rc, _, err = cli("build", mlp, "-o", out, "--backend", "reference", flag)
    assert_one_line_error(rc, err)
    assert f"{flag[2:].upper()} needs calibration" in err and "--calib-data" in err
    assert not out.exists()


def test_int8_on_a_backend_without_int8_kernels_warns_and_stays_float(cli, mlp, tmp_path):
    out = tmp_path / "e"
    rc, _, err = cli("build", mlp, "-o", out, "--backend", "cpu", "--int8")
    assert rc == 0, err
    assert "the cpu backend does not implement int8" in err
    assert Engine.load(out).build["config"]["precisions"] == ["fp32"]


def test_reduced_precision_on_the_reference_backend_warns_and_stays_fp32(cli, mlp, tmp_path):
    engine = tmp_path / "e"
    rc, out, err = cli("build", mlp, "-o", engine, "--backend", "reference", "--fp16", "--bf16")
    assert rc == 0, err
    warning = [line for line in err.splitlines() if line.startswith("tensorkiln: warning: ")]
    assert len(warning) == 1 and "bf16, fp16" in warning[0] and "float32" in warning[0], err
    # the report lists only what a layer can use, and so does the engine
    assert "precisions allowed: fp32; layers compute in fp32" in out
    e = Engine.load(engine)
    assert e.build["config"]["precisions"] == ["fp32"] and e.build["precision"] == "fp32"
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    got = e.create_execution_context().infer({"x": x})["y"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ort_outputs(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_best_warns_and_allows_what_the_backend_implements(cli, mlp, tmp_path):
    engine = tmp_path / "e"
    rc, out, err = cli("build", mlp, "-o", engine, "--backend", "reference", "--best")
    assert rc == 0, err
    assert "--best: INT8/FP8 need calibration data (--calib-data)" in err
    assert len(err.strip().splitlines()) == 1  # no second warning about fp16: --best asked for fp32
    assert "precisions allowed: fp32;" in out
    assert Engine.load(engine).build["config"]["precisions"] == ["fp32"]


def test_builder_config_refuses_or_warns_in_the_api(mlp):
    from tensorkiln.builder import Builder, BuilderConfig, PrecisionWarning
    from tensorkiln.errors import BuildError

    for precision in ("int8", "fp8"):
        uncalibrated = BuilderConfig()
        uncalibrated.set_flag(precision)
        with pytest.raises(BuildError, match=f"{precision.upper()} needs calibration"):
            Builder("reference").build(mlp, uncalibrated)
    config = BuilderConfig()
    config.set_flag("fp16")
    with pytest.warns(PrecisionWarning, match="engine stays float32"):
        engine = Builder("reference").build(mlp, config)
    assert engine.build["config"]["precisions"] == ["fp32"]
    assert config.precisions == {"fp16", "fp32"}  # the caller's config is left as it was


def test_cuda_backend_keeps_its_reduced_precisions_without_a_warning():
    from tensorkiln.builder import BuilderConfig

    config = BuilderConfig()
    config.set_flag("fp16")
    config.set_flag("tf32")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert config.for_backend("cuda").precisions == {"fp16", "fp32", "tf32"}


def test_memory_limit_below_the_plan_fails_the_build(cli, mlp, tmp_path):
    rc, _, err = cli(
        "build", mlp, "-o", tmp_path / "e", "--shapes", "x:64x4", "--memory-limit", "1"
    )
    assert rc == 1 and "exceeds the memory limit of 1 bytes" in err
    assert not (tmp_path / "e").exists()


def test_bad_shape_flags_are_one_line_errors(cli, mlp, tmp_path):
    out = tmp_path / "e"
    cases = [
        ["--shapes", "x:2x4", "--min-shapes", "x:1x4", "--max-shapes", "x:4x4"],
        ["--min-shapes", "x:1x4"],
        ["--min-shapes", "x:4x4", "--max-shapes", "x:2x4"],
        ["--shapes", "x:2x5"],  # axis 1 is fixed at 4
        ["--shapes", "y:2x3"],  # not an input
    ]
    for flags in cases:
        rc, _, err = cli("build", mlp, "-o", out, *flags)
        assert_one_line_error(rc, err)
    assert not out.exists()


def test_model_and_from_engine_exclude_each_other(cli, mlp, tmp_path):
    engine = tmp_path / "e.engine"
    assert cli("build", mlp, "-o", engine)[0] == 0
    for argv in (
        ["build", "-o", tmp_path / "n"],
        ["build", mlp, "--from-engine", engine, "-o", tmp_path / "n"],
    ):
        assert_one_line_error(*cli(*argv)[::2])
    rc, _, err = cli("build", engine, "-o", tmp_path / "n")
    assert_one_line_error(rc, err)
    assert "--from-engine" in err


def _as_if_from_elsewhere(src, dst):
    """Rewrite an engine as if an older tensorkiln had built it for a GPU this machine lacks."""
    plan, tensors = fmt.read(src)
    plan = {k: v for k, v in plan.items() if k != "tensors"}
    plan.update(
        tensorkiln_version="0.0.1",
        backend="cuda",
        target={"device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"},
    )
    fmt.write(dst, plan, tensors)
    return dst


def test_from_engine_rebuilds_an_engine_from_another_machine(cli, mlp, tmp_path):
    original = tmp_path / "orig.engine"
    rc, _, err = cli(
        "build", mlp, "-o", original, "--embed-source", "--fp16",
        "--min-shapes", "x:1x4", "--opt-shapes", "x:2x4", "--max-shapes", "x:8x4",
    )  # fmt: skip
    assert rc == 0, err
    foreign = _as_if_from_elsewhere(original, tmp_path / "foreign.engine")
    rc, _, err = cli("run", foreign)
    assert_one_line_error(rc, err)
    assert "--from-engine" in err

    rebuilt = tmp_path / "rebuilt.engine"
    rc, out, err = cli("build", "--from-engine", foreign, "-o", rebuilt)
    assert rc == 0, err
    assert "source model embedded" in out
    old, new = Engine.load(original), Engine.load(rebuilt)
    assert new.source == old.source  # same name and sha256
    assert new.profiles[0].shapes == old.profiles[0].shapes  # settings carried over
    # the reference backend implements no fp16: neither engine claims it
    assert new.build["config"]["precisions"] == old.build["config"]["precisions"] == ["fp32"]
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    a = old.create_execution_context().infer({"x": x})["y"]
    b = new.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_array_equal(a, b)


def test_from_engine_without_embedded_source_says_so(cli, mlp, tmp_path):
    engine = tmp_path / "e.engine"
    assert cli("build", mlp, "-o", engine)[0] == 0
    rc, _, err = cli(
        "build",
        "--from-engine",
        _as_if_from_elsewhere(engine, tmp_path / "f"),
        "-o",
        tmp_path / "n",
    )
    assert_one_line_error(rc, err)
    assert "--embed-source" in err and "mlp.onnx" in err


def test_dump_ir_writes_the_graph_before_the_passes(cli, mlp, tmp_path):
    dump = tmp_path / "ir"
    rc, _, err = cli("build", mlp, "-o", tmp_path / "e", "--dump-ir", dump)
    assert rc == 0, err
    first = sorted(dump.iterdir())[0]
    assert first.name == "000_input.txt"
    assert "graph" in first.read_text() and "MatMul" in first.read_text()


def test_build_report_names_the_fused_layers(cli, digits, tmp_path):
    rc, out, err = cli("build", digits, "-o", tmp_path / "d.engine")
    assert rc == 0, err
    assert "layers: 5 (from 7 nodes)" in out
    assert "fuse_conv_act" in out
    fused = [line.split() for line in out.splitlines() if "tensorkiln.ConvAct" in line]
    assert [row[1] for row in fused] == ["tensorkiln.ConvAct"] * 2
    rc, out, _ = cli("inspect", tmp_path / "d.engine")
    assert rc == 0 and out.count("tensorkiln.ConvAct") == 2


def test_from_engine_never_uses_the_timing_cache_path_the_engine_names(
    cli, mlp, tmp_path, monkeypatch
):

    original = tmp_path / "orig.engine"
    named = tmp_path / "named-by-the-engine.json"
    rc, _, err = cli("build", mlp, "-o", original, "--embed-source", "--timing-cache", named)
    assert rc == 0, err
    plan, tensors = fmt.read(original)
    plan = {k: v for k, v in plan.items() if k != "tensors"}
    plan["build"]["config"]["timing_cache"] = "/dev/zero"  # a stranger's engine names any path
    fmt.write(original, plan, tensors)

    # the cuda builder (torch kernels on the CPU) is the one that reads and writes timing caches
    monkeypatch.setattr(build_command, "Builder", lambda backend: Builder("cuda", device="cpu"))
    rebuilt = tmp_path / "rebuilt.engine"
    rc, _, err = cli("build", "--from-engine", original, "-o", rebuilt, "--opt-level", "0")
    assert rc == 0, err
    assert not named.exists()
    assert Engine.load(rebuilt).build["config"]["timing_cache"] is None

    # a cache given on this command line is used, and created
    mine = tmp_path / "mine.json"
    rc, _, err = cli("build", "--from-engine", original, "-o", rebuilt, "--timing-cache", mine)
    assert rc == 0, err
    assert mine.is_file() and Engine.load(rebuilt).build["config"]["timing_cache"] == str(mine)


@pytest.mark.parametrize("where", ["/dev/zero", "folder", "missing/cache.json"])
def test_timing_cache_that_is_not_a_file_is_a_one_line_error(cli, mlp, tmp_path, where):
    (tmp_path / "folder").mkdir()
    path = where if where.startswith("/") else tmp_path / where
    rc, _, err = cli("build", mlp, "-o", tmp_path / "e", "--timing-cache", path)
    assert_one_line_error(rc, err)
    assert "timing cache" in err


def test_io_formats_from_build_and_trtexec_flags(cli, tmp_path):
    path = io_model(tmp_path / "m.onnx")
    out = tmp_path / "m.engine"
    rc, text, err = cli(
        "build", path, "-o", out, "--backend", "reference", "--embed-source",
        "--input-io-formats", "fp16:chw,int64,fp16:chw", "--output-io-formats", "fp16",
    )  # fmt: skip
    assert rc == 0, err
    assert "input 'x' is fp16 (I/O format)" in text and "output 'y' is fp16" in text
    engine = Engine.load(out)
    assert [v.dtype.name for v in engine.graph.inputs] == ["FLOAT16", "INT64", "FLOAT16"]
    assert [v.dtype.name for v in engine.graph.outputs] == ["FLOAT16", "INT64"]
    # a rebuild keeps the engine's formats
    rc, text, err = cli("build", "--from-engine", out, "-o", tmp_path / "again.engine")
    assert rc == 0, err
    again = Engine.load(tmp_path / "again.engine")
    assert [v.dtype.name for v in again.graph.inputs] == ["FLOAT16", "INT64", "FLOAT16"]
    for bad, what in (("fp16:nhwc", "layout 'nhwc'"), ("fp16,fp16", "2 formats for 3 inputs")):
        rc, _, err = cli("build", path, "-o", tmp_path / "bad.engine", "--input-io-formats", bad)
        assert_one_line_error(rc, err)
        assert what in err
    rc, text, err = cli(
        "trtexec", f"--onnx={path}", "--inputIOFormats=fp16:chw,int64:chw,fp32:chw",
        "--skipInference", "--backend=reference",
    )  # fmt: skip
    assert rc == 0, err
    assert "input 'x' is fp16 (I/O format)" in text

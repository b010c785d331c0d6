"""The command line with the cuda backend: clear errors where there is no GPU, and on a GPU the
build report's tuning lines, inspect's tactic columns and run's GPU statistics."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.cli.helpers import FAST, assert_one_line_error, ort_outputs

torch = pytest.importorskip("torch")
HAS_CUDA = torch.cuda.is_available()


@pytest.mark.skipif(HAS_CUDA, reason="checks the message on machines without a GPU")
def test_cuda_build_without_a_gpu_is_a_clear_error(cli, mlp, tmp_path) -> None:
    rc, _, err = cli("build", mlp, "-o", tmp_path / "m.engine", "--backend", "cuda")
    assert_one_line_error(rc, err)
    assert "needs PyTorch with a CUDA device" in err and "backend='reference'" in err


def test_cuda_run_flags_need_a_cuda_engine(cli, mlp, tmp_path) -> None:
    engine = tmp_path / "m.engine"
    assert cli("build", mlp, "-o", engine, "--backend", "reference")[0] == 0
    for flag in ("--use-cuda-graph", "--device-io"):
        rc, _, err = cli("run", engine, *FAST, flag)
        assert_one_line_error(rc, err)
        assert "need an engine of the cuda backend on a GPU" in err


def test_unknown_tactic_source_is_a_clear_error(cli, mlp, tmp_path) -> None:
    rc, _, err = cli("build", mlp, "-o", tmp_path / "m.engine", "--tactic-sources", "tensorrt")
    assert_one_line_error(rc, err)
    assert "unknown tactic source(s) tensorrt; choose from triton, gluon, cutlass" in err


def test_tactic_exclusions_are_recorded_and_a_bad_timeout_is_a_clear_error(
    cli, mlp, tmp_path
) -> None:
    from tensorkiln.engine import Engine

    engine = tmp_path / "m.engine"
    rc, _, err = cli("build", mlp, "-o", engine, "--tactic-exclude", "cutlass_fp8_*vd, t_x",
                     "--tactic-timeout", "60", "--backend", "reference")  # fmt: skip
    assert rc == 0, err
    assert Engine.load(engine).build["config"]["tactic_exclude"] == ["cutlass_fp8_*vd", "t_x"]
    rc, _, err = cli("build", mlp, "-o", engine, "--tactic-timeout", "-1")
    assert_one_line_error(rc, err)
    assert "--tactic-timeout" in err and "positive number of seconds" in err


@pytest.mark.gpu
def test_build_inspect_run_on_the_gpu(cli, digits, tmp_path) -> None:
    engine, cache = tmp_path / "d.engine", tmp_path / "d.cache"
    shapes = ["--min-shapes", "input:1x1x8x8", "--opt-shapes", "input:64x1x8x8"]
    shapes += ["--max-shapes", "input:64x1x8x8"]
    rc, out, err = cli("build", digits, "-o", engine, "--fp16", "--timing-cache", cache, *shapes)
    assert rc == 0, err
    assert "backend cuda" in out and "layers compute in fp16" in out
    assert "autotuner:" in out and "measured" in out
    rc, out, err = cli("build", digits, "-o", engine, "--fp16", "--timing-cache", cache, *shapes)
    assert rc == 0 and " 0 measured" in out, out
    rc, out, _ = cli("inspect", engine)
    assert rc == 0 and "tactic (ms, as a CUDA graph)" in out and "runners-up (ms)" in out
    r = cli.json(
        "run",
        engine,
        *FAST,
        "--shapes",
        "input:64x1x8x8",
        "--use-cuda-graph",
        "--device-io",
        "--json",
    )
    assert r["backend"] == "cuda" and r["cuda_graph"] and r["compute_measured_by"] == "cuda events"
    assert r["latency_ms"]["median"] >= r["compute_ms"]["median"] > 0
    # a batch of 64 8x8 images in float16 holds at least the input's cast copy (8 KiB)
    assert r["memory"]["context_device_bytes"] >= 64 * 64 * 2
    x = np.random.default_rng(0).standard_normal((64, 1, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", input=x)
    rc, _, err = cli(
        "run",
        engine,
        *FAST,
        "--load-inputs",
        tmp_path / "in.npz",
        "--save-outputs",
        tmp_path / "out.npz",
    )
    assert rc == 0, err
    got = np.load(tmp_path / "out.npz")
    want = ort_outputs(digits, {"input": x})
    for name, w in want.items():
        assert np.linalg.norm(got[name] - w) / np.linalg.norm(w) < 1e-2


@pytest.mark.gpu
def test_trtexec_and_compare_on_the_gpu(cli, digits, tmp_path) -> None:
    """trtexec's flags build fp32 and fp16 engines and time them as CUDA graphs; compare puts
    the fp32 engine's relative L2 error below 1e-5 and the fp16 one's between 1e-5 and 1e-2."""
    profile = ["--minShapes=input:1x1x8x8", "--optShapes=input:16x1x8x8"]
    profile += ["--maxShapes=input:64x1x8x8", "--shapes=input:16x1x8x8"]
    fast = ["--warmUp=0", "--iterations=5", "--duration=0"]
    engines = {p: tmp_path / f"{p}.engine" for p in ("fp32", "fp16")}
    for precision, engine in engines.items():
        flags = ["--fp16"] if precision == "fp16" else []
        rc, out, err = cli("trtexec", f"--onnx={digits}", f"--saveEngine={engine}", *flags,
                           *profile, *fast, "--useCudaGraph", "--noDataTransfers")  # fmt: skip
        assert rc == 0, err
        assert "backend cuda" in out and f"layers compute in {precision}" in out
        assert "(CUDA graph)" in out
    rc, out, err = cli("trtexec", f"--onnx={digits}", "--int8", "--skipInference")
    assert rc == 0 and "ranges come from random inputs" in err, err
    # on a GPU each quantized layer is also timed in float and the faster kept (TensorRT's
    # choice): the report says how many were quantized and names the ones kept in float
    found = re.search(r"int8: (\d) of 3 convolution/GEMM layers quantized", out)
    assert found, out
    if int(found.group(1)) < 3:
        assert "where the autotuner measured them faster" in out, out
    shapes = ["--shapes", "input:16x1x8x8", "--seed", "0", "--json"]
    r32 = cli.json("compare", digits, "--engine", engines["fp32"], *shapes)
    assert r32["passed"] and r32["outputs"]["logits"]["rel_l2"] < 1e-5
    r16 = cli.json("compare", digits, "--engine", engines["fp16"], *shapes, "--rel-l2", "1e-2")
    rel_l2 = r16["outputs"]["logits"]["rel_l2"]
    assert r16["passed"] and 1e-5 < rel_l2 < 1e-2
    rc, _, _ = cli("compare", digits, "--engine", engines["fp16"], *shapes)  # default: 1e-4
    assert rc == (0 if rel_l2 <= 1e-4 else 1)

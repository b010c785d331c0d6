"""The cpu backend's opt-in compiled path (runtime/cpu_compile.py): a small conv net compiled
by torch.compile against the reference backend and onnxruntime at two batch sizes, the fallback
to the plain loop where compiling fails, and who may ask for it."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from tensorkiln.errors import InputError
from tests.cli.helpers import CLI, assert_one_line_error, mlp_model
from tests.runtime.test_cpu_backend import RTOL, _build, _conv_net, _export

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

SHAPE = (1, 3, 32, 32)


@pytest.fixture(scope="module")
def convnet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("compile")
    return _export(_conv_net(), np.zeros(SHAPE, np.float32), "convnet", folder)


def _assert_matches_oracles(got: np.ndarray, x: np.ndarray, path: Path) -> None:
    ref = _build(path, "reference", SHAPE, 4)
    with ref.create_execution_context() as r:
        want = r.infer({"x": x})["y"]
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (onnxruntime,) = session.run(None, {"x": x})
    assert got.shape == want.shape == onnxruntime.shape and got.dtype == np.float32
    for expected in (want, onnxruntime):
        atol = RTOL * float(np.abs(expected).max())
        np.testing.assert_allclose(got, expected, rtol=RTOL, atol=atol)


@pytest.mark.slow
def test_compiled_conv_net_matches_reference_and_onnxruntime(convnet: Path) -> None:
    engine = _build(convnet, "cpu", SHAPE, 4)
    rng = np.random.default_rng()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback would warn: none may
        with engine.create_execution_context(compile=True) as ctx:
            for batch in (2, 3, 2):  # two shapes compiled, the first run again
                x = rng.standard_normal((batch, *SHAPE[1:])).astype(np.float32)
                _assert_matches_oracles(ctx.infer({"x": x})["y"], x, convnet)
            runs = ctx._compiled
            assert len(runs._ready) == 2 and not runs._failed
        # a second context of the engine runs the same programs: no second compile
        with engine.create_execution_context(compile=True) as again:
            assert again._compiled is runs
            x = rng.standard_normal((3, *SHAPE[1:])).astype(np.float32)
            _assert_matches_oracles(again.infer({"x": x})["y"], x, convnet)


def test_compile_failure_falls_back_to_the_plain_loop(convnet: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("no compiler here")

    monkeypatch.setattr(torch, "compile", broken)
    engine = _build(convnet, "cpu", SHAPE, 4)
    rng = np.random.default_rng()
    with engine.create_execution_context(compile=True) as ctx:
        x = rng.standard_normal((2, *SHAPE[1:])).astype(np.float32)
        with pytest.warns(RuntimeWarning, match="torch.compile failed.*no compiler here"):
            got = ctx.infer({"x": x})["y"]
        _assert_matches_oracles(got, x, convnet)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # once per shape, not per run
            x = rng.standard_normal((2, *SHAPE[1:])).astype(np.float32)
            _assert_matches_oracles(ctx.infer({"x": x})["y"], x, convnet)


@pytest.mark.slow
def test_shapes_past_dynamos_recompile_limit_run_the_plain_loop(convnet: Path, monkeypatch) -> None:
    torch._dynamo.reset()  # (programs of other tests' engines count towards the limit)
    monkeypatch.setattr(torch._dynamo.config, "recompile_limit", 1)
    engine = _build(convnet, "cpu", SHAPE, 4)
    rng = np.random.default_rng()
    with engine.create_execution_context(compile=True) as ctx:
        x = rng.standard_normal((1, *SHAPE[1:])).astype(np.float32)
        _assert_matches_oracles(ctx.infer({"x": x})["y"], x, convnet)
        x = rng.standard_normal((2, *SHAPE[1:])).astype(np.float32)
        with pytest.warns(RuntimeWarning, match="torch.compile failed"):
            got = ctx.infer({"x": x})["y"]
        _assert_matches_oracles(got, x, convnet)
        assert len(ctx._compiled._ready) == len(ctx._compiled._failed) == 1
    torch._dynamo.reset()


def test_compile_is_for_the_cpu_backend_only(convnet: Path, monkeypatch) -> None:
    ref = _build(convnet, "reference", SHAPE, 4)
    with pytest.raises(InputError, match="cpu backend"):
        ref.create_execution_context(compile=True)
    # the environment asks every context: those of other backends run as they do
    monkeypatch.setenv("TENSORKILN_CPU_COMPILE", "1")
    with ref.create_execution_context() as ctx:
        assert ctx._compiled is None
    cpu = _build(convnet, "cpu", SHAPE, 4)
    assert cpu.create_execution_context()._compiled is not None
    assert cpu.create_execution_context(compile=False)._compiled is None
    monkeypatch.delenv("TENSORKILN_CPU_COMPILE")
    assert cpu.create_execution_context()._compiled is None


def test_cli_cpu_compile(capsys, tmp_path: Path) -> None:
    path = mlp_model(tmp_path / "mlp.onnx")
    cli = CLI(capsys)
    rc, _, err = cli("run", path, "--backend", "reference", "--cpu-compile")
    assert_one_line_error(rc, err)
    assert "--cpu-compile needs an engine of the cpu backend" in err
    rc, out, err = cli(  # (compiles the MLP in the warm-up run)
        "run", path, "--backend", "cpu", "--cpu-compile", "--shapes", "x:2x4", "--iterations", "2"
    )
    assert rc == 0 and "torch.compile failed" not in err, err
    assert "ms" in out

"""INT8/FP8 from the command line: the digits CNN calibrated on its training images (a folder of
.npy files, as a user would save them), judged on the held-out test set against the float32
engine, then rebuilt from the calibration cache alone, by `build` and by trtexec's --calib."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tensorkiln.engine import Engine
from tests.cli.helpers import assert_one_line_error

ROOT = Path(__file__).resolve().parents[2]


def _split() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training images (calibration), test images and labels, as examples/train_digits.py
    splits scikit-learn's digits."""
    pytest.importorskip("sklearn")
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    x_train, x_test, _, y_test = train_test_split(
        images, digits.target, test_size=0.25, random_state=0
    )
    return x_train, x_test, y_test


def _top1(engine_path: Path, images: np.ndarray, labels: np.ndarray) -> float:
    engine = Engine.load(engine_path)
    logits = engine.create_execution_context().infer({engine.inputs[0].name: images})
    return float((next(iter(logits.values())).argmax(1) == labels).mean())


@pytest.mark.parametrize(("precision", "calibrator"), [("int8", "entropy"), ("fp8", "minmax")])
def test_calibrated_digits_keep_their_accuracy(cli, digits, tmp_path, precision, calibrator):
    x_train, x_test, y_test = _split()
    calib = tmp_path / "calib"
    calib.mkdir()
    for i, image in enumerate(x_train[:300]):  # one sample per file
        np.save(calib / f"{i:04d}.npy", image)
    cache, fp32, quantized = tmp_path / "calib.json", tmp_path / "fp32.e", tmp_path / "q.e"
    rc, _, err = cli("build", digits, "-o", fp32, "--backend", "reference")
    assert rc == 0, err
    rc, out, err = cli("build", digits, "-o", quantized, "--backend", "reference",
                       f"--{precision}", "--calib-data", calib, "--calib-cache", cache,
                       "--calib-batch", "32")  # fmt: skip
    assert rc == 0, err
    assert f"calibration: 300 samples, {calibrator} calibrator" in out
    assert f"{precision}: 3 of 3 convolution/GEMM layers quantized" in out
    doc = json.loads(cache.read_text())
    assert doc["precision"] == precision and doc["samples"] == 300
    layers = Engine.load(quantized).layers
    assert sum(x["compute_precision"] == precision for x in layers) == 3
    base, got = _top1(fp32, x_test, y_test), _top1(quantized, x_test, y_test)
    assert base > 0.95 and got >= base - 0.01, (base, got)  # within one point of fp32

    again = tmp_path / "again.e"  # the cache alone: no data, same engine
    rc, out, err = cli("build", digits, "-o", again, "--backend", "reference",
                       f"--{precision}", "--calib-cache", cache)  # fmt: skip
    assert rc == 0, err
    assert "from the calibration cache" in out
    ctx_a = Engine.load(quantized).create_execution_context()
    ctx_b = Engine.load(again).create_execution_context()
    name = Engine.load(again).inputs[0].name
    np.testing.assert_array_equal(
        next(iter(ctx_a.infer({name: x_test[:16]}).values())),
        next(iter(ctx_b.infer({name: x_test[:16]}).values())),
    )
    rc, out, err = cli("trtexec", f"--onnx={digits}", f"--{precision}", f"--calib={cache}",
                       "--backend=reference", "--skipInference")  # fmt: skip
    assert rc == 0, err
    assert "from the calibration cache" in out and f"{precision}: 3 of 3" in out


def test_calibration_flag_errors_exit_non_zero(cli, digits, tmp_path):
    rc, _, err = cli("build", digits, "-o", tmp_path / "e", "--backend", "reference", "--int8",
                     "--calib-data", tmp_path / "missing")  # fmt: skip
    assert_one_line_error(rc, err)
    assert "does not exist" in err
    (tmp_path / "bad.json").write_text("{")
    rc, _, err = cli("build", digits, "-o", tmp_path / "e", "--backend", "reference", "--int8",
                     "--calib-cache", tmp_path / "bad.json")  # fmt: skip
    assert_one_line_error(rc, err)
    assert "bad.json" in err
    rc, _, err = cli("build", digits, "-o", tmp_path / "e", "--int8", "--calibrator", "kl")
    assert rc == 2 and "invalid choice: 'kl'" in err


def test_layer_precisions_keep_a_layer_out_of_int8(cli, digits, tmp_path):
    x_train, x_test, y_test = _split()
    np.savez(tmp_path / "calib.npz", input=x_train[:128])
    engine = tmp_path / "e"
    rc, out, err = cli("build", digits, "-o", engine, "--backend", "reference", "--int8",
                       "--calib-data", tmp_path / "calib.npz", "--layer-precisions",
                       "'/6/Gemm':fp32")  # fmt: skip
    assert rc == 0, err
    assert "layers compute in fp32, 2 in int8" in out
    layers = {x["name"]: x["compute_precision"] for x in Engine.load(engine).layers}
    assert layers["/6/Gemm"] == "fp32" and layers["/0/Conv"] == "int8"
    assert _top1(engine, x_test, y_test) > 0.95
    rc, out, err = cli("trtexec", f"--onnx={digits}", "--int8", "--backend=reference",
                       f"--calib={tmp_path / 'none.json'}", "--precisionConstraints=obey",
                       "--layerPrecisions=/0/Conv:fp32,/3/Conv:fp32,/6/Gemm:fp32",
                       "--skipInference")  # fmt: skip
    assert rc == 0, err  # nothing left to quantize: no calibration, no cache needed
    assert "int8: all 3 convolution/GEMM layers are kept at higher precision" in out
    rc, _, err = cli("build", digits, "-o", engine, "--layer-precisions", "conv1")
    assert_one_line_error(rc, err)
    assert "expected LAYER:PRECISION" in err


def test_layerwise_compare_names_the_first_layer_that_breaks(cli, digits, tmp_path):
    """Against a float32 engine, an INT8 engine whose first convolution is kept at fp32 agrees
    exactly up to the second convolution, the first quantized layer, which --layerwise names."""
    x_train, x_test, _ = _split()
    np.savez(tmp_path / "calib.npz", input=x_train[:128])
    np.savez(tmp_path / "inputs.npz", input=x_test[:32])
    engine = tmp_path / "e"
    rc, _, err = cli("build", digits, "-o", engine, "--backend", "reference", "--int8",
                     "--calib-data", tmp_path / "calib.npz",
                     "--layer-precisions", "/0/Conv:fp32")  # fmt: skip
    assert rc == 0, err
    args = ["compare", digits, "--engine", engine, "--load-inputs", tmp_path / "inputs.npz",
            "--layerwise"]  # fmt: skip
    rc, out, err = cli(*args, "--reference", "fp32", "--rel-l2", "1e-6")
    assert rc == 1
    assert "the first is '/4/Relu_output_0' of layer '/3/Conv' (tensorkiln.QConvAct, int8)" in out
    rc, out, err = cli(*args, "--reference", "fp32", "--rel-l2", "1e-6", "--json")
    assert rc == 1 and "FAILED" in err
    result = json.loads(out)
    layers = [(r["layer"], r["passed"]) for r in result["layers"]]
    assert layers[:3] == [("/0/Conv", True), ("/2/MaxPool", True), ("/3/Conv", False)]
    assert result["first_failure"] == "/3/Conv"
    # independently: the first conv's output is onnxruntime's, to float32 rounding
    rc, out, _ = cli(*args, "--rel-l2", "1e-5", "--json")
    r = json.loads(out)
    assert r["layers"][0]["layer"] == "/0/Conv" and r["layers"][0]["passed"]
    assert r["layers"][0]["rel_l2"] < 1e-6
    # on real digits, every layer of the INT8 engine stays within 5% of onnxruntime's
    rc, out, err = cli(*args, "--rel-l2", "5e-2")
    assert rc == 0, out + err
    assert "PASSED: all 5 tensors" in out
    rc, _, err = cli("compare", digits, "--engine", engine, "--reference", "fp32")
    assert_one_line_error(rc, err)
    assert "--reference fp32 and --plot are for --layerwise" in err


def test_debug_precision_finds_layers_whose_pinning_meets_the_tolerance(cli, digits, tmp_path):
    import onnxruntime as ort

    x_train, _, _ = _split()
    np.savez(tmp_path / "calib.npz", input=x_train[:64])
    base = ["debug", "precision", digits, "--int8", "--calib-data", tmp_path / "calib.npz",
            "--calib-batch", "16", "--calibrator", "minmax", "--backend", "reference"]  # fmt: skip
    loose = cli.json(*base, "--rel-l2", "0.5", "--json")
    assert loose["kept"] == [] and len(loose["sensitivity"]) == 3
    tight = loose["all_quantized"] / 2  # half the error of quantizing everything
    result = cli.json(*base, "--rel-l2", str(tight), "--json")
    assert 1 <= len(result["kept"]) <= 3 and result["final"] <= tight
    # the layers it names, pinned in a build, give an engine within the tolerance (onnxruntime)
    engine = tmp_path / "e"
    rc, _, err = cli("build", digits, "-o", engine, "--backend", "reference", "--int8",
                     "--calib-data", tmp_path / "calib.npz", "--calib-batch", "16",
                     "--calibrator", "minmax", "--layer-precisions",
                     result["layer_precisions"])  # fmt: skip
    assert rc == 0, err
    ctx = Engine.load(engine).create_execution_context()
    sess = ort.InferenceSession(str(digits), providers=["CPUExecutionProvider"])
    for i in range(0, 64, 16):
        feed = {"input": x_train[i : i + 16]}
        got = next(iter(ctx.infer(feed).values())).astype(np.float64)
        want = sess.run(None, feed)[0].astype(np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) <= tight * 1.001
    rc, out, _ = cli(*base, "--rel-l2", str(tight))
    assert rc == 0 and "--layer-precisions '" in out
    rc, _, err = cli("debug", "precision", digits, "--int8")
    assert_one_line_error(rc, err)
    assert "--calib-data" in err


def test_plots_are_pngs_inside_the_folder_asked_for(cli, digits, tmp_path):
    pytest.importorskip("matplotlib")
    from tensorkiln.cli.plots import _file_name

    x_train, x_test, _ = _split()
    np.savez(tmp_path / "calib.npz", input=x_train[:64])
    np.savez(tmp_path / "inputs.npz", input=x_test[:16])
    rc, _, err = cli("debug", "precision", digits, "--int8", "--calib-data",
                       tmp_path / "calib.npz", "--backend", "reference", "--plot",
                       tmp_path / "plots")  # fmt: skip
    assert rc == 0, err
    pngs = sorted(p.relative_to(tmp_path / "plots").as_posix()
                  for p in (tmp_path / "plots").rglob("*.png"))  # fmt: skip
    assert pngs == ["histograms/2_MaxPool_output_0.png", "histograms/5_Flatten_output_0.png",
                    "histograms/input.png", "layers.png"]  # fmt: skip
    engine = tmp_path / "e"
    rc, _, err = cli("build", digits, "-o", engine, "--backend", "reference", "--int8",
                     "--calib-data", tmp_path / "calib.npz")  # fmt: skip
    assert rc == 0, err
    rc, _, err = cli("compare", digits, "--engine", engine, "--load-inputs",
                       tmp_path / "inputs.npz", "--layerwise", "--rel-l2", "0.1",
                       "--plot", tmp_path / "layers.png")  # fmt: skip
    assert rc == 0, err
    for png in [tmp_path / "layers.png", *(tmp_path / "plots").rglob("*.png")]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    used: set[str] = set()
    assert _file_name("../../etc/passwd", used) == "etc_passwd.png"
    assert _file_name("../../etc/passwd", used) == "etc_passwd_1.png"
    assert _file_name("/", used) == "tensor.png"


def test_quantize_all_records_that_every_layer_is_quantized(cli, digits, tmp_path):
    """--quantize-all turns off the per-layer choice between the quantized and the float form
    (on by default on a GPU): the engine records it, and every layer is quantized."""
    x_train, _, _ = _split()
    np.savez(tmp_path / "calib.npz", input=x_train[:64])
    engine = tmp_path / "e"
    rc, _, err = cli("build", digits, "-o", engine, "--backend", "reference", "--int8",
                     "--calib-data", tmp_path / "calib.npz", "--quantize-all")  # fmt: skip
    assert rc == 0, err
    loaded = Engine.load(engine)
    assert loaded.build["config"]["choose_precision_per_layer"] is False
    layers = {x["name"]: x["compute_precision"] for x in loaded.layers}
    assert [layers[n] for n in ("/0/Conv", "/3/Conv", "/6/Gemm")] == ["int8"] * 3, layers

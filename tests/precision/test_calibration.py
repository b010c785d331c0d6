"""Calibration data from files and from Python, the collector against onnxruntime's own
intermediate tensors, and calibration caches, including hostile ones."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.errors import BuildError, InputError
from tensorkiln.ir import DType, TensorType, Value
from tensorkiln.precision.calib_data import CalibrationData, batches
from tensorkiln.precision.calibration import CalibrationTable, collect

ort = pytest.importorskip("onnxruntime")


def _input(name: str = "x", shape=("n", 3, 4, 4)) -> Value:
    return Value(name, TensorType(DType.FLOAT, tuple(shape)))


def _feeds(data, inputs) -> list[dict[str, np.ndarray]]:
    return list(batches(data, inputs))


def test_a_folder_of_samples_and_batches_regroups_into_batches(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    arrays = [rng.standard_normal((3, 4, 4)), rng.standard_normal((5, 3, 4, 4)),
              rng.standard_normal((2, 3, 4, 4))]  # fmt: skip
    for i, a in enumerate(arrays):  # one sample, then batches of 5 and 2
        np.save(tmp_path / f"{i:02d}.npy", a.astype(np.float32))
    (tmp_path / "notes.txt").write_text("not data")  # other files are not read
    got = _feeds(CalibrationData(tmp_path, batch_size=3), [_input()])
    assert [f["x"].shape[0] for f in got] == [3, 3, 2]
    want = np.concatenate([arrays[0][None], arrays[1], arrays[2]]).astype(np.float32)
    np.testing.assert_array_equal(np.concatenate([f["x"] for f in got]), want)
    limited = _feeds(CalibrationData(tmp_path, batch_size=3, max_samples=4), [_input()])
    assert [f["x"].shape[0] for f in limited] == [3, 1]
    # an engine whose batch is fixed gets full batches only
    fixed = _feeds(CalibrationData(tmp_path, batch_size=3), [_input(shape=(2, 3, 4, 4))])
    assert [f["x"].shape[0] for f in fixed] == [2, 2, 2, 2]


def test_npz_files_name_each_input(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    ids = rng.integers(0, 100, (6, 7))
    mask = np.ones((6, 7), np.int64)
    np.savez(tmp_path / "all.npz", ids=ids, mask=mask)
    inputs = [Value("ids", TensorType(DType.INT64, ("b", 7))),
              Value("mask", TensorType(DType.INT64, ("b", 7)))]  # fmt: skip
    got = _feeds(CalibrationData(tmp_path / "all.npz", batch_size=4), inputs)
    assert [f["ids"].shape for f in got] == [(4, 7), (2, 7)]
    np.testing.assert_array_equal(np.concatenate([f["ids"] for f in got]), ids)


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda d: None, ["holds no .npy or .npz"]),
        (lambda d: np.save(d / "a.npy", np.zeros((2, 3, 5, 4), np.float32)), ["4 at axis 2"]),
        (lambda d: np.save(d / "a.npy", np.zeros((3, 4), np.float32)), ["rank 4"]),
        (lambda d: np.savez(d / "a.npz", y=np.zeros((1, 3, 4, 4))), ["lacks 'x'", "unknown 'y'"]),
        (lambda d: np.save(d / "a.npy", np.array(["a"], dtype=object), allow_pickle=True),
         ["Python objects"]),
        (lambda d: (d / "a.npy").write_bytes(b"garbage"), ["cannot read"]),
        (lambda d: np.save(d / "a.npy", np.array(["ab"])), ["dtype <U2, not a number"]),
    ],
)  # fmt: skip
def test_bad_calibration_files_are_clear_errors(tmp_path: Path, make, words) -> None:
    make(tmp_path)
    with pytest.raises(InputError) as exc:
        _feeds(CalibrationData(tmp_path), [_input()])
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_a_huge_array_is_refused_from_its_header(tmp_path: Path) -> None:
    from numpy.lib import format as npy

    with open(tmp_path / "a.npy", "wb") as f:  # a header promising 19 GB, and no data
        npy.write_array_header_1_0(f, {"descr": "<f4", "fortran_order": False,
                                       "shape": (100_000_000, 3, 4, 4)})  # fmt: skip
    with pytest.raises(InputError, match="above the limit"):
        _feeds(CalibrationData(tmp_path), [_input()])


def test_a_link_out_of_the_folder_is_refused(tmp_path: Path) -> None:
    outside = tmp_path / "secret.npy"
    np.save(outside, np.zeros((1, 3, 4, 4), np.float32))
    folder = tmp_path / "calib"
    folder.mkdir()
    os.symlink(outside, folder / "a.npy")
    with pytest.raises(InputError, match="leads out of it"):
        _feeds(CalibrationData(folder), [_input()])


def test_python_feeds_are_checked(tmp_path: Path) -> None:
    good = np.zeros((2, 3, 4, 4), np.float32)
    with pytest.raises(InputError, match="batch 1 is a list"):
        _feeds(CalibrationData([{"x": good}, [good]]), [_input()])
    with pytest.raises(InputError, match="fixes it at 4"):
        _feeds(CalibrationData([{"x": good}]), [_input(shape=(4, 3, 4, 4))])
    with pytest.raises(InputError, match="holds no samples"):
        _feeds(CalibrationData([]), [_input()])
    with pytest.raises(InputError, match="not a dict"):
        _feeds(CalibrationData({"x": good}), [_input()])


def _chain() -> onnx.ModelProto:
    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((6, 3, 3, 3)).astype(np.float32), "w")
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], "conv"),
        helper.make_node("Tanh", ["c"], ["t"], "tanh"),
        helper.make_node("Mul", ["t", "c"], ["y"], "mul"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 6, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [w],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_collected_ranges_are_onnxruntimes_intermediate_tensors() -> None:
    from tensorkiln.backends import get_backend
    from tensorkiln.frontends.onnx import import_onnx
    from tensorkiln.runtime.executor import Executor

    model = _chain()
    graph = import_onnx(model)
    values = {v.name: v for v in graph.values()}
    rng = np.random.default_rng()
    feeds = [{"x": (rng.standard_normal((2, 3, 6, 6)) * s).astype(np.float32)} for s in (1, 4)]
    backend = get_backend("reference")
    hists, samples, digest = collect(
        graph, lambda g: Executor(g, backend), [values["x"], values["c"], values["t"]],
        CalibrationData(feeds),
    )  # fmt: skip
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.extend([helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
                                 for n in ("c", "t")])  # fmt: skip
    sess = ort.InferenceSession(exposed.SerializeToString(), providers=["CPUExecutionProvider"])
    runs = [sess.run(["c", "t"], f) for f in feeds]
    assert samples == 4 and digest.startswith("sha256:")
    for k, name in enumerate(("c", "t")):
        want = max(float(np.abs(r[k]).max()) for r in runs)
        assert hists[name].amax == pytest.approx(want, rel=1e-5)
        assert hists[name].total == sum(r[k].size for r in runs)
    assert hists["x"].amax == max(float(np.abs(f["x"]).max()) for f in feeds)


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("not json", ["cannot read"]),
        ("[]", ["not a tensorkiln calibration cache"]),
        ('{"format": "tensorkiln-calibration", "version": 9}', ["version 9", "calibrate again"]),
        ('{"format": "tensorkiln-calibration", "version": 1, "precision": "int8", '
         '"calibrator": "entropy", "tensors": {"x": {"amax": -1}}}', ["'x'", "-1"]),
        ('{"format": "tensorkiln-calibration", "version": 1, "precision": "int8", '
         '"calibrator": "entropy", "tensors": {"x": {"amax": NaN}}}', ["'x'", "nan"]),
        ('{"format": "tensorkiln-calibration", "version": 1, "precision": "int4", '
         '"calibrator": "entropy", "tensors": {}}', ["'int4'"]),
        ('{"format": "tensorkiln-calibration", "version": 1, "precision": "fp8", '
         '"calibrator": "entropy", "tensors": {}}', ["entropy", "fp8"]),
        ('{"format": "tensorkiln-calibration", "version": 1, "precision": "int8", '
         '"calibrator": "entropy"}', ["no 'tensors'"]),
    ],
)  # fmt: skip
def test_malformed_caches_are_clear_errors(tmp_path: Path, text: str, words) -> None:
    path = tmp_path / "c.json"
    path.write_text(text)
    with pytest.raises(InputError) as exc:
        CalibrationTable.load(path)
    msg = str(exc.value)
    assert str(path) in msg and all(w in msg for w in words), msg


def test_cache_round_trip_and_scales(tmp_path: Path) -> None:
    table = CalibrationTable("int8", "percentile", {"a": 2.54, "zeros": 0.0}, 99.9, 64, "sha256:0")
    table.save(tmp_path / "c.json")
    back = CalibrationTable.load(tmp_path / "c.json")
    assert back == table
    assert back.scale("a") == pytest.approx(0.02) and back.scale("zeros") == 1.0
    doc = json.loads((tmp_path / "c.json").read_text())
    assert doc["tensors"]["a"] == {"amax": 2.54, "scale": pytest.approx(0.02)}
    with pytest.raises(BuildError, match="'b' \\(read by fc\\)"):
        back.check_fits({"a": "conv", "b": "fc"}, "the cache")


def test_random_calibration_draws_the_inputs_shapes_and_types() -> None:
    from tensorkiln.precision.calib_data import RandomCalibration

    inputs = [_input("x", ("n", 3, 4, 4)), Value("ids", TensorType(DType.INT64, (2, "s")))]
    feeds = _feeds(CalibrationData(RandomCalibration(batches=3)), inputs)
    assert len(feeds) == 3
    for f in feeds:
        assert f["x"].shape == (1, 3, 4, 4) and f["x"].dtype == np.float32
        assert f["ids"].shape == (2, 1) and f["ids"].dtype == np.int64
        assert f["ids"].min() >= 0 and f["ids"].max() <= 9
    assert np.std(np.concatenate([f["x"].ravel() for f in feeds])) > 0.5  # not all zeros
    with pytest.raises(InputError, match="needs the inputs' shapes"):
        _feeds(CalibrationData(RandomCalibration()), [Value("y", TensorType(DType.FLOAT, None))])

"""benchmarks/corpus.py on a small corpus made at test time: nothing is downloaded.

Two tiny transformers architectures are exported (TorchScript at opset 13, the dynamo exporter
at its default); one of them is also packed into a wheel-like zip (beside a member whose path
climbs out of the folder, and again under a wheel file name that would), collected, and every
model is checked against onnxruntime on the reference backend and on the cuda kernels run on
torch CPU tensors, in fp32 and fp16.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name: str):
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus():
    return _load("corpus")


def _wheel(path: Path, model: Path) -> None:
    """A wheel-like zip: the model, a METADATA with a license, and a member outside the folder."""
    with zipfile.ZipFile(path, "w") as zf:
        zf.write(model, "tinypkg/models/encoder.onnx")
        zf.writestr("../escape.onnx", b"not a model")
        zf.writestr("tinypkg-0.1.0.dist-info/METADATA", "Name: tinypkg\nLicense: MIT\n")


def test_collect_exports_and_check_agree_with_onnxruntime(corpus, tmp_path: Path) -> None:
    export = _load("corpus_export")
    exports = tmp_path / "exports"
    bert = export.export_one("hf-bert", "ts13", exports)
    gpt2 = export.export_one("hf-gpt2", "dynamo", exports)
    assert bert["exporter"] == "torchscript" and gpt2["exporter"] == "dynamo"
    assert bert["dynamic_batch"] and gpt2["dynamic_batch"]

    wheels, models = tmp_path / "wheels", tmp_path / "models"
    wheels.mkdir()
    _wheel(wheels / "tinypkg-0.1.0-py3-none-any.whl", exports / "hf-bert-ts13" / "model.onnx")
    _wheel(wheels / "..-0.1.0-py3-none-any.whl", exports / "hf-bert-ts13" / "model.onnx")
    (record,) = corpus.collect(wheels, models, carry_mib=45)
    data = (exports / "hf-bert-ts13" / "model.onnx").read_bytes()
    assert record["file"] == "tinypkg/tinypkg/models/encoder.onnx"
    assert (record["package"], record["version"], record["license"]) == ("tinypkg", "0.1.0", "MIT")
    assert record["size"] == len(data) and record["carry"]
    assert (models / record["file"]).read_bytes() == data
    assert not (tmp_path / "escape.onnx").exists() and not list(models.rglob("escape.onnx"))
    assert not (tmp_path / "tinypkg").exists()  # the wheel named ".." wrote nothing

    args = argparse.Namespace(
        models_dir=[str(models), str(exports)],
        only="",
        backends="reference,cuda-fp32,cuda-fp16",
        device="cpu",
        jobs=0,
        timeout=300,
        budget=0,
        out=str(tmp_path / "out"),
        name="corpus",
    )
    results = corpus.check_all(args)
    rows = {r["model"]: r for r in results["models"]}
    assert set(rows) == {record["file"], "hf-bert-ts13", "hf-gpt2-dynamo"}
    for name, row in rows.items():
        for backend, res in row["backends"].items():
            assert res["ok"], (name, backend, res)
        assert row["backends"]["reference"]["max_rel"] <= 1e-4
        assert row["backends"]["cuda-fp16"]["rel_l2"] <= 1e-2
    # the collected copy has no inputs.npz: its token ids were drawn within the embedding table
    ids = rows[record["file"]]["inputs"]["input_ids"]
    assert ids == [[1, 16], "int64"]
    saved = json.loads((tmp_path / "out" / "corpus.json").read_text())
    assert len(saved["models"]) == 3
    table = (tmp_path / "out" / "corpus.md").read_text()
    assert "| hf-gpt2-dynamo | transformers | dynamo |" in table
    assert "- cuda-fp16: 3 of 3 pass (0 not run)" in table


def test_token_ids_stay_inside_the_embedding_table(corpus, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    rng = np.random.default_rng(0)
    table = rng.standard_normal((7, 4)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "ids"], ["y"])],
        "g",
        [helper.make_tensor_value_info("ids", TensorProto.INT64, ["batch", "seq"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(table, "table")],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    feeds = corpus.sample_inputs(path, "m.onnx", {})
    assert feeds["ids"].shape == (1, 32)
    assert feeds["ids"].min() >= 0 and feeds["ids"].max() < 7
    assert len(np.unique(feeds["ids"])) > 1


def _conv_sigmoid(tmp_path: Path, rng: np.random.Generator) -> tuple[Path, np.ndarray, dict]:
    """A 1x1 Conv (no double kernel in onnxruntime) then a Sigmoid whose logits lie deep in the
    tail, where onnxruntime's float32 Sigmoid is an approximation; returns the path, the weights
    and a feed."""
    import onnx
    from onnx import TensorProto, helper

    w = rng.uniform(0.5, 1.0, (2, 3, 1, 1)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["z"]), helper.make_node("Sigmoid", ["z"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 4, 5])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "conv_sigmoid.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    x = rng.uniform(-12, -6, (1, 3, 4, 5)).astype(np.float32)  # logits about -36 to -9
    return path, w, {"x": x}


def test_float64_arbiter_finds_the_inaccurate_side(corpus, tmp_path: Path) -> None:
    import onnx

    from tests.models.test_architectures import run_onnxruntime

    rng = np.random.default_rng()
    path, w, feeds = _conv_sigmoid(tmp_path, rng)
    logits = np.einsum("oi,bihw->bohw", w[:, :, 0, 0].astype(np.float64), feeds["x"])
    exact = 1 / (1 + np.exp(-logits))  # numpy in float64: the independent oracle
    outs, name = corpus.run_float64(onnx.load(str(path)), feeds)
    assert name == "onnxruntime float64 (Conv in float32)"
    assert np.abs(outs[0] - exact).max() / exact.max() < 1e-5  # the Conv's float32 rounding
    ort32 = run_onnxruntime(path, feeds)
    arbiter = corpus.Arbiter(path, feeds, {"y": ort32[0]})
    if corpus.max_rel_diff(ort32, [exact]) > 1e-4:  # onnxruntime's tail approximation
        verdict = arbiter.judge([exact.astype(np.float32)], fp16=False)
        assert verdict["ok"] and verdict["vs_f64"] < 1e-5 < verdict["ort_vs_f64"]
    # worse than both: onnxruntime's tail can be 100% off (it may flush these tiny values to 0),
    # so the wrong answer is off by 3x to 5x
    wrong = (exact * rng.uniform(4, 6, exact.shape)).astype(np.float32)
    verdict = arbiter.judge([wrong], fp16=False)
    assert not verdict["ok"] and verdict["vs_f64"] > verdict["ort_vs_f64"], verdict


def test_noise_floor_measures_how_far_a_quantized_model_jumps(corpus, tmp_path: Path) -> None:
    """A model that rounds to a uint8 grid moves by grid steps when its input is rounded to
    float16; a smooth one by float16's rounding only."""
    import onnx
    from onnx import TensorProto, helper

    from tests.models.test_architectures import run_onnxruntime

    def save(nodes, name: str) -> Path:
        graph = helper.make_graph(
            nodes,
            "g",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 64])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        )
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
        return path

    quantized = save(
        [
            helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"]),
            helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        ],
        "quantized",
    )
    smooth = save([helper.make_node("Relu", ["x"], ["y"])], "smooth")
    feeds = {"x": np.random.default_rng().standard_normal((64, 64)).astype(np.float32)}
    floors = {}
    for path in (quantized, smooth):
        want = run_onnxruntime(path, feeds)
        floors[path.stem] = corpus.noise_floor(
            lambda f, p=path: run_onnxruntime(p, f), feeds, want, corpus.max_rel_diff, fp16=True
        )
    scale = float(np.ptp(np.append(feeds["x"], 0))) / 255
    assert floors["quantized"] >= 0.9 * scale / np.abs(feeds["x"]).max()  # a whole grid step
    assert floors["smooth"] <= 2.0**-11  # float16's rounding of the input, no more


def test_ocr_detector_gets_a_document_page(corpus, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, "h", "w"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    path = tmp_path / "ch_PP-OCRv4_det_infer.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    x = corpus.sample_inputs(path, path.name, {})["x"]
    assert x.shape == (1, 3, 96, 128) and x.dtype == np.float32
    page = (
        x[0] * np.array([0.229, 0.224, 0.225])[:, None, None]
        + np.array([0.485, 0.456, 0.406])[:, None, None]
    )  # PaddleOCR's normalization undone: the 0..1 image
    assert page.min() >= 0 and page.max() <= 1
    assert np.mean(page > 0.8) > 0.7  # mostly light paper
    assert 0.01 < np.mean(page < 0.3) < 0.3  # with dark strokes
    other = corpus.sample_inputs(path, "ch_PP-OCRv4_rec_infer.onnx", {})["x"]  # not a detector
    assert np.mean(other > 1.5) < 0.2  # random, not a page


def test_fp16_floor_is_what_float16_storage_costs(corpus, tmp_path: Path) -> None:
    """A sigmoid of a cancelling difference (1000 * (x1 - x2), x near 1.5): rounding x to
    float16 moves the logits by up to 1, so any fp16 engine is far from float64. The floor matches numpy's
    float16-storage emulation of the graph, an engine at it passes, a worse one fails."""
    import onnx
    from onnx import TensorProto, helper

    from tests.models.test_architectures import run_onnxruntime

    rng = np.random.default_rng()
    w = np.array([[1000.0, -1000.0, 0.0]], np.float32).reshape(1, 3, 1, 1)
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["z"]), helper.make_node("Sigmoid", ["z"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 32, 32])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    path = tmp_path / "cancel.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    # 1024 pixels: the floor's spread is small enough that it never nears the 0.03 below
    # (64 pixels put it under 0.03 in one draw of 40; 1024 gave 0.043 at the least in 5,000)
    x1 = rng.uniform(1.0, 2.0, (1, 1, 32, 32))
    x = np.concatenate([x1, x1 + rng.uniform(-0.01, 0.01, x1.shape), x1], 1).astype(np.float32)
    feeds = {"x": x}
    logits = 1000.0 * (x[:, :1].astype(np.float64) - x[:, 1:2])
    exact = 1 / (1 + np.exp(-logits))  # the independent float64 oracle
    x16 = x.astype(np.float16).astype(np.float32)
    emulated = 1 / (1 + np.exp(-(1000.0 * (x16[:, :1] - x16[:, 1:2]))))
    emulated = emulated.astype(np.float16).astype(np.float64)
    expected_floor = corpus._norm_rel([emulated], [exact])
    assert expected_floor > 0.03  # (far beyond the 1e-2 bound)
    outs, _ = corpus.run_float64(onnx.load(str(path)), feeds)
    floor = corpus.fp16_floor(onnx.load(str(path)), feeds, outs, corpus._norm_rel)
    assert abs(floor - expected_floor) <= 0.02 * expected_floor, (floor, expected_floor)
    arbiter = corpus.Arbiter(path, feeds, {"y": run_onnxruntime(path, feeds)[0]})
    verdict = arbiter.judge([emulated.astype(np.float32)], fp16=True)
    assert verdict["ok"] and verdict["fp16_floor"] == pytest.approx(floor)
    worse = np.clip(emulated + rng.uniform(0.2, 0.4, emulated.shape), 0, 1).astype(np.float32)
    verdict = arbiter.judge([worse], fp16=True)
    assert not verdict["ok"] and verdict["vs_f64"] > verdict["fp16_floor"]

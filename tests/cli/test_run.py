"""`tensorkiln run`: outputs match onnxruntime, shapes within profiles, statistics and profiles."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from tests.cli.helpers import FAST, assert_one_line_error, ort_outputs, two_io_model

STAT_KEYS = {"min", "mean", "median", "max"}


# the profile table's columns, split at whitespace
PROFILE_HEADER = ["layer", "op", "avg", "ms", "%", "GFLOP", "MB", "TFLOP/s", "GB/s", "bound", "%",
                  "roofline"]  # fmt: skip


def _profile_table(out: str) -> tuple[list[str], dict[str, list[str]]]:
    """The profile table's header and its rows by layer name (the lines up to the summary)."""
    lines = out[out.index("per-layer profile") :].splitlines()
    assert lines[1].startswith(("roofline:", "no roofline")), lines[:3]
    body = []
    for line in lines[3:]:
        if line.startswith("total:") or not line.strip():
            break
        body.append(line.split())
    return lines[2].split(), {r[0]: r for r in body}


@pytest.fixture
def dynamic_engine(cli, mlp, tmp_path):
    engine = tmp_path / "dyn.engine"
    rc, _, err = cli(
        "build",
        mlp,
        "-o",
        engine,
        "--min-shapes",
        "x:1x4",
        "--opt-shapes",
        "x:4x4",
        "--max-shapes",
        "x:8x4",
        "--opt-level",
        "0",  # keep the model's own layers, which the profile assertions name
        "--backend",
        "reference",
    )
    assert rc == 0, err
    return engine


def test_engine_outputs_match_onnxruntime(cli, mlp, tmp_path):
    engine = tmp_path / "mlp.engine"
    assert cli("build", mlp, "-o", engine)[0] == 0
    x = np.random.default_rng().standard_normal((6, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    rc, out, err = cli(
        "run",
        engine,
        *FAST,
        "--load-inputs",
        tmp_path / "in.npz",
        "--save-outputs",
        tmp_path / "out.npz",
    )
    assert rc == 0, err
    assert "output y: float32 [6, 3]" in out and "throughput:" in out and "qps" in out
    for row in ("latency", "compute", "host"):
        assert any(line.startswith(row) for line in out.splitlines()), out
    got = np.load(tmp_path / "out.npz")["y"]
    np.testing.assert_allclose(got, ort_outputs(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-5)


def test_digits_engine_matches_onnxruntime(cli, digits, tmp_path):
    engine = tmp_path / "digits.engine"
    assert cli("build", digits, "-o", engine, "--min-shapes", "input:1x1x8x8",
               "--opt-shapes", "input:4x1x8x8", "--max-shapes", "input:16x1x8x8")[0] == 0  # fmt: skip
    x = np.random.default_rng().standard_normal((5, 1, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "in.npz", input=x)
    rc, _, err = cli("run", engine, *FAST, "--load-inputs", tmp_path / "in.npz",
                     "--save-outputs", tmp_path / "out.npz")  # fmt: skip
    assert rc == 0, err
    want = ort_outputs(digits, {"input": x})["logits"]
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["logits"], want, rtol=1e-4, atol=1e-4)


def test_dynamic_batch_inside_the_profile_runs_and_outside_fails(
    cli, mlp, dynamic_engine, tmp_path
):
    rng = np.random.default_rng()
    for batch in (2, 7):
        x = rng.standard_normal((batch, 4)).astype(np.float32)
        np.savez(tmp_path / "in.npz", x=x)
        rc, out, err = cli("run", dynamic_engine, *FAST, "--load-inputs", tmp_path / "in.npz",
                           "--save-outputs", tmp_path / "out.npz")  # fmt: skip
        assert rc == 0, err
        assert f"output y: float32 [{batch}, 3]" in out
        got = np.load(tmp_path / "out.npz")["y"]
        np.testing.assert_allclose(got, ort_outputs(mlp, {"x": x})["y"], rtol=1e-5, atol=1e-5)
    rc, _, err = cli("run", dynamic_engine, *FAST, "--shapes", "x:9x4")
    assert_one_line_error(rc, err)
    assert "outside optimization profile" in err and "max [8, 4]" in err


def test_random_inputs_default_to_the_profile_opt_shape(cli, dynamic_engine):
    r = cli.json("run", dynamic_engine, *FAST, "--json")
    assert r["inputs"]["x"] == {"dtype": "float32", "shape": [4, 4]}
    assert r["outputs"]["y"]["shape"] == [4, 3]
    r = cli.json("run", dynamic_engine, *FAST, "--json", "--shapes", "x:3x4")
    assert r["inputs"]["x"]["shape"] == [3, 4]


def test_json_has_the_statistics(cli, dynamic_engine):
    r = cli.json(
        "run",
        dynamic_engine,
        "--warmup",
        "0.01",
        "--iterations",
        "5",
        "--percentile",
        "90,99",
        "--json",
    )
    assert r["iterations"] >= 5 and r["warmup_runs"] >= 1
    assert r["throughput_qps"] > 0 and r["wall_s"] > 0
    for key in ("latency_ms", "compute_ms", "host_ms"):
        assert set(r[key]) == STAT_KEYS | {"p90", "p99"}
        s = r[key]
        assert 0 <= s["min"] <= s["median"] <= s["p90"] <= s["p99"] <= s["max"]
    assert r["compute_ms"]["min"] <= r["latency_ms"]["max"]
    assert r["backend"] == "reference" and r["built_in_memory"] is False


def test_memory_is_reported(cli, mlp, dynamic_engine):
    r = cli.json("run", dynamic_engine, *FAST, "--json")
    weights = sum(numpy_helper.to_array(t).nbytes for t in onnx.load(mlp).graph.initializer)
    m = r["memory"]
    assert m["weights_bytes"] == weights
    # the largest batch (8) through Relu and MatMul: at least h2 [8, 8] and y [8, 3] of float32
    assert m["planned_activation_bytes"] >= (8 * 8 + 8 * 3) * 4
    assert m["context_device_bytes"] is None  # (reported for cuda engines on a GPU)
    rc, out, _ = cli("run", dynamic_engine, *FAST)
    assert rc == 0 and f"memory: weights {weights / 1024:.1f} KiB, activations planned" in out


def test_duration_is_a_minimum(cli, dynamic_engine):
    r = cli.json("run", dynamic_engine, "--warmup", "0", "--duration", "0.2", "--json")
    assert r["wall_s"] >= 0.2 and r["iterations"] >= 1


def test_dump_profile_lists_every_layer(cli, dynamic_engine):
    rc, out, err = cli("run", dynamic_engine, *FAST, "--dump-profile")
    assert rc == 0, err
    header, rows = _profile_table(out)
    assert header == PROFILE_HEADER
    assert set(rows) == {"fc1", "bias1", "act1", "fc2"}
    assert rows["fc1"][1] == "MatMul" and rows["act1"][1] == "Relu"
    assert abs(sum(float(r[3]) for r in rows.values()) - 100) < 0.5
    r = cli.json("run", dynamic_engine, *FAST, "--dump-profile", "--json")
    times = [p["total_ms"] for p in r["profile"]["layers"]]
    assert times == sorted(times, reverse=True) and len(times) == 4


def test_export_times_writes_each_iteration(cli, dynamic_engine, tmp_path):
    path = tmp_path / "times.json"
    r = cli.json("run", dynamic_engine, *FAST, "--export-times", path, "--json")
    times = json.loads(path.read_text())
    assert len(times) == r["iterations"]
    for t in times:
        assert set(t) == {"start_ms", "latency_ms", "compute_ms", "enqueue_ms", "host_ms"}
        assert t["latency_ms"] >= t["compute_ms"] >= 0
        assert t["latency_ms"] >= t["enqueue_ms"] >= 0
    assert [t["start_ms"] for t in times] == sorted(t["start_ms"] for t in times)


def test_onnx_model_is_built_in_memory(cli, mlp):
    rc, out, err = cli("run", mlp, *FAST, "--shapes", "x:3x4")
    assert rc == 0, err
    assert out.startswith("built mlp.onnx in memory") and "output y: float32 [3, 3]" in out
    rc, out, err = cli("run", mlp, *FAST, "--json")
    assert rc == 0 and "built mlp.onnx in memory" in err
    assert json.loads(out)["built_in_memory"] is True


def test_random_integer_inputs_and_scalar_outputs(cli, tmp_path):
    model = two_io_model(tmp_path / "two.onnx")
    r = cli.json("run", model, *FAST, "--shapes", "a:2x3,k:2", "--seed", "3", "--json",
                 "--save-outputs", tmp_path / "out.npz")  # fmt: skip
    assert r["inputs"]["k"] == {"dtype": "int64", "shape": [2]}
    assert r["outputs"]["total"]["shape"] == []
    out = np.load(tmp_path / "out.npz")
    np.testing.assert_allclose(out["total"], out["out"].sum(), rtol=1e-5)
    rc, _, err = cli("run", model, *FAST, "--shapes", "a:2x3,k:3")
    assert_one_line_error(rc, err)


def _foreign_engine(cli, mlp, path, version):
    """An intact engine of another format version: the header says so, the rest is unchanged."""
    from tensorkiln.engine import format as fmt

    assert cli("build", mlp, "-o", path)[0] == 0
    data = bytearray(path.read_bytes())
    data[8:12] = version.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert version != fmt.FORMAT_VERSION
    return path


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (b"", "it is empty"),
        (b"TKENG", "a truncated tensorkiln engine"),
        (b"name,value\n1,2\n", "a text file (it starts with 'name,value')"),
        (b'{"format": "x"}\n', "a JSON file"),
        (b"PK\x03\x04" + bytes(40), "a zip archive"),
        (b"\x1f\x8b\x08\x00" + bytes(40), "gzip"),
        (b"\x80\x04\x95" + bytes(40), "a Python pickle"),
        (b"\x93NUMPY\x01\x00" + bytes(40), "a numpy .npy array"),
        (bytes(range(1, 64)) * 4, "not a valid ONNX model"),  # binary, no known magic
    ],
)
def test_a_file_that_is_no_model_is_named_by_its_content(cli, tmp_path, content, named):
    for name in ("x.engine", "x.onnx"):  # the name decides nothing
        path = tmp_path / name
        path.write_bytes(content)
        rc, _, err = cli("run", path, *FAST)
        assert_one_line_error(rc, err)
        assert "is neither a tensorkiln engine nor an ONNX model" in err or (
            "is not a tensorkiln engine" in err
        ), err
        assert named in err, err


def test_engine_and_onnx_are_told_apart_by_content_not_name(cli, mlp, tmp_path):
    engine = tmp_path / "model.onnx"  # an engine with an ONNX name
    assert cli("build", mlp, "-o", engine)[0] == 0
    onnx_named_engine = tmp_path / "model.engine"  # and an ONNX model named like an engine
    onnx_named_engine.write_bytes(mlp.read_bytes())
    x = np.random.default_rng().standard_normal((2, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    want = ort_outputs(mlp, {"x": x})["y"]
    for path in (engine, onnx_named_engine):
        rc, _, err = cli("run", path, *FAST, "--load-inputs", tmp_path / "in.npz",
                         "--save-outputs", tmp_path / "out.npz")  # fmt: skip
        assert rc == 0, err
        np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"], want, rtol=1e-5, atol=1e-5)


def test_an_engine_of_another_format_version_says_so(cli, mlp, tmp_path):
    path = _foreign_engine(cli, mlp, tmp_path / "old.engine", 99)
    rc, _, err = cli("run", path, *FAST)
    assert_one_line_error(rc, err)
    assert "engine format version 99" in err and "Rebuild" in err


def test_huge_random_input_is_refused_before_allocating(cli, tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "huge",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [60000, 80000])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [60000, 80000])],
    )
    model = tmp_path / "huge.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    rc, _, err = cli("run", model, *FAST)
    assert_one_line_error(rc, err)
    want = 60000 * 80000 * 4
    assert "random FLOAT input 'x' of shape [60000, 80000]" in err and f"{want:,} bytes" in err, err
    assert "--max-input-bytes 18G" in err


def test_max_input_bytes_moves_the_limit(cli, mlp):
    rc, _, err = cli("run", mlp, *FAST, "--shapes", "x:65x4", "--max-input-bytes", "1K")
    assert_one_line_error(rc, err)
    assert "needs 1,040 bytes" in err and "limit of 1,024" in err
    rc, _, err = cli("run", mlp, *FAST, "--shapes", "x:64x4", "--max-input-bytes", "1K")
    assert rc == 0, err  # 64 x 4 float32 is exactly 1 KiB: at the limit, not above it


def test_load_inputs_checks_each_array_size_before_reading_it(cli, mlp, tmp_path):
    import zipfile

    # an .npz whose header promises a 40 GB array: refused from the header, nothing allocated
    bomb = tmp_path / "bomb.npz"
    header = np.lib.format.header_data_from_array_1_0(np.zeros((1, 4), np.float32))
    header["shape"] = (100000, 100000)
    with zipfile.ZipFile(bomb, "w") as z, z.open("x.npy", "w") as f:
        np.lib.format.write_array_header_1_0(f, header)
    rc, _, err = cli("run", mlp, *FAST, "--load-inputs", bomb)
    assert_one_line_error(rc, err)
    assert "input 'x'" in err and "[100000, 100000]" in err and "40,000,000,000 bytes" in err

    x = np.random.default_rng().standard_normal((65, 4)).astype(np.float32)  # 1,040 bytes
    np.savez_compressed(tmp_path / "in.npz", x=x)
    rc, _, err = cli("run", mlp, *FAST, "--load-inputs", tmp_path / "in.npz",
                     "--max-input-bytes", "1K")  # fmt: skip
    assert_one_line_error(rc, err)
    assert "needs 1,040 bytes" in err
    rc, _, err = cli("run", mlp, *FAST, "--load-inputs", tmp_path / "in.npz",
                     "--save-outputs", tmp_path / "out.npz")  # fmt: skip
    assert rc == 0, err
    want = ort_outputs(mlp, {"x": x})["y"]
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["y"], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("content", [b"", b"hello\n", np.lib.format.MAGIC_PREFIX + bytes(20)])
def test_load_inputs_that_are_not_an_npz_say_so(cli, mlp, tmp_path, content):
    path = tmp_path / "in.npz"
    path.write_bytes(content)
    rc, _, err = cli("run", mlp, *FAST, "--load-inputs", path)
    assert_one_line_error(rc, err)
    assert "is not an .npz file of named arrays" in err

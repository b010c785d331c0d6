"""External data from hostile model folders, and external data shared between tensors.

Every attack here is refused with a ModelLoadError naming the tensor; nothing outside the model's
folder is read, and no engine embeds it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.errors import ModelLoadError

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="symbolic links and /dev")


def _model(w: np.ndarray, *, location: str = "weights.bin", offset: int = 0) -> onnx.ModelProto:
    """y = x @ w with w in external data at ``location``."""
    tensor = numpy_helper.from_array(w, "w")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in [("location", location), ("offset", offset), ("length", w.nbytes)]:
        entry = tensor.external_data.add()
        entry.key, entry.value = key, str(value)
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", w.shape[0]])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", w.shape[1]])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])], "ext", [x], [y], initializer=[tensor]
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _save(folder: Path, model: onnx.ModelProto) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def _w() -> np.ndarray:
    return np.random.default_rng().standard_normal((4, 2)).astype(np.float32)


def test_data_in_the_folder_matches_onnxruntime(tmp_path):
    w = _w()
    path = _save(tmp_path / "m", _model(w, offset=8))
    (tmp_path / "m" / "weights.bin").write_bytes(b"\x00" * 8 + w.tobytes())
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(tensorkiln.run_onnx(path, {"x": x})["y"], want, rtol=1e-6, atol=1e-5)


def test_link_inside_the_folder_is_fine(tmp_path):
    w = _w()
    (tmp_path / "m" / "data").mkdir(parents=True)
    (tmp_path / "m" / "data" / "real.bin").write_bytes(w.tobytes())
    os.symlink("data/real.bin", tmp_path / "m" / "weights.bin")
    path = _save(tmp_path / "m", _model(w))
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(
        tensorkiln.run_onnx(path, {"x": x})["y"], x @ w, rtol=1e-6, atol=1e-5
    )


def _secret(tmp_path: Path) -> Path:
    """A file outside the model's folder, of the size the tensor wants (like /etc/passwd)."""
    secret = tmp_path / "outside" / "secret.bin"
    secret.parent.mkdir()
    secret.write_bytes(_w().tobytes())
    return secret


def test_symlinked_file_outside_is_refused(tmp_path):
    secret = _secret(tmp_path)
    path = _save(tmp_path / "m", _model(_w()))
    os.symlink(secret, tmp_path / "m" / "weights.bin")
    with pytest.raises(ModelLoadError, match=r"'w'.*outside the model's folder"):
        tensorkiln.import_onnx(path)
    session_refuses = pytest.raises(Exception, match=r"escapes|outside")
    with session_refuses:  # onnxruntime refuses it too
        ort.InferenceSession(str(path))


def test_symlinked_folder_outside_is_refused(tmp_path):
    secret = _secret(tmp_path)
    path = _save(tmp_path / "m", _model(_w(), location="linked/secret.bin"))
    os.symlink(secret.parent, tmp_path / "m" / "linked")
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        tensorkiln.import_onnx(path)


def test_link_outside_is_never_embedded_in_an_engine(tmp_path):
    secret = _secret(tmp_path)
    path = _save(tmp_path / "m", _model(_w()))
    os.symlink(secret, tmp_path / "m" / "weights.bin")
    config = BuilderConfig()
    config.embed_source = True
    with pytest.raises(ModelLoadError, match="outside"):
        Builder().build(path, config, progress=False)


@pytest.mark.parametrize("location", ["/etc/passwd", "../outside/secret.bin", "a/../../x.bin"])
def test_absolute_and_parent_paths_are_refused(tmp_path, location):
    _secret(tmp_path)
    path = _save(tmp_path / "m", _model(_w(), location=location))
    with pytest.raises(ModelLoadError, match="outside the model's folder"):
        tensorkiln.import_onnx(path)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_device_file_through_a_link_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "dev").mkdir()
    os.symlink("/dev/zero", tmp_path / "m" / "dev" / "zero")
    path = _save(tmp_path / "m", _model(_w(), location="dev/zero"))
    with pytest.raises(ModelLoadError, match=r"outside|regular file"):
        tensorkiln.import_onnx(path)


def test_pipe_in_the_folder_is_refused_without_blocking(tmp_path):
    (tmp_path / "m").mkdir()
    os.mkfifo(tmp_path / "m" / "weights.bin")
    path = _save(tmp_path / "m", _model(_w()))
    with pytest.raises(ModelLoadError, match="not a regular file"):
        tensorkiln.import_onnx(path)


def test_folder_as_data_file_is_refused(tmp_path):
    (tmp_path / "m" / "weights.bin").mkdir(parents=True)
    path = _save(tmp_path / "m", _model(_w()))
    with pytest.raises(ModelLoadError, match="not a regular file"):
        tensorkiln.import_onnx(path)


@pytest.mark.parametrize(
    ("offset", "length", "match"),
    [
        (64, None, "truncated"),
        (2**62, None, "truncated"),
        (0, 4, "need 32"),
        (-8, None, "negative"),
    ],
)
def test_bad_ranges_are_refused(tmp_path, offset, length, match):
    w = _w()
    model = _model(w, offset=offset)
    if length is not None:
        entry = next(e for e in model.graph.initializer[0].external_data if e.key == "length")
        entry.value = str(length)
    path = _save(tmp_path / "m", model)
    (tmp_path / "m" / "weights.bin").write_bytes(w.tobytes())
    with pytest.raises(ModelLoadError, match=match):
        tensorkiln.import_onnx(path)


def _shared_model(folder: Path, n: int, shape: tuple[int, int]) -> tuple[Path, np.ndarray]:
    """``n`` initializers naming the same bytes of one file, summed into the output."""
    w = np.random.default_rng().standard_normal(shape).astype(np.float32)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "shared.bin").write_bytes(w.tobytes())
    inits, nodes, prev = [], [], "x"
    for i in range(n):
        t = _model(w, location="shared.bin").graph.initializer[0]
        t.name = f"w{i}"
        inits.append(t)
        nodes.append(helper.make_node("Add", [prev, f"w{i}"], [f"s{i}"]))
        prev = f"s{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))
    graph = helper.make_graph(nodes, "shared", [x], [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return _save(folder, model), w


def test_tensors_naming_the_same_bytes_share_one_array(tmp_path):
    path, _ = _shared_model(tmp_path / "m", 8, (16, 8))
    graph = tensorkiln.import_onnx(path)
    consts = [v.const for v in graph.initializers]
    assert len(consts) == 8 and all(c is consts[0] for c in consts)
    assert not consts[0].flags.writeable  # a read-only view of the mapped file
    x = np.random.default_rng().standard_normal((16, 8)).astype(np.float32)
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    np.testing.assert_allclose(tensorkiln.run_onnx(graph, {"x": x})["y"], want, rtol=1e-5)


def test_shared_external_data_is_mapped_once(tmp_path):
    """32 tensors naming one 16 MiB file: importing maps 16 MiB, not 32 copies of it."""
    path, _ = _shared_model(tmp_path / "m", 32, (1024, 4096))
    script = textwrap.dedent(
        f"""
        import resource, tensorkiln
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        graph = tensorkiln.import_onnx({str(path)!r})
        grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        print(len(graph.initializers), grown // 1024)
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True
    )
    count, grown_mib = map(int, out.stdout.split())
    assert count == 32
    assert grown_mib < 100, f"import grew RSS by {grown_mib} MiB for 16 MiB of shared data"


def test_too_much_data_to_embed_is_a_clear_error(tmp_path, monkeypatch):
    """Pulling external data into one protobuf is bounded (protobuf holds 2 GiB; lowered here)."""
    import tensorkiln.frontends.onnx.loader as loader

    path, _ = _shared_model(tmp_path / "m", 4, (64, 64))
    monkeypatch.setattr(loader, "_PROTOBUF_LIMIT", 3 * 64 * 64 * 4)
    with pytest.raises(ModelLoadError, match="more than one ONNX protobuf can hold"):
        loader.load_model_proto(path)
    graph = tensorkiln.import_onnx(path)  # importing maps the data instead
    assert len(graph.initializers) == 4


def test_engine_stores_shared_external_data_once(tmp_path):
    """8 initializers naming one 4 MiB array: the engine holds it once, and computes the same."""
    path, w = _shared_model(tmp_path / "m", 8, (1024, 1025))
    engine = Builder().build(path, progress=False)
    engine.save(tmp_path / "m.engine")
    assert (tmp_path / "m.engine").stat().st_size < 2 * w.nbytes
    x = np.random.default_rng().standard_normal(w.shape).astype(np.float32)
    want = ort.InferenceSession(str(path)).run(None, {"x": x})[0]
    got = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_cli_refuses_a_link_outside_in_one_line(tmp_path, capsys):
    from tests.cli.helpers import CLI, assert_one_line_error

    secret = _secret(tmp_path)
    path = _save(tmp_path / "m", _model(_w()))
    os.symlink(secret, tmp_path / "m" / "weights.bin")
    cli = CLI(capsys)
    for args in [("run", path), ("build", path, "-o", tmp_path / "m.engine", "--embed-source")]:
        rc, _, err = cli(*args)
        assert_one_line_error(rc, err)
        assert "outside the model's folder" in err
    assert not (tmp_path / "m.engine").exists()


def test_cli_runs_a_model_with_external_data_like_onnxruntime(tmp_path, capsys):
    from tests.cli.helpers import CLI, ort_outputs

    w = _w()
    path = _save(tmp_path / "m", _model(w))
    (tmp_path / "m" / "weights.bin").write_bytes(w.tobytes())
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    rc, _, err = CLI(capsys)(
        "run", path, "--load-inputs", tmp_path / "in.npz", "--save-outputs", tmp_path / "out.npz"
    )
    assert rc == 0, err
    got = np.load(tmp_path / "out.npz")["y"]
    np.testing.assert_allclose(got, ort_outputs(path, {"x": x})["y"], rtol=1e-6, atol=1e-5)


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_model_file_linked_to_a_device_is_refused(tmp_path):
    (tmp_path / "m").mkdir()
    os.symlink("/dev/zero", tmp_path / "m" / "model.onnx")
    with pytest.raises(ModelLoadError, match="not a regular file"):
        tensorkiln.import_onnx(tmp_path / "m" / "model.onnx")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts open descriptors")
def test_one_file_per_tensor_holds_no_descriptors(tmp_path):
    """onnx.save(all_tensors_to_one_file=False) writes a file per tensor; importing 200 of them
    keeps no file open (small files are read, not mapped), and runs like onnxruntime."""
    rng = np.random.default_rng()
    inits, nodes, prev = [], [], "x"
    for i in range(200):
        inits.append(numpy_helper.from_array(rng.standard_normal(8).astype(np.float32), f"b{i}"))
        nodes.append(helper.make_node("Add", [prev, f"b{i}"], [f"s{i}"]))
        prev = f"s{i}"
    nodes.append(helper.make_node("Identity", [prev], ["y"]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])
    graph = helper.make_graph(nodes, "many", [x], [y], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    (tmp_path / "m").mkdir()
    path = tmp_path / "m" / "model.onnx"
    onnx.save(model, path, save_as_external_data=True, all_tensors_to_one_file=False,
              size_threshold=0)  # fmt: skip
    assert len(list((tmp_path / "m").iterdir())) == 201
    before = len(os.listdir("/proc/self/fd"))
    graph_ir = tensorkiln.import_onnx(path)
    assert len(os.listdir("/proc/self/fd")) <= before
    xv = rng.standard_normal((2, 8)).astype(np.float32)
    want = ort.InferenceSession(str(path)).run(None, {"x": xv})[0]
    np.testing.assert_allclose(tensorkiln.run_onnx(graph_ir, {"x": xv})["y"], want, rtol=1e-5)

"""Build -> save -> load -> run is bit-identical to the built engine and to run_onnx, on the CPU.

onnxruntime is the independent oracle: it must agree within a tolerance (it sums in other orders).
Inputs are drawn fresh on every run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tests.engine import models as M

SMALL = {
    "mlp": M.mlp,
    "cnn": M.cnn,
    "control_flow": M.control_flow,
    "typed_constants": M.typed_constants,
    "float8_initializer": M.float8_initializer,
    "residual": M.residual,
}


def assert_identical(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    """Same names in the same order, same dtype and shape, same bits."""
    assert list(got) == list(want), f"{what}: outputs {list(got)} != {list(want)}"
    for name, a in got.items():
        b = want[name]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{what}: '{name}' is {a.dtype}{list(a.shape)}, expected {b.dtype}{list(b.shape)}"
        )
        assert np.array_equal(a, b), f"{what}: '{name}' differs"
        if a.dtype != object:
            assert a.tobytes() == b.tobytes(), f"{what}: '{name}' differs in its bits"


def assert_close_to_ort(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], got: dict[str, np.ndarray]
) -> None:
    import onnxruntime as ort

    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    for name, want in zip(names, sess.run(None, feeds)):
        a = got[name]
        assert a.shape == want.shape, f"'{name}': {a.shape} vs onnxruntime {want.shape}"
        if a.dtype == object:
            assert a.tolist() == want.tolist(), f"'{name}' differs from onnxruntime"
        else:
            tol = 1e-2 if a.dtype == np.float16 else 1e-4
            np.testing.assert_allclose(
                a.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol, err_msg=name
            )


def check_round_trip(
    model: onnx.ModelProto,
    tmp_path: Path,
    dims: dict[str, int] | None = None,
    *,
    against_ort: bool = True,
) -> dict[str, np.ndarray]:
    """Build, save, load and run ``model``; returns the outputs after checking every path agrees
    (and with onnxruntime, unless ``against_ort`` is False)."""
    rng = np.random.default_rng()
    feeds = M.random_feeds(model, rng, dims)
    built = Builder("reference").build(model, BuilderConfig(embed_source=True))
    with built.create_execution_context() as ctx:
        before = ctx.infer(feeds)
    path = tmp_path / "model.engine"
    built.save(path)
    loaded = Engine.load(path)
    with loaded.create_execution_context() as ctx:
        after = ctx.infer(feeds)
    direct = tensorkiln.run_onnx(model, feeds)
    assert_identical(after, before, "loaded engine vs built engine")
    assert_identical(after, direct, "loaded engine vs run_onnx")
    if against_ort:
        assert_close_to_ort(model, feeds, after)
    return after


@pytest.mark.parametrize("name", sorted(SMALL))
def test_small_model_round_trip(name: str, tmp_path: Path) -> None:
    check_round_trip(SMALL[name](), tmp_path, {"N": 3})


def test_typed_constants_keep_their_types(tmp_path: Path) -> None:
    # Every exotic dtype must come back as itself, not as its storage type (uint8 bytes).
    # Level 0: the optimizer would fold these constants' Casts away.
    built = Builder().build(M.typed_constants(), BuilderConfig(optimization_level=0))
    built.save(tmp_path / "t.engine")
    loaded = Engine.load(tmp_path / "t.engine")
    want = {v.name: v.const for v in built.graph.initializers}
    got = {v.name: v.const for v in loaded.graph.initializers}
    assert_identical(got, want, "initializers")
    assert {str(a.dtype) for a in got.values()} >= {"int4", "bfloat16", "float16", "int64"}
    words = loaded.graph.nodes[0].attrs["value"]
    assert words.dtype == object and words.tolist() == [["kiln", "engine"], ["ünïcode", ""]]


def test_float8_initializer_is_stored_bit_exact(tmp_path: Path) -> None:
    built = Builder().build(M.float8_initializer(), BuilderConfig(optimization_level=0))
    loaded = Engine.deserialize(built.serialize())
    got = {v.name: v.const for v in loaded.graph.initializers}
    assert str(got["w8"].dtype) == "float8_e4m3fn" and str(got["w5"].dtype) == "float8_e5m2"
    assert got["w8"].view(np.uint8).tolist() == [[0x30, 0xBE, 0x7E], [0x88, 0x44, 0x00]]
    check_round_trip(M.float8_initializer(), tmp_path, {"N": 5})


def test_control_flow_takes_both_branches(tmp_path: Path) -> None:
    # The If's condition depends on the input's sign: run both ways through the loaded engine.
    model = M.control_flow()
    loaded = Engine.deserialize(Builder().build(model).serialize())
    for sign in (1.0, -1.0):
        x = np.abs(np.random.default_rng().standard_normal((2, 4))).astype(np.float32) * sign
        got = loaded.create_execution_context().infer({"x": x})
        assert_identical(got, tensorkiln.run_onnx(model, {"x": x}), f"sign {sign}")
        assert_close_to_ort(model, {"x": x}, got)


@pytest.mark.skipif(not M.DIGITS.exists(), reason="examples/digits_cnn.onnx is not bundled")
def test_digits_cnn_round_trip(tmp_path: Path) -> None:
    check_round_trip(onnx.load(M.DIGITS), tmp_path, {"N": 7})


@pytest.mark.parametrize("path", M.light_models(), ids=lambda p: p.stem)
def test_light_model_round_trip(path: Path, tmp_path: Path) -> None:
    t0 = time.perf_counter()
    # squeezenet's constant weights make its 1000 logits equal (about 1e10) up to the order in
    # which BLAS sums each channel, which differs between the last columns and the rest on
    # some CPUs: the softmax against onnxruntime's is then a comparison of summation orders
    # (tests/conformance/exclusions.py says more); the round trip itself is checked bit for bit
    check_round_trip(onnx.load(path), tmp_path, against_ort=path.stem != "light_squeezenet")
    seconds = time.perf_counter() - t0
    if seconds > 10:
        print(f"{path.name}: the round trip took {seconds:.1f} s")


def test_there_are_nine_light_models() -> None:
    assert len(M.light_models()) == 9
    assert all(p.is_file() for p in M.light_models())


def test_saved_file_is_deterministic_and_equals_serialize(tmp_path: Path) -> None:
    built = Builder().build(M.cnn(), BuilderConfig(embed_source=True))
    built.save(tmp_path / "a.engine")
    Engine.load(tmp_path / "a.engine").save(tmp_path / "b.engine")
    data = (tmp_path / "a.engine").read_bytes()
    assert data == built.serialize()
    # Loading and saving again changes nothing but what the loader cannot know (none here).
    assert (tmp_path / "b.engine").read_bytes() == data


def test_embedded_source_is_the_model(tmp_path: Path) -> None:
    model = M.mlp()
    built = Builder().build(model, BuilderConfig(embed_source=True))
    loaded = Engine.deserialize(built.serialize())
    assert loaded.source_model == model.SerializeToString()
    assert loaded.source["embedded"] is True
    plain = Engine.deserialize(Builder().build(model).serialize())
    assert plain.source_model is None and plain.source["embedded"] is False


ENGINE_MAKERS: dict[str, Callable[[], onnx.ModelProto]] = {"mlp": M.mlp, "cnn": M.cnn}


@pytest.mark.parametrize("name", sorted(ENGINE_MAKERS))
def test_description_survives(name: str) -> None:
    built = Builder().build(ENGINE_MAKERS[name]())
    loaded = Engine.deserialize(built.serialize())
    assert loaded.inputs == built.inputs and loaded.outputs == built.outputs
    assert loaded.layers == built.layers and loaded.memory == built.memory
    assert loaded.num_layers == built.num_layers

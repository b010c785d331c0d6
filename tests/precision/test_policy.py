"""The precision policy seam: the default policy builds the engines the builder built before it
(same graph, same per-layer choices, same outputs against onnxruntime in float32), per-layer
constraints are honoured and recorded in the engine file, and the per-layer fields survive a
round trip, are optional in older engines and are validated when read.

Engines are built for the cuda backend's kernels on CPU tensors without tuning (no tactic
sources), which is where fp16 and bf16 run on a machine without a GPU.
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import numpy_helper

import tensorkiln
from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.builder.builder import optimize
from tensorkiln.engine import Engine
from tensorkiln.engine.serialize import graph_from_json, graph_to_json
from tensorkiln.errors import BuildError, EngineFormatError, GraphError, InputError
from tensorkiln.frontends.onnx import import_onnx
from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.ir.graph import FORMATS, PRECISIONS
from tensorkiln.ir.printer import format_graph
from tensorkiln.ir.verify import verify
from tensorkiln.precision import cancellation_prone, kept_fp32_notes, reduce_precision
from tests.cli.helpers import CLI, assert_one_line_error, mlp_model
from tests.engine import container as C
from tests.precision.test_cancellation import _layer_norm

pytest.importorskip("torch")

F32, F16 = DType.FLOAT, DType.FLOAT16
# relative L2 error against onnxruntime in float32 an engine of each precision must stay under
# (no TF32 on a CPU; float32 itself loses digits in the test's E[x^2] - E[x]^2 at mean 40)
ACCURACY = {"fp32": 1e-3, "tf32": 1e-3, "fp16": 1e-2, "bf16": 5e-2}


def _config(*flags: str, level: int = 3, pins: dict[str, str] | None = None) -> BuilderConfig:
    config = BuilderConfig(optimization_level=level, tactic_sources=set())
    for f in flags:
        config.set_flag(f)
    config.layer_precisions = dict(pins or {})
    return config


def _build(model: onnx.ModelProto, config: BuilderConfig, backend: str = "cuda") -> Engine:
    builder = Builder(backend, device="cpu") if backend == "cuda" else Builder(backend)
    return builder.build(model, config, progress=False)


def _run(engine: Engine, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = engine.create_execution_context().infer(feeds)
    return {k: v.detach().float().numpy() if hasattr(v, "detach") else v for k, v in out.items()}


def _ort(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feeds)))


def _rel(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def _without_layer_fields(data: dict) -> dict:
    """A serialized graph with the per-layer fields dropped from every node (subgraphs too)."""
    data = copy.deepcopy(data)
    stack = [data]
    while stack:
        g = stack.pop()
        for n in g["nodes"]:
            n.pop("precision", None)
            n.pop("format", None)
            stack.extend(a["graph"] for a in n["attrs"].values() if "graph" in a)
    return data


def _before_the_policy(model: onnx.ModelProto, precision: str) -> tuple[Graph, list[str]]:
    """The builder's former precision step, as it was written: import, optimize, then narrow all
    but the cancellation-prone layers for fp16/bf16."""
    graph = import_onnx(model, backend="cuda")
    optimize(graph, 3, backend="cuda")
    if precision not in ("fp16", "bf16"):
        return graph, []
    keep = cancellation_prone(graph)
    reduce_precision(graph, F16 if precision == "fp16" else DType.BFLOAT16, keep)
    return graph, kept_fp32_notes(keep, precision)


def _mlp(tmp_path: Path) -> onnx.ModelProto:
    return onnx.load(mlp_model(tmp_path / "mlp.onnx"))


# ------------------------------------------------------------------- the default policy


@pytest.mark.parametrize(
    ("flags", "engine_precision"),
    [((), "fp32"), (("tf32",), "tf32"), (("fp16",), "fp16"), (("bf16",), "bf16"),
     (("tf32", "bf16", "fp16"), "fp16")],
)  # fmt: skip
def test_default_policy_builds_the_engine_it_built_before(flags, engine_precision) -> None:
    model = _layer_norm()
    engine = _build(model, _config(*flags))
    before, notes = _before_the_policy(model, engine_precision)
    assert engine.build["precision"] == engine_precision
    assert [n for n in engine.build["notes"] if "kept in fp32" in n] == notes
    got, _, _ = graph_to_json(engine.graph)
    want, _, _ = graph_to_json(before)
    assert _without_layer_fields(got) == want
    x = (40 + np.random.default_rng().standard_normal((2, 8, 256))).astype(np.float32)
    err = _rel(_run(engine, {"x": x})["y"], _ort(model, {"x": x})["y"])
    assert err < ACCURACY[engine_precision]


def test_default_policy_per_layer_choices() -> None:
    """fp16 everywhere but the variance's layers, which the cancellation rule keeps in fp32;
    every layer linear; the casts the rewrite adds are fp16 layers."""
    model = _layer_norm()
    engine = _build(model, _config("fp16"))
    before, _ = _before_the_policy(model, "fp32")
    kept = {n.name for n in cancellation_prone(before)}
    assert kept  # (the model has a variance written as E[x^2] - E[x]^2)
    got = {n.name: (n.precision, n.format) for n in engine.graph.nodes}
    assert got == {
        name: ("fp32" if name in kept else "fp16", "linear")
        for name in (n.name for n in engine.graph.nodes)
    }
    assert {"x__cast_in", "y__cast_out"} <= set(got)
    # the reference backend computes in fp32 whatever is allowed, and says so
    with pytest.warns(UserWarning, match="does not implement"):
        ref = _build(model, _config("fp16"), backend="reference")
    assert {(n.precision, n.format) for n in ref.graph.nodes} == {("fp32", "linear")}
    assert ref.build["precision"] == "fp32"


# ------------------------------------------------------------------- per-layer constraints


def _pinned_mlp(tmp_path: Path) -> tuple[onnx.ModelProto, Engine]:
    """The MLP (fc1 -> bias1 -> act1 -> fc2) in fp16 with bias1, a middle layer, pinned to fp32
    (optimization level 0: the model's own layers)."""
    model = _mlp(tmp_path)
    return model, _build(model, _config("fp16", level=0, pins={"bias1": "fp32"}))


def test_layer_pinned_to_fp32_stays_fp32(tmp_path: Path) -> None:
    model, engine = _pinned_mlp(tmp_path)
    nodes = {n.name: n for n in engine.graph.nodes}
    producers = engine.graph.producers()
    consumers = engine.graph.consumers()
    bias = nodes["bias1"]
    assert bias.precision == "fp32"
    assert {nodes[k].precision for k in ("fc1", "act1", "fc2")} == {"fp16"}
    # its inputs cast up (the activation by a Cast from fp16, the bias a float32 constant)
    h0, b1 = bias.inputs
    assert h0.dtype == F32 and b1.dtype == F32 and b1.const is not None
    up = producers[h0]
    assert up.op == "Cast" and up.inputs[0].dtype == F16 and producers[up.inputs[0]] is nodes["fc1"]
    # its output cast down for the fp16 layer that reads it
    (h1,) = bias.outputs
    assert h1.dtype == F32
    (down,) = consumers[h1]
    assert down.op == "Cast" and down.outputs[0].dtype == F16
    assert consumers[down.outputs[0]] == [nodes["act1"]]
    assert any("bias1" in n and "pinned" in n for n in engine.build["notes"])
    x = np.random.default_rng().standard_normal((5, 4)).astype(np.float32)
    assert _rel(_run(engine, {"x": x})["y"], _ort(model, {"x": x})["y"]) < ACCURACY["fp16"]


def test_engine_file_records_the_pinned_layer(tmp_path: Path) -> None:
    _, engine = _pinned_mlp(tmp_path)
    loaded = Engine.deserialize(engine.serialize())
    assert {n.name: n.precision for n in loaded.graph.nodes}["bias1"] == "fp32"
    records = {x["name"]: x for x in loaded.layers}
    assert records["bias1"]["compute_precision"] == "fp32"
    assert records["act1"]["compute_precision"] == "fp16"
    assert loaded.build["config"]["layer_precisions"] == {"bias1": "fp32"}
    x = np.random.default_rng().standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_array_equal(_run(loaded, {"x": x})["y"], _run(engine, {"x": x})["y"])


def test_pinning_a_cancellation_prone_layer_to_the_engine_precision_is_honoured() -> None:
    engine = _build(_layer_norm(), _config("fp16", pins={"ReduceMean_1": "fp16"}))
    got = {n.name: n.precision for n in engine.graph.nodes}
    assert got["ReduceMean_1"] == "fp16" and got["ReduceMean_2"] == "fp32"


@pytest.mark.parametrize(
    ("flags", "pins", "error", "words"),
    [
        (("fp16",), {"no_such_layer": "fp32"}, BuildError, ["'no_such_layer'", "fc1", "fc2"]),
        ((), {"fc1": "fp16"}, BuildError, ["'fc1'", "fp16", "set_flag('fp16')"]),
        (("fp16", "bf16"), {"fc1": "bf16"}, BuildError, ["'fc1'", "bf16", "fp16 engine"]),
        (("tf32",), {"fc1": "fp32"}, BuildError, ["'fc1'", "fp32", "tf32 engine"]),
        (("fp16",), {"fc1": "int8"}, BuildError, ["'fc1'", "int8", "higher precision"]),
        (("fp16",), {"fc1": "fp64"}, InputError, ["'fc1'", "'fp64'"]),
    ],
)
def test_layer_precisions_errors_name_the_layer(tmp_path, flags, pins, error, words) -> None:
    with pytest.raises(error) as exc:
        _build(_mlp(tmp_path), _config(*flags, level=0, pins=pins))
    assert all(w in str(exc.value) for w in words), str(exc.value)
    assert "\n" not in str(exc.value)


def test_a_custom_policy_decides_alone(tmp_path: Path) -> None:
    """The builder asks the configured policy, not its own cascade: a policy keeping every
    layer of an fp16 build in fp32 gives a float32 engine's outputs."""
    from tensorkiln.precision import DefaultPolicy, PrecisionPlan

    class AllFp32(DefaultPolicy):
        def assign(self, graph, config) -> PrecisionPlan:
            plan = super().assign(graph, config)
            plan.layers = dict.fromkeys(graph.nodes, "fp32")  # (giving no reasons)
            return plan

    model = _mlp(tmp_path)
    config = _config("fp16")
    config.precision_policy = AllFp32()
    engine = _build(model, config)
    layers = [n for n in engine.graph.nodes if not n.name.endswith(("__cast_in", "__cast_out"))]
    assert {n.precision for n in layers} == {"fp32"}
    x = np.random.default_rng().standard_normal((4, 4)).astype(np.float32)
    assert _rel(_run(engine, {"x": x})["y"], _ort(model, {"x": x})["y"]) < 1e-5

    class Bf16OnFp16(DefaultPolicy):  # a plan the default rewrite cannot materialize
        def assign(self, graph, config) -> PrecisionPlan:
            plan = super().assign(graph, config)
            plan.layers[graph.nodes[0]] = "bf16"
            return plan

    config.precision_policy = Bf16OnFp16()
    with pytest.raises(BuildError, match=r"in bf16 while the engine computes in fp16"):
        _build(model, config)


# ------------------------------------------------------------------- IR and engine file


def _chain(n: int) -> Graph:
    """x -> Relu -> ... (``n`` nodes), every value f32[2,3]."""
    t = TensorType(F32, (2, 3))
    values = [Value(f"v{i}", t) for i in range(n + 1)]
    nodes = [Node("Relu", [values[i]], [values[i + 1]], name=f"r{i}") for i in range(n)]
    return Graph("chain", [values[0]], [values[-1]], nodes, opsets={"": 17})


def test_every_precision_and_format_round_trips() -> None:
    g = _chain(len(FORMATS) + 1)
    for i, n in enumerate(g.nodes[:-1]):  # the last records nothing
        n.precision, n.format = PRECISIONS[i % len(PRECISIONS)], FORMATS[i]
    verify(g)
    data, tensors, _ = graph_to_json(g)
    back, _ = graph_from_json(data, tensors)
    assert [(n.precision, n.format) for n in back.nodes] == [
        (n.precision, n.format) for n in g.nodes
    ]
    assert back.nodes[-1].precision is None and back.nodes[-1].format is None
    # a layer that records nothing takes the engine-wide precision, and linear
    back, _ = graph_from_json(data, tensors, "bf16")
    assert (back.nodes[-1].precision, back.nodes[-1].format) == ("bf16", "linear")
    assert back.nodes[0].precision == g.nodes[0].precision


def test_printer_and_verifier_show_and_check_the_fields() -> None:
    g = _chain(2)
    g.nodes[0].precision, g.nodes[0].format = "fp16", "hwc"
    text = format_graph(g)
    assert "= Relu(%v0) @fp16 hwc  # r0" in text and "= Relu(%v1)  # r1" in text
    g.nodes[1].format = "nchw"  # (TensorRT calls it linear)
    with pytest.raises(GraphError, match=r"'r1'.*format 'nchw'"):
        verify(g)
    g.nodes[1].format, g.nodes[1].precision = None, "fp64"
    with pytest.raises(GraphError, match=r"'r1'.*precision 'fp64'"):
        verify(g)


def _strip_layer_fields(data: bytes) -> bytes:
    """The engine as a tensorkiln without per-layer fields wrote it."""
    c = C.unpack(data)
    c.plan["graph"] = _without_layer_fields(c.plan["graph"])
    for layer in c.plan["layers"]:
        layer.pop("compute_precision", None)
        layer.pop("format", None)
    return C.pack(c)


def test_engine_without_layer_fields_loads_with_the_engine_precision(tmp_path: Path) -> None:
    _, engine = _pinned_mlp(tmp_path)
    old = Engine.deserialize(_strip_layer_fields(engine.serialize()))
    assert {(n.precision, n.format) for n in old.graph.nodes} == {("fp16", "linear")}
    x = np.random.default_rng().standard_normal((6, 4)).astype(np.float32)
    np.testing.assert_array_equal(_run(old, {"x": x})["y"], _run(engine, {"x": x})["y"])


# an fp16 MLP engine (cuda kernels on CPU tensors, its model embedded) written by tensorkiln before
# layers recorded their precision and format
OLD_ENGINE = Path(__file__).parent / "data" / "mlp_fp16_cuda_cpu_before_layer_fields.engine"


def test_an_engine_written_before_layer_fields_loads() -> None:
    c = C.unpack(OLD_ENGINE.read_bytes())
    assert not any("precision" in n or "format" in n for n in c.plan["graph"]["nodes"])
    assert not any("compute_precision" in x for x in c.plan["layers"])
    # (an engine loads only in the tensorkiln version that wrote it: this one's, here)
    c.plan["tensorkiln_version"] = tensorkiln.__version__
    engine = Engine.deserialize(C.pack(c))
    assert engine.build["precision"] == "fp16"
    assert {(n.precision, n.format) for n in engine.graph.nodes} == {("fp16", "linear")}
    model = onnx.load_from_string(engine.source_model)
    x = np.random.default_rng().standard_normal((7, 4)).astype(np.float32)
    assert _rel(_run(engine, {"x": x})["y"], _ort(model, {"x": x})["y"]) < ACCURACY["fp16"]


def _damage(data: bytes, edit) -> bytes:
    c = C.unpack(data)
    edit(c.plan)
    return C.pack(c)


def _node(plan: dict, name: str) -> dict:
    return next(n for n in plan["graph"]["nodes"] if n["name"] == name)


DAMAGE = {
    "unknown node precision": (lambda p: _node(p, "bias1").update(precision="fp64"), "fp64"),
    "node precision not a string": (lambda p: _node(p, "bias1").update(precision=16), "16"),
    "unknown node format": (lambda p: _node(p, "act1").update(format="nchw"), "nchw"),
    "node format null": (lambda p: _node(p, "act1").update(format=None), "None"),
    "unknown layer precision": (lambda p: p["layers"][1].update(compute_precision="x"), "layers"),
    "layer format a list": (lambda p: p["layers"][1].update(format=["hwc"]), "format"),
    "layer disagrees with node": (
        lambda p: p["layers"][2].update(compute_precision="fp32"),
        "compute_precision",
    ),
    "unknown engine precision": (lambda p: p["build"].update(precision="fp64"), "precision"),
}


@pytest.mark.parametrize("kind", DAMAGE)
def test_malformed_layer_field_is_a_clear_error(tmp_path: Path, kind: str, capsys) -> None:
    _, engine = _pinned_mlp(tmp_path)
    edit, word = DAMAGE[kind]
    data = _damage(engine.serialize(), edit)
    with pytest.raises(EngineFormatError) as exc:
        Engine.deserialize(data)
    assert word in str(exc.value) and "\n" not in str(exc.value), str(exc.value)
    path = tmp_path / "damaged.engine"
    path.write_bytes(data)
    rc, _, err = CLI(capsys)("inspect", path)
    assert_one_line_error(rc, err)


# ------------------------------------------------------------------- tolerance, per layer


@pytest.fixture
def off_by_3e_3(monkeypatch):
    """One test tactic per GEMM-like op, 3e-3 off its default kernel: inside fp16's tolerance
    against the float32 oracle, far outside fp32's."""
    from tensorkiln.kernels import tactics as registry
    from tensorkiln.kernels.registry import lookup

    registry._load()  # the real kernel modules register theirs first, into the real table
    monkeypatch.setattr(registry, "_TACTICS", {})
    for op, domain in (("GemmAct", "tensorkiln"), ("MatMul", "")):
        default = lookup(op, domain, 1, "cuda").fn

        def off(*a, _f=default, **k):
            return _f(*a, **k) * (1 + 3e-3)

        registry.tactic(op, domain=domain, name="t_off")(off)


def test_each_layer_is_tuned_at_its_own_tolerance(off_by_3e_3, tmp_path: Path) -> None:
    """fp16 engine, its last MatMul pinned to fp32: the fp16 GEMM accepts the tactic 3e-3 off,
    the fp32 one rejects it."""
    config = _config("fp16", pins={"fc2": "fp32"})
    config.tactic_sources = None
    model = _mlp(tmp_path)
    # (fc2 reads a ReLU: where every tuning row came out negative its input was zeros, every
    # tactic's product exactly right and nothing rejected; a bias of 10 keeps the ReLU open)
    b1 = next(t for t in model.graph.initializer if t.name == "b1")
    b1.CopyFrom(numpy_helper.from_array(np.abs(numpy_helper.to_array(b1)) + 10.0, "b1"))
    engine = _build(model, config)
    layers = {x["name"]: x for x in engine.layers}
    gemm = next(x for x in engine.layers if x["op"] == "tensorkiln.GemmAct")
    assert gemm["compute_precision"] == "fp16"
    assert "t_off" in gemm["timings_ms"] and "t_off" not in gemm.get("rejected", {})
    assert layers["fc2"]["compute_precision"] == "fp32"
    assert "relative error" in layers["fc2"]["rejected"]["t_off"]


def test_convolutions_record_the_channels_last_format_of_the_backends_that_hold_it() -> None:
    """The cpu backend runs 2-D convolutions channels-last: its engine says so layer by layer
    (and keeps it through a save and load); the reference backend's layers stay linear."""
    pytest.importorskip("torch")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], name="conv", pads=[1, 1, 1, 1]),
         helper.make_node("Sigmoid", ["c"], ["y"], name="sig")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [w],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    cpu = Engine.deserialize(Builder("cpu").build(model, progress=False).serialize())
    formats = {n.op: n.format for n in cpu.graph.nodes}
    conv = next(op for op in formats if "Conv" in op)
    assert formats[conv] == "hwc" and {f for op, f in formats.items() if op != conv} <= {"linear"}
    ref = Builder("reference").build(model, progress=False)
    assert {n.format for n in ref.graph.nodes} == {"linear"}
    x = rng.standard_normal((1, 3, 8, 8)).astype(np.float32)
    want = ref.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(
        np.asarray(cpu.create_execution_context().infer({"x": x})["y"]), want, rtol=1e-4, atol=1e-5
    )

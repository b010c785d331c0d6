"""fuse_conv_act and the tensorkiln.ConvAct kernel."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.kernels.reference import elementwise as ew
from tensorkiln.kernels.reference.fused_conv import conv_act
from tensorkiln.kernels.reference.nn import conv
from tensorkiln.passes.fuse_activation import fuse_gelu, fuse_silu
from tensorkiln.passes.fuse_conv import fuse_conv_act
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops

RNG = np.random.default_rng(7)
F = TensorProto.FLOAT

# ------------------------------------------------------------------------------------- kernel

UNFUSED = {
    "": lambda y: y,
    "Relu": ew.relu,
    "LeakyRelu": lambda y: ew.leaky_relu(y, alpha=0.2),
    "Clip": lambda y: ew.clip(y, np.float32(-0.5), np.float32(2.0)),
    "Sigmoid": ew.sigmoid,
    "Swish": ew.swish,
    "HardSigmoid": lambda y: ew.hard_sigmoid(y, alpha=0.3, beta=0.4),
    "HardSwish": ew.hard_swish,
    "Gelu": ew.gelu,
    "GeluTanh": lambda y: ew.gelu(y, approximate="tanh"),
    "Tanh": np.tanh,
}
PARAMS = {
    "LeakyRelu": {"activation_alpha": 0.2},
    "Clip": {"activation_min": -0.5, "activation_max": 2.0},
    "Swish": {"activation_alpha": 1.0},
    "HardSigmoid": {"activation_alpha": 0.3, "activation_beta": 0.4},
}

GEOMETRIES = [  # (C, M, spatial, kernel, attrs)
    (4, 6, (9, 9), (3, 3), {}),
    (4, 6, (10, 11), (3, 3), {"strides": [2, 2], "pads": [1, 1, 1, 1]}),
    (4, 6, (9, 9), (3, 3), {"dilations": [2, 2], "pads": [2, 0, 1, 2]}),
    (4, 6, (8, 8), (3, 3), {"group": 2, "pads": [1, 1, 1, 1]}),
    (4, 8, (8, 8), (3, 3), {"group": 4, "strides": [2, 1], "pads": [1, 1, 1, 1]}),  # depthwise
    (5, 7, (6, 6), (1, 1), {}),
    (3, 4, (7, 9), (2, 3), {"auto_pad": "SAME_UPPER", "strides": [2, 2]}),
    (3, 4, (12,), (3,), {"pads": [1, 1]}),
    (2, 3, (5, 4, 6), (2, 2, 3), {"strides": [1, 2, 1]}),
]


def _rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


def _unfused(x, w, b, z, act, order, attrs):
    y = conv(x, w, b, **attrs)
    if z is not None and order == "add_act":
        y = y + z
    y = UNFUSED[act](y)
    return y + z if z is not None and order == "act_add" else y


@pytest.mark.parametrize("geo", GEOMETRIES, ids=lambda g: f"{g[2]}-{g[3]}-{sorted(g[4])}")
@pytest.mark.parametrize("act", ["Relu", "Gelu"])
@pytest.mark.parametrize("residual", [False, True])
def test_conv_act_kernel_geometries(geo, act, residual) -> None:
    c, m, spatial, kernel, attrs = geo
    g = attrs.get("group", 1)
    x, w, b = _rand(2, c, *spatial), _rand(m, c // g, *kernel), _rand(m)
    z = _rand(*conv(x, w, **attrs).shape) if residual else None
    want = _unfused(x, w, b, z, act, "add_act", attrs)
    got = conv_act(x, w, b, z, activation=act, **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", list(UNFUSED))
@pytest.mark.parametrize("order", ["add_act", "act_add"])
def test_conv_act_kernel_activations(act, order) -> None:
    x, w, b = _rand(1, 3, 20, 20), _rand(5, 3, 3, 3), _rand(5)
    z = _rand(1, 5, 18, 18)
    want = _unfused(x, w, b, z, act, order, {})
    got = conv_act(x, w, b, z, activation=act, residual_order=order, **PARAMS.get(act, {}))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_conv_act_kernel_large_blocks_and_float16() -> None:
    """Several epilogue blocks per image (P = 4096 > one block of channels)."""
    x, w, b = _rand(2, 8, 64, 64), _rand(40, 8, 1, 1), _rand(40)
    z = _rand(2, 40, 64, 64)
    want = ew.relu(conv(x, w, b) + z)
    np.testing.assert_allclose(conv_act(x, w, b, z, activation="Relu"), want, rtol=1e-5, atol=1e-6)
    h = conv_act(
        x.astype(np.float16), w.astype(np.float16), b.astype(np.float16), activation="Relu"
    )
    assert h.dtype == np.float16
    np.testing.assert_allclose(h, ew.relu(conv(x, w, b)), rtol=2e-2, atol=2e-2)


def test_conv_act_kernel_rejects_bad_residual() -> None:
    x, w = _rand(1, 3, 6, 6), _rand(4, 3, 3, 3)
    with pytest.raises(ValueError, match="residual Z"):
        conv_act(x, w, None, _rand(1, 4, 1, 1), activation="Relu")


# --------------------------------------------------------------------------------------- pass


def _init(name: str, arr: np.ndarray):
    return numpy_helper.from_array(arr, name)


def _conv_model(
    tail: list, out: str, extra_inputs=(), inits=(), opset: int = 17, shape=(1, 8, 6, 6)
):
    """x -> Conv(W, B) -> y, then the ``tail`` nodes, output ``out``."""
    nodes = [helper.make_node("Conv", ["x", "W", "B"], ["y"], pads=[1, 1, 1, 1]), *tail]
    inputs = [helper.make_tensor_value_info("x", F, [1, 4, 6, 6]), *extra_inputs]
    outputs = [helper.make_tensor_value_info(out, F, None)]
    base = [_init("W", _rand(8, 4, 3, 3)), _init("B", _rand(8))]
    return graph_of(model(nodes, inputs, outputs, base + list(inits), opset=opset))


def _feeds(graph) -> dict[str, np.ndarray]:
    return {v.name: _rand(*v.shape) for v in graph.inputs}


def _check(graph, expected: list[str], count: int):
    counts = []

    def apply(g):
        fuse_gelu(g)  # activations written out become one node first, as in the PassManager
        fuse_silu(g)
        counts.append(fuse_conv_act(g))

    after = assert_pass_preserves_outputs(graph, apply, _feeds(graph))
    assert ops(after) == expected
    assert counts == [count]
    return after


Z = helper.make_tensor_value_info("z", F, [1, 8, 6, 6])


def test_conv_relu() -> None:
    g = _conv_model([helper.make_node("Relu", ["y"], ["out"])], "out")
    assert ops(g) == ["Conv", "Relu"]
    after = _check(g, ["tensorkiln.ConvAct"], 1)
    assert after.nodes[0].attrs["activation"] == "Relu"


def test_conv_bias_residual_relu() -> None:
    """ResNet's tail: Conv, a per-channel Add folded into B, residual Add, Relu."""
    tail = [
        helper.make_node("Add", ["y", "c"], ["y1"]),
        helper.make_node("Add", ["z", "y1"], ["y2"]),
        helper.make_node("Relu", ["y2"], ["out"]),
    ]
    g = _conv_model(tail, "out", [Z], [_init("c", _rand(8, 1, 1))])
    after = _check(g, ["tensorkiln.ConvAct"], 1)
    node = after.nodes[0]
    assert [v.name for v in node.inputs][3] == "z"
    assert node.attrs["activation"] == "Relu"
    assert node.attrs.get("residual_order", "add_act") == "add_act"


def test_two_convs_share_one_residual_add() -> None:
    """Downsample block: Add(conv_a, conv_b) -> Relu; one conv takes the Add, the other stays plain."""
    nodes = [
        helper.make_node("Conv", ["x", "W"], ["a"], pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "W2"], ["b"]),
        helper.make_node("Add", ["a", "b"], ["s"]),
        helper.make_node("Relu", ["s"], ["out"]),
    ]
    inits = [_init("W", _rand(8, 4, 3, 3)), _init("W2", _rand(8, 4, 1, 1))]
    x = helper.make_tensor_value_info("x", F, [1, 4, 6, 6])
    g = graph_of(model(nodes, [x], [helper.make_tensor_value_info("out", F, None)], inits))
    _check(g, ["tensorkiln.ConvAct", "tensorkiln.ConvAct"], 2)


def _act_tail(kind: str) -> tuple[list, list]:
    """Activation nodes reading y and writing out, with their initializers."""
    mk = helper.make_node
    if kind == "Swish":
        return [mk("Sigmoid", ["y"], ["s"]), mk("Mul", ["y", "s"], ["out"])], []
    if kind == "GeluErf":
        nodes = [
            mk("Div", ["y", "sqrt2"], ["d"]),
            mk("Erf", ["d"], ["e"]),
            mk("Add", ["e", "one"], ["e1"]),
            mk("Mul", ["y", "e1"], ["m"]),
            mk("Mul", ["m", "half"], ["out"]),
        ]
        consts = [("sqrt2", 1.4142135), ("one", 1.0), ("half", 0.5)]
        return nodes, [_init(n, np.array(v, np.float32)) for n, v in consts]
    if kind == "Clip":
        lo, hi = np.array(0.0, np.float32), np.array(6.0, np.float32)
        return [mk("Clip", ["y", "lo", "hi"], ["out"])], [_init("lo", lo), _init("hi", hi)]
    attrs = {"LeakyRelu": {"alpha": 0.3}, "HardSigmoid": {"alpha": 0.25, "beta": 0.6}}
    return [mk(kind, ["y"], ["out"], **attrs.get(kind, {}))], []


@pytest.mark.parametrize(
    "kind, activation",
    [
        ("Relu", "Relu"),
        ("LeakyRelu", "LeakyRelu"),
        ("Clip", "Clip"),
        ("Sigmoid", "Sigmoid"),
        ("Swish", "Swish"),
        ("HardSigmoid", "HardSigmoid"),
        ("HardSwish", "HardSwish"),
        ("GeluErf", "Gelu"),
        ("Tanh", "Tanh"),
    ],
)
def test_each_activation(kind: str, activation: str) -> None:
    tail, inits = _act_tail(kind)
    g = _conv_model(tail, "out", inits=inits)
    after = _check(g, ["tensorkiln.ConvAct"], 1)
    assert after.nodes[0].attrs["activation"] == activation


def test_gelu_op_and_clip_attributes() -> None:
    g = _conv_model([helper.make_node("Gelu", ["y"], ["out"])], "out", opset=20)
    assert _check(g, ["tensorkiln.ConvAct"], 1).nodes[0].attrs["activation"] == "Gelu"
    clip = helper.make_node("Clip", ["y"], ["out"], min=-1.0, max=1.5)
    after = _check(_conv_model([clip], "out", opset=6), ["tensorkiln.ConvAct"], 1)
    assert after.nodes[0].attrs["activation_max"] == 1.5


def test_residual_after_activation() -> None:
    tail = [helper.make_node("Relu", ["y"], ["r"]), helper.make_node("Add", ["r", "z"], ["out"])]
    after = _check(_conv_model(tail, "out", [Z]), ["tensorkiln.ConvAct"], 1)
    assert after.nodes[0].attrs["residual_order"] == "act_add"


# ----------------------------------------------------------------------------- negative cases


def test_runtime_weight_is_left_alone() -> None:
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"]), helper.make_node("Relu", ["y"], ["out"])]
    ins = [
        helper.make_tensor_value_info(n, F, s)
        for n, s in (("x", [1, 2, 5, 5]), ("w", [3, 2, 3, 3]))
    ]
    g = graph_of(model(nodes, ins, [helper.make_tensor_value_info("out", F, None)]))
    _check(g, ["Conv", "Relu"], 0)


def test_shared_intermediate_stops_the_chain() -> None:
    """y also feeds a second reader: the Relu is not fused, the conv alone becomes ConvAct."""
    tail = [helper.make_node("Relu", ["y"], ["out"]), helper.make_node("Neg", ["y"], ["n"])]
    g = _conv_model(tail, "out")
    g.outputs.append(next(v for n in g.nodes for v in n.outputs if v.name == "n"))
    _check(g, ["tensorkiln.ConvAct", "Relu", "Neg"], 1)


def test_graph_output_intermediate_stops_the_chain() -> None:
    g = _conv_model([helper.make_node("Relu", ["y"], ["out"])], "out")
    g.outputs.append(g.nodes[0].outputs[0])
    after = _check(g, ["tensorkiln.ConvAct", "Relu"], 1)
    assert after.nodes[0].attrs.get("activation", "") == ""


def test_broadcasting_residual_is_not_fused() -> None:
    """Z of shape (1, 8, 1, 1) computed at run time: an Add that broadcasts, kept."""
    zb = helper.make_tensor_value_info("z", F, [1, 8, 1, 1])
    tail = [helper.make_node("Add", ["y", "z"], ["s"]), helper.make_node("Relu", ["s"], ["out"])]
    _check(_conv_model(tail, "out", [zb]), ["tensorkiln.ConvAct", "Add", "Relu"], 1)


def test_runtime_clip_bound_and_non_channel_const_are_not_fused() -> None:
    hi = helper.make_tensor_value_info("hi", F, [])
    tail = [helper.make_node("Clip", ["y", "", "hi"], ["out"])]
    _check(_conv_model(tail, "out", [hi]), ["tensorkiln.ConvAct", "Clip"], 1)
    tail = [helper.make_node("Add", ["y", "c"], ["out"])]
    g = _conv_model(tail, "out", inits=[_init("c", _rand(6, 1))])  # broadcast over H, not C
    _check(g, ["tensorkiln.ConvAct", "Add"], 1)


def test_pass_is_idempotent() -> None:
    g = _conv_model([helper.make_node("Relu", ["y"], ["out"])], "out")
    fuse_conv_act(g)
    assert fuse_conv_act(g) == 0


# -------------------------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def resnet_feeds():
    from tests.models.test_architectures import build_resnet50

    return build_resnet50()


@pytest.mark.parametrize(
    "dynamo",
    [
        pytest.param(False, id="torchscript"),
        pytest.param(True, id="dynamo", marks=pytest.mark.slow),
    ],
)
def test_resnet50_every_conv_becomes_conv_act(resnet_feeds, dynamo: bool, tmp_path: Path) -> None:
    import tensorkiln
    from tests.models.test_architectures import export

    net, feeds = resnet_feeds
    graph = tensorkiln.import_onnx(export(net, feeds, tmp_path, dynamo=dynamo))
    before = collections.Counter(ops(graph))
    counts = []
    after = assert_pass_preserves_outputs(graph, lambda g: counts.append(fuse_conv_act(g)), feeds)
    got = collections.Counter(ops(after))
    assert counts == [before["Conv"]] == [53]
    assert got["tensorkiln.ConvAct"] == 53 and got["Conv"] == got["Relu"] == got["Add"] == 0
    assert len(after.nodes) == len(graph.nodes) - before["Relu"] - before["Add"]

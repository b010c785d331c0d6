"""Layer FLOPs and bytes (ops/cost.py) as the per-layer profile reports them, against independent
counts: PyTorch's FlopCounterMode on the equivalent torch module, and the sizes of the arrays the
engine really read and wrote."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.ir import DType, Node, TensorType, Value
from tensorkiln.ops.cost import node_cost
from tensorkiln.runtime.profile import profile_layers

torch = pytest.importorskip("torch")
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402


def _torch_flops(fn: Any, *args: Any) -> int:
    """The oracle: FLOPs PyTorch's counter sees while ``fn(*args)`` runs."""
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn(*args)
    flops = int(counter.get_total_flops())
    assert flops > 0  # (an op the counter does not know would count 0)
    return flops


def _sdpa_flops(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> int:
    """scaled_dot_product_attention's FLOPs on its math path (the CPU's fused kernel is not
    counted by FlopCounterMode; the math path's two batched products are)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    with sdpa_kernel(SDPBackend.MATH):
        return _torch_flops(sdpa, *(torch.from_numpy(t) for t in (q, k, v)))


def _model(
    nodes: list, inputs: dict[str, np.ndarray], weights: dict[str, np.ndarray], opset: int = 17
) -> bytes:
    graph = helper.make_graph(
        nodes,
        "one_layer",
        [
            helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for k, v in inputs.items()
        ],
        [helper.make_tensor_value_info("y", TensorProto.UNDEFINED, None)],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    imports = [helper.make_opsetid("", opset), helper.make_opsetid("tensorkiln", 1)]
    return helper.make_model(graph, opset_imports=imports, ir_version=10).SerializeToString()


def _profile(model: bytes, feeds: dict, backend: str = "reference", level: int = 3) -> list[dict]:
    config = BuilderConfig(optimization_level=level)
    engine = Builder(backend).build(model, config, progress=False)
    with engine.create_execution_context() as ctx:
        return profile_layers(ctx, feeds, 2)


def _total_flops(rows: list[dict], ops: set[str]) -> int:
    counted = [r for r in rows if r["op"].split(".")[-1] in ops]
    assert counted, rows
    assert all(r["flops"] is not None for r in counted), counted
    return sum(r["flops"] for r in counted)


def _f32(rng: np.random.Generator, *shape: int) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_conv_with_groups_strides_and_dilations_counts_as_torch(backend: str) -> None:
    rng = np.random.default_rng()
    n, c, m, groups = int(rng.integers(1, 3)), 6, 4 * int(rng.integers(1, 3)), 2
    x = _f32(rng, n, c, int(rng.integers(9, 14)), int(rng.integers(9, 14)))
    conv = torch.nn.Conv2d(c, m, (3, 2), stride=(2, 1), dilation=(1, 2), padding=1, groups=groups)
    w, b = conv.weight.detach().numpy(), conv.bias.detach().numpy()
    node = helper.make_node(
        "Conv", ["x", "w", "b"], ["y"], group=groups, strides=[2, 1], dilations=[1, 2],
        pads=[1, 1, 1, 1], name="conv",
    )  # fmt: skip
    rows = _profile(_model([node], {"x": x}, {"w": w, "b": b}), {"x": x}, backend)
    assert _total_flops(rows, {"Conv", "ConvAct"}) == _torch_flops(conv, torch.from_numpy(x))


def test_conv_transpose_counts_as_torch() -> None:
    rng = np.random.default_rng()
    x = _f32(rng, 2, 4, int(rng.integers(4, 8)), 5)
    deconv = torch.nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, groups=2)
    w = deconv.weight.detach().numpy()
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], group=2, strides=[2, 2],
                            pads=[1, 1, 1, 1], name="deconv")  # fmt: skip
    rows = _profile(_model([node], {"x": x}, {"w": w}), {"x": x})
    want = _torch_flops(lambda t: torch.nn.functional.conv_transpose2d(
        t, deconv.weight, None, stride=2, padding=1, groups=2), torch.from_numpy(x))  # fmt: skip
    assert _total_flops(rows, {"ConvTranspose"}) == want


@pytest.mark.parametrize("level", [0, 3])
def test_linear_as_gemm_counts_as_torch(level: int) -> None:
    rng = np.random.default_rng()
    batch, k, n = int(rng.integers(1, 9)), int(rng.integers(3, 40)), int(rng.integers(3, 40))
    x = _f32(rng, batch, k)
    linear = torch.nn.Linear(k, n)
    node = helper.make_node("Gemm", ["x", "w", "b"], ["y"], transB=1, name="fc")
    weights = {"w": linear.weight.detach().numpy(), "b": linear.bias.detach().numpy()}
    rows = _profile(_model([node], {"x": x}, weights), {"x": x}, level=level)
    want = _torch_flops(linear, torch.from_numpy(x))
    assert _total_flops(rows, {"Gemm", "GemmAct", "MatMul"}) == want


def test_batched_broadcast_matmul_counts_as_torch() -> None:
    rng = np.random.default_rng()
    a, b = _f32(rng, 2, 3, 5, 7), _f32(rng, 7, int(rng.integers(2, 9)))
    node = helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")
    rows = _profile(_model([node], {"a": a, "b": b}, {}), {"a": a, "b": b}, level=0)
    want = _torch_flops(torch.matmul, torch.from_numpy(a), torch.from_numpy(b))
    assert _total_flops(rows, {"MatMul"}) == want


@pytest.mark.parametrize("layout", ["bhsd", "bsd"])
def test_fused_attention_counts_as_torch_sdpa(layout: str) -> None:
    rng = np.random.default_rng()
    b, h, sq, sk, d = 2, 4, int(rng.integers(3, 9)), int(rng.integers(3, 12)), 8
    q, k, v = _f32(rng, b, h, sq, d), _f32(rng, b, h, sk, d), _f32(rng, b, h, sk, d)
    want = _sdpa_flops(q, k, v)
    if layout == "bsd":  # [B, S, H*D], the heads split inside the op
        q, k, v = (t.transpose(0, 2, 1, 3).reshape(b, t.shape[2], h * d) for t in (q, k, v))
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], domain="tensorkiln",
                            input_layout=layout, num_heads=h, name="attn")  # fmt: skip
    feeds = {"q": q, "k": k, "v": v}
    rows = _profile(_model([node], feeds, {}), feeds, level=0)
    assert _total_flops(rows, {"Attention"}) == want


def test_onnx_attention_counts_as_torch_sdpa() -> None:
    rng = np.random.default_rng()
    q, k, v = _f32(rng, 1, 2, 5, 4), _f32(rng, 1, 2, 7, 4), _f32(rng, 1, 2, 7, 6)
    want = _sdpa_flops(q, k, v)
    node = helper.make_node("Attention", ["q", "k", "v"], ["y"], name="attn")
    feeds = {"q": q, "k": k, "v": v}
    rows = _profile(_model([node], feeds, {}, opset=23), feeds, level=0)
    assert _total_flops(rows, {"Attention"}) == want


@pytest.mark.parametrize(
    ("equation", "a_shape", "b_shape"),
    [
        ("bij,bjk->bik", (3, 4, 6), (3, 6, 5)),
        ("...ij,...jk->...ik", (2, 3, 4, 6), (2, 3, 6, 5)),
        ("ij,jk", (4, 6), (6, 5)),  # (implicit output: the indices seen once)
        ("bhqd,bhkd->bhqk", (2, 3, 5, 8), (2, 3, 7, 8)),
    ],
)
def test_einsum_counts_as_torch(equation: str, a_shape: tuple, b_shape: tuple) -> None:
    rng = np.random.default_rng()
    a, b = _f32(rng, *a_shape), _f32(rng, *b_shape)
    node = helper.make_node("Einsum", ["a", "b"], ["y"], equation=equation, name="es")
    rows = _profile(_model([node], {"a": a, "b": b}, {}, opset=17), {"a": a, "b": b}, level=0)
    want = _torch_flops(torch.einsum, equation, torch.from_numpy(a), torch.from_numpy(b))
    assert _total_flops(rows, {"Einsum"}) == want


def test_bytes_are_the_arrays_read_and_written() -> None:
    """Bytes: input, weights and output, as numel * itemsize of the arrays the layer ran on."""
    rng = np.random.default_rng()
    x = _f32(rng, 3, int(rng.integers(2, 12)))
    w, b = _f32(rng, x.shape[1], 5), _f32(rng, 5)
    nodes = [helper.make_node("Gemm", ["x", "w", "b"], ["y"], name="fc")]
    model = _model(nodes, {"x": x}, {"w": w, "b": b})
    engine = Builder("reference").build(model, BuilderConfig(optimization_level=0), progress=False)
    with engine.create_execution_context() as ctx:
        y = ctx.infer({"x": x})["y"]
        (row,) = profile_layers(ctx, {"x": x}, 1)
    assert row["bytes"] == sum(a.size * a.itemsize for a in (x, w, b, y))
    assert row["mb"] == pytest.approx(row["bytes"] / 1e6)
    assert row["gflop"] == pytest.approx(2 * x.shape[0] * x.shape[1] * 5 / 1e9)


def test_elementwise_and_norm_counts_follow_the_documented_constants() -> None:
    rng = np.random.default_rng()
    x = _f32(rng, 2, int(rng.integers(3, 9)), 6)
    scale, bias = _f32(rng, 6), _f32(rng, 6)
    nodes = [
        helper.make_node("Tanh", ["x"], ["t"], name="tanh"),
        helper.make_node("Softmax", ["t"], ["s"], axis=-1, name="softmax"),
        helper.make_node("LayerNormalization", ["s", "scale", "bias"], ["n"], name="ln"),
        helper.make_node("Transpose", ["n"], ["y"], perm=[1, 0, 2], name="tr"),
    ]
    rows = _profile(_model(nodes, {"x": x}, {"scale": scale, "bias": bias}), {"x": x}, level=0)
    flops = {r["name"]: r["flops"] for r in rows}
    assert flops == {"tanh": x.size, "softmax": 5 * x.size, "ln": 8 * x.size, "tr": 0}


def _node(op: str, n_in: int, domain: str = "", **attrs: Any) -> Node:
    ins = [Value(f"i{i}") for i in range(n_in)]
    return Node(op, ins, [Value("o")], attrs, domain, name=op)


@pytest.mark.parametrize(
    "types",
    [
        [None, TensorType(DType.FLOAT, (3, 4))],  # an input whose type is unknown
        [TensorType(DType.FLOAT, ("N", 4)), TensorType(DType.FLOAT, (4, 2))],  # symbolic
        [TensorType(DType.FLOAT, None), TensorType(DType.FLOAT, (4, 2))],  # rank unknown
        [TensorType(None, (2, 4)), TensorType(DType.FLOAT, (4, 2))],  # element type unknown
    ],
)
def test_unknown_shapes_give_no_counts(types: list) -> None:
    cost = node_cost(_node("MatMul", 2), types, [TensorType(DType.FLOAT, (2, 2))])
    assert cost.flops is None and cost.bytes is None


def test_odd_shapes_and_attributes_never_raise() -> None:
    f = DType.FLOAT
    odd = [
        (_node("MatMul", 2), [TensorType(f, ()), TensorType(f, ())], [TensorType(f, ())]),
        (_node("Conv", 2), [TensorType(f, (1, 2, 3, 3)), TensorType(f, ())], [TensorType(f, ())]),
        (_node("Attention", 3, "tensorkiln", input_layout="bsd", num_heads=3),
         [TensorType(f, (1, 4, 4))] * 3, [TensorType(f, (1, 4, 4))]),  # 4 not split in 3 heads
        (_node("MaxPool", 1), [TensorType(f, (1, 1, 4))], [TensorType(f, (1, 1, 2))]),  # no kernel
        (_node("Einsum", 2, equation="a...b,b->a"), [TensorType(f, (2, 3, 4)),
         TensorType(f, (4,))], [TensorType(f, (2, 3))]),
        (_node("NoSuchOp", 1, "custom"), [TensorType(f, (5,))], [TensorType(f, (5,))]),
    ]  # fmt: skip
    for node, ins, outs in odd:
        cost = node_cost(node, ins, outs)
        assert cost.flops is None or cost.flops >= 0, node
    custom = node_cost(*odd[-1])
    assert custom.flops is None and custom.bytes == 40  # an unknown op: bytes only
    # an omitted optional input is not a missing type
    gemm = Node("Gemm", [Value("a"), Value("b"), None], [Value("y")], name="g")
    t = TensorType(f, (2, 3))
    cost = node_cost(gemm, [t, TensorType(f, (3, 4)), None], [TensorType(f, (2, 4))])
    assert cost.flops == 2 * 2 * 3 * 4 and cost.bytes == 4 * (6 + 12 + 8)


@pytest.mark.parametrize(("op", "module", "gates"), [("GRU", "GRU", 3), ("RNN", "RNN", 1)])
def test_recurrent_layers_count_as_torch(op: str, module: str, gates: int) -> None:
    """Every step's input and recurrent products (PyTorch counts GRU and RNN through their
    matrix products; its LSTM is one fused op it does not count)."""
    rng = np.random.default_rng()
    seq, batch, size, hidden = int(rng.integers(2, 7)), 2, 5, int(rng.integers(3, 9))
    x = _f32(rng, seq, batch, size)
    w, r = _f32(rng, 2, gates * hidden, size), _f32(rng, 2, gates * hidden, hidden)
    node = helper.make_node(op, ["x", "w", "r"], ["y"], hidden_size=hidden,
                            direction="bidirectional", name="rnn")  # fmt: skip
    rows = _profile(_model([node], {"x": x}, {"w": w, "r": r}), {"x": x}, level=0)
    torch_module = getattr(torch.nn, module)(size, hidden, bidirectional=True)
    assert _total_flops(rows, {op}) == _torch_flops(torch_module, torch.from_numpy(x))

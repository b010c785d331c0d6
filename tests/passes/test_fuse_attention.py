"""fuse_attention: Before/Expected graphs, numeric equality, negative cases, the kernel, real exports."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from tensorkiln.kernels.reference.fused_attention import fused_attention
from tensorkiln.passes import PassManager
from tensorkiln.passes.fuse_attention import fuse_attention
from tests.passes.util import assert_pass_preserves_outputs, graph_of, model, ops, run

B, H, S, D = 2, 4, 6, 8
E = H * D
F32 = TensorProto.FLOAT


def _rng() -> np.random.Generator:
    return np.random.default_rng()  # fresh inputs on every run


def _vi(name: str, shape, dtype: int = F32):
    return helper.make_tensor_value_info(name, dtype, list(shape))


def _const(name: str, value, dtype=np.float32):
    return numpy_helper.from_array(np.asarray(value, dtype), name)


def _sdpa(
    *,
    scale_op: str = "Div",
    mask: str = "",
    axis: int = -1,
    guard: bool = False,
    scores_out: bool = False,
    scale_input: bool = False,
    batch: int = B,
    causal: np.ndarray | None = None,
):
    """softmax(Q K^T / sqrt(D) [+ mask]) V on [B, H, S, D] inputs, in the exporters' spelling."""
    inputs = [_vi(n, (batch, H, S, D)) for n in "qkv"]
    inits = [_const("root", D**-0.25), _const("sqrt_d", np.sqrt(D)), _const("zero", 0.0)]
    nodes = [helper.make_node("Transpose", ["k"], ["kt"], perm=[0, 1, 3, 2])]
    if scale_op == "Div":
        nodes.append(helper.make_node("MatMul", ["q", "kt"], ["qk"]))
        nodes.append(helper.make_node("Div", ["qk", "scale" if scale_input else "sqrt_d"], ["s"]))
        if scale_input:
            inputs.append(_vi("scale", ()))
    else:  # dynamo: sqrt(1/sqrt(D)) on Q and on K^T
        nodes.append(helper.make_node("Mul", ["q", "root"], ["qs"]))
        nodes.append(helper.make_node("Mul", ["kt", "root"], ["kts"]))
        nodes.append(helper.make_node("MatMul", ["qs", "kts"], ["s"]))
    logits = "s"
    if causal is not None:  # GPT-2's constant lower-triangular buffer
        inits += [
            numpy_helper.from_array(causal, "tril"),
            _const("lowest", np.finfo(np.float32).min),
        ]
        nodes.append(helper.make_node("Where", ["tril", "s", "lowest"], ["sc"]))
        logits = "sc"
    if mask == "additive":
        inputs.append(_vi("mask", (B, 1, S, S)))
        nodes.append(helper.make_node("Add", [logits, "mask"], ["logits"]))
        logits = "logits"
    elif mask == "bool":
        inputs.append(_vi("keep", (B, 1, S, S), TensorProto.BOOL))
        inits.append(_const("ninf", -np.inf))
        nodes.append(helper.make_node("Where", ["keep", "zero", "ninf"], ["bias"]))
        nodes.append(helper.make_node("Add", [logits, "bias"], ["logits"]))
        logits = "logits"
    nodes.append(helper.make_node("Softmax", [logits], ["p"], axis=axis))
    probs = "p"
    if guard:
        nodes.append(helper.make_node("IsNaN", ["p"], ["nan"]))
        nodes.append(helper.make_node("Where", ["nan", "zero", "p"], ["pg"]))
        probs = "pg"
    nodes.append(helper.make_node("MatMul", [probs, "v"], ["o"]))
    outputs = [_vi("o", (B, H, S, D))] + ([_vi("s", (batch, H, S, S))] if scores_out else [])
    return graph_of(model(nodes, inputs, outputs, inits))


def _feeds(graph) -> dict[str, np.ndarray]:
    rng, feeds = _rng(), {}
    for v in graph.inputs:
        shape = tuple(v.shape)
        if v.dtype.name == "BOOL":
            keep = rng.random(shape) < 0.7
            keep[..., 0] = True  # every query sees at least one key
            feeds[v.name] = keep
        elif v.name == "scale":
            feeds[v.name] = np.asarray(np.sqrt(D), np.float32)
        else:
            feeds[v.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _fused(graph):
    return assert_pass_preserves_outputs(graph, fuse_attention, _feeds(graph))


def _attention_node(graph):
    (node,) = [n for n in graph.nodes if n.domain == "tensorkiln"]
    return node


# ---------------------------------------------------------------- Before / Expected


def test_div_scale_core():
    before = _sdpa()
    assert ops(before) == ["Transpose", "MatMul", "Div", "Softmax", "MatMul"]
    after = _fused(before)
    assert ops(after) == ["tensorkiln.Attention"]
    node = _attention_node(after)
    assert node.attrs["scale"] == pytest.approx(1 / np.sqrt(D))
    assert node.attrs["mask_kind"] == "" and node.attrs["output_layout"] == "bhsd"
    assert [v.name for v in node.inputs] == ["q", "k", "v"]


def test_split_mul_scale_and_additive_mask_and_nan_guard():
    before = _sdpa(scale_op="Mul", mask="additive", guard=True)
    assert ops(before) == [
        "Transpose", "Mul", "Mul", "MatMul", "Add", "Softmax", "IsNaN", "Where", "MatMul",
    ]  # fmt: skip
    after = _fused(before)
    assert ops(after) == ["tensorkiln.Attention"]
    node = _attention_node(after)
    assert node.attrs["scale"] == pytest.approx(1 / np.sqrt(D), rel=1e-6)
    assert node.attrs["mask_kind"] == "additive" and node.inputs[3].name == "mask"


def test_where_mask_becomes_bool_mask():
    before = _sdpa(mask="bool", guard=True)
    after = _fused(before)
    assert ops(after) == ["tensorkiln.Attention"]
    node = _attention_node(after)
    assert node.attrs["mask_kind"] == "bool" and node.inputs[3].name == "keep"


def test_causal_buffer_becomes_causal_attribute():
    tril = np.tri(S, dtype=bool)[None, None]
    before = _sdpa(mask="additive", causal=tril)
    assert ops(before) == ["Transpose", "MatMul", "Div", "Where", "Add", "Softmax", "MatMul"]
    after = _fused(before)
    assert ops(after) == ["tensorkiln.Attention"]
    node = _attention_node(after)
    assert node.attrs["causal"] == 1 and node.attrs["mask_kind"] == "additive"


def test_not_fused_when_the_constant_mask_is_not_causal():
    before = _sdpa(causal=np.tri(S, k=1, dtype=bool)[None, None])
    after = _fused(before)
    assert ops(after) == ops(before)


def _packed_graph(merge: bool = True):
    """Linear-projected [B, S, E] inputs split into heads, attention, heads merged back."""
    rng = _rng()
    inits = [_const("split", [B, S, H, D], np.int64), _const("merge", [B, S, E], np.int64)]
    inits += [_const(f"w{n}", rng.standard_normal((E, E)) / 4) for n in "qkv"]
    inits.append(_const("sqrt_d", np.sqrt(D)))
    nodes = []
    for n, perm in (("q", [0, 2, 1, 3]), ("k", [0, 2, 3, 1]), ("v", [0, 2, 1, 3])):
        nodes.append(helper.make_node("MatMul", ["x", f"w{n}"], [f"{n}p"]))
        nodes.append(helper.make_node("Reshape", [f"{n}p", "split"], [f"{n}r"]))
        nodes.append(helper.make_node("Transpose", [f"{n}r"], [f"{n}4"], perm=perm))
    nodes += [
        helper.make_node("MatMul", ["q4", "k4"], ["qk"]),
        helper.make_node("Div", ["qk", "sqrt_d"], ["s"]),
        helper.make_node("Softmax", ["s"], ["p"], axis=3),
        helper.make_node("MatMul", ["p", "v4"], ["o"]),
        helper.make_node("Transpose", ["o"], ["ot"], perm=[0, 2, 1, 3]),
    ]
    out = "ot"
    if merge:
        nodes.append(helper.make_node("Reshape", ["ot", "merge"], ["y"]))
        out = "y"
    shape = (B, S, E) if merge else (B, S, H, D)
    return graph_of(model(nodes, [_vi("x", (B, S, E))], [_vi(out, shape)], inits))


def test_head_split_and_merge_absorbed():
    before = _packed_graph()
    after = _fused(before)
    assert ops(after) == ["MatMul", "MatMul", "MatMul", "tensorkiln.Attention"]
    node = _attention_node(after)
    assert node.attrs["num_heads"] == H
    assert node.attrs["input_layout"] == "bsd" and node.attrs["output_layout"] == "bsd"
    assert [v.name for v in node.inputs] == ["qp", "kp", "vp"] and node.outputs[0].name == "y"


def test_shape_rule_gives_the_replaced_types():
    from tensorkiln.kernels.evaluate import infer_shapes

    after = _fused(_packed_graph())
    out = after.outputs[0]
    out.type = None
    infer_shapes(after)
    assert tuple(out.shape) == (B, S, E)


def test_head_transpose_absorbed_without_merge():
    after = _fused(_packed_graph(merge=False))
    node = _attention_node(after)
    assert node.attrs["output_layout"] == "bshd" and node.outputs[0].name == "ot"


# ---------------------------------------------------------------- negative cases


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"axis": 2}, id="softmax-on-another-axis"),
        pytest.param({"scores_out": True}, id="scores-used-twice"),
        pytest.param({"scale_input": True}, id="non-constant-scale"),
    ],
)
def test_not_fused(options):
    before = _sdpa(**options)
    after = _fused(before)
    assert ops(after) == ops(before)


def test_not_fused_when_probabilities_are_read_elsewhere():
    before = _sdpa()
    p = next(n for n in before.nodes if n.op == "Softmax").outputs[0]
    before.outputs.append(p)
    assert fuse_attention(copy.deepcopy(before)) == 0


def test_not_fused_when_the_mask_broadcasts_the_scores_up():
    before = _sdpa(mask="additive", batch=1)  # scores [1, H, S, S] + mask [B, 1, S, S]
    after = _fused(before)
    assert ops(after) == ops(before)


# ---------------------------------------------------------------- the kernel


def _unfused(q, k, v, bias, scale):
    s = np.matmul(q, k.swapaxes(-1, -2)) * np.float32(scale) + bias
    e = np.exp(s - s.max(-1, keepdims=True))
    return np.matmul(e / e.sum(-1, keepdims=True), v)


def test_kernel_matches_the_unfused_graph():
    graph = _sdpa(scale_op="Mul", mask="additive")
    feeds = _feeds(graph)
    (expected,) = run(graph, feeds).values()
    got = fused_attention(
        feeds["q"], feeds["k"], feeds["v"], feeds["mask"], scale=D**-0.5, mask_kind="additive"
    )
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_kernel_causal_bool_and_layouts():
    rng = _rng()
    q, k, v = (rng.standard_normal((B, S, E)).astype(np.float32) for _ in range(3))
    keep = rng.random((B, 1, S, S)) < 0.7
    keep[..., 0] = True
    heads = [x.reshape(B, S, H, D).transpose(0, 2, 1, 3) for x in (q, k, v)]
    bias = np.where(keep & np.tri(S, dtype=bool), 0, -np.inf).astype(np.float32)
    expected = _unfused(*heads, bias, 0.3)
    got = fused_attention(
        q, k, v, keep, scale=0.3, causal=1, mask_kind="bool", num_heads=H,
        input_layout="bsd", output_layout="bsd",
    )  # fmt: skip
    np.testing.assert_allclose(got, expected.transpose(0, 2, 1, 3).reshape(B, S, E), rtol=1e-5)
    assert got.dtype == np.float32


def test_kernel_fully_masked_row_gives_zeros():
    q, k, v = (np.ones((1, 1, 2, 4), np.float32) for _ in range(3))
    keep = np.array([[[[True, True], [False, False]]]])
    got = fused_attention(q, k, v, keep, mask_kind="bool")
    np.testing.assert_array_equal(got[0, 0, 1], 0.0)
    np.testing.assert_allclose(got[0, 0, 0], 1.0)


# ---------------------------------------------------------------- real exported models


def _build_vit():
    import torch
    from transformers import ViTConfig, ViTModel

    config = ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=128,
    )  # fmt: skip
    torch.manual_seed(0)

    class ViT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = ViTModel(config)

        def forward(self, pixel_values):
            return self.model(pixel_values=pixel_values, return_dict=False)[0]

    x = np.random.default_rng(0).standard_normal((2, 3, 32, 32)).astype(np.float32)
    return ViT().eval(), {"pixel_values": x}


def _build(name: str):
    from tests.models import test_architectures as arch

    return {"bert": arch.build_bert, "gpt2": arch.build_gpt2, "vit": _build_vit}[name]()


_EXPORTS: dict[tuple[str, str], tuple[Path, dict]] = {}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("transformers")
    pytest.importorskip("onnxscript")
    from tests.models.test_architectures import export

    def get(name: str, exporter: str) -> tuple[Path, dict]:
        if (name, exporter) not in _EXPORTS:
            model, feeds = _build(name)
            folder = tmp_path_factory.mktemp(f"{name}-{exporter}")
            path = export(model, feeds, folder, dynamo=exporter == "dynamo")
            _EXPORTS[(name, exporter)] = (path, feeds)
        return _EXPORTS[(name, exporter)]

    return get


MODELS = [(m, e) for m in ("bert", "gpt2", "vit") for e in ("torchscript", "dynamo")]


@pytest.mark.parametrize(("name", "exporter"), MODELS, ids=[f"{m}-{e}" for m, e in MODELS])
def test_real_model_every_attention_fused(exported, name, exporter):
    import tensorkiln

    path, feeds = exported(name, exporter)
    graph = tensorkiln.import_onnx(str(path))
    present = sum(n.op == "Softmax" for n in graph.nodes)
    assert present == 2  # two layers in each small config
    after = assert_pass_preserves_outputs(graph, fuse_attention, feeds, rtol=1e-5, atol=1e-5)
    assert ops(after).count("tensorkiln.Attention") == present
    assert "Softmax" not in ops(after)


@pytest.mark.parametrize(("name", "exporter"), MODELS, ids=[f"{m}-{e}" for m, e in MODELS])
def test_real_model_after_the_full_pipeline(exported, name, exporter):
    import tensorkiln

    path, feeds = exported(name, exporter)
    graph = tensorkiln.import_onnx(str(path))
    pm = PassManager(level=3, verify=True)
    after = assert_pass_preserves_outputs(graph, pm.run, feeds, rtol=1e-5, atol=1e-5)
    assert ops(after).count("tensorkiln.Attention") == 2, pm.summary()
    assert "Softmax" not in ops(after)

"""Op records: attribute defaults per opset against ONNX's schemas and the spec's values, traits,
shape rules, the keywords kernels are called with, and the import direction of ir/ and ops/."""

from __future__ import annotations

import ast
import pathlib

import numpy as np
import onnx
import pytest
from onnx import helper

from tensorkiln import ops
from tensorkiln.kernels.registry import lookup, node_kwargs

SRC = pathlib.Path(__file__).resolve().parents[2] / "src" / "tensorkiln"


def _onnx_defaults(op: str, opset: int, domain: str = "") -> dict:
    """The defaults as onnx's reference evaluator reads them (the independent oracle)."""
    schema = onnx.defs.get_schema(op, opset, domain)
    out = {}
    for name, attr in schema.attributes.items():
        if attr.default_value.type != onnx.AttributeProto.UNDEFINED:
            v = helper.get_attribute_value(attr.default_value)
            out[name] = v.decode() if isinstance(v, bytes) else v
    return out


@pytest.mark.parametrize(
    "op,opset",
    [
        ("Softmax", 11),
        ("Softmax", 13),
        ("Resize", 10),
        ("Resize", 11),
        ("Resize", 13),
        ("Resize", 18),
        ("Resize", 19),
        ("Conv", 11),
        ("LeakyRelu", 16),
        ("GroupNormalization", 18),
        ("GroupNormalization", 21),
        ("BatchNormalization", 9),
        ("BatchNormalization", 15),
        ("Gelu", 20),
        ("LSTM", 14),
        ("TopK", 11),
    ],
)
def test_defaults_match_onnx_schemas(op, opset):
    assert ops.attribute_defaults(op, "", opset) == _onnx_defaults(op, opset)


def test_defaults_are_the_specs_values():
    # written out from the operator docs, independently of any schema reader
    assert ops.attribute_defaults("Softmax", "", 11) == {"axis": 1}
    assert ops.attribute_defaults("Softmax", "ai.onnx", 13) == {"axis": -1}
    assert ops.attribute_defaults("Resize", "", 10) == {"mode": "nearest"}
    r19 = ops.attribute_defaults("Resize", "", 19)
    assert r19["coordinate_transformation_mode"] == "half_pixel"
    assert r19["keep_aspect_ratio_policy"] == "stretch" and r19["cubic_coeff_a"] == -0.75
    assert "antialias" not in ops.attribute_defaults("Resize", "", 13)
    assert ops.attribute_defaults("LeakyRelu", "", 6)["alpha"] == float(np.float32(0.01))
    assert ops.attribute_defaults("GridSample", "", 16)["mode"] == "bilinear"
    assert ops.attribute_defaults("GridSample", "", 20)["mode"] == "linear"
    assert ops.attribute_defaults("NoSuchOp", "", 13) == {}


def test_overrides_replace_unusable_schema_defaults():
    assert _onnx_defaults("GRU", 1)["direction"] == "foward"  # the schema's spelling
    assert ops.attribute_defaults("GRU", "", 1)["direction"] == "forward"
    assert ops.attribute_defaults("RNN", "", 14)["activations"] is None
    assert ops.attribute_defaults("Clip", "", 6) == {"min": None, "max": None}
    assert ops.attribute_defaults("Clip", "", 13) == {}  # bounds are inputs: nothing to override


def test_returned_defaults_are_copies():
    d = ops.attribute_defaults("Resize", "", 19)
    d["mode"] = "cubic"
    assert ops.attribute_defaults("Resize", "", 19)["mode"] == "nearest"


def test_fused_records_declare_their_attributes():
    conv_act = ops.get("ConvAct", "tensorkiln")
    assert conv_act is not None and conv_act.has(ops.FUSED)
    d = conv_act.defaults(1)
    assert d["residual_order"] == "add_act" and d["activation"] == "" and d["group"] == 1
    assert ops.attribute_defaults("LayerNorm", "tensorkiln", 1) == {
        "axis": -1, "epsilon": 1e-5, "q_dtype": 0,
    }  # fmt: skip
    assert ops.get("Attention", "tensorkiln").defaults(1)["input_layout"] == "bhsd"
    assert ops.get("NotAnOp", "tensorkiln") is None
    assert set(ops.ACTIVATIONS) >= {"", "Relu", "Gelu", "GeluTanh"}
    with pytest.raises(ValueError, match="unknown activation"):
        ops.check_activation("Softsign", "ConvAct")


@pytest.mark.parametrize(
    "op,domain,trait",
    [
        ("Relu", "", ops.ELEMENTWISE),
        ("Add", "ai.onnx", ops.ELEMENTWISE),
        ("Where", "", ops.ELEMENTWISE),
        ("SiLU", "tensorkiln", ops.ELEMENTWISE),
        ("ReduceSum", "", ops.REDUCTION),
        ("ArgMax", "", ops.REDUCTION),
        ("RandomNormal", "", ops.RANDOM),
        ("Dropout", "", ops.RANDOM),
        ("Reshape", "", ops.SHAPE),
        ("Shape", "", ops.SHAPE),
        ("Loop", "", ops.CONTROL),
        ("NonZero", "", ops.BOUNDED),
        ("Pointwise", "tensorkiln", ops.FUSED),
    ],
)
def test_traits(op, domain, trait):
    assert ops.has_trait(op, domain, trait)
    assert ops.get(op, domain).has(trait)


def test_traits_are_not_given_where_they_do_not_hold():
    assert not ops.has_trait("MatMul", "", ops.ELEMENTWISE)
    assert not ops.has_trait("Softmax", "", ops.ELEMENTWISE)
    assert not ops.has_trait("Identity", "", ops.ELEMENTWISE)  # renames; cleanup removes it
    assert not ops.has_trait("Relu", "", ops.RANDOM)
    assert "Relu" in ops.ELEMENTWISE_OPS and "MatMul" not in ops.ELEMENTWISE_OPS
    assert {"RandomUniform", "Bernoulli", "Multinomial"} <= ops.RANDOM_OPS


def test_fusion_reads_the_records():
    from tensorkiln.passes import fuse_pointwise

    assert fuse_pointwise.ELEMENTWISE is ops.ELEMENTWISE_OPS


def test_shape_rules_live_on_records():
    assert ops.shape_rule("MatMul") is not None
    assert ops.shape_rule("ConvAct", "tensorkiln") is not None
    assert ops.get("Attention", "tensorkiln").shape_rule is not None
    assert ops.shape_rule("Conv") is None  # ONNX's schema inference applies


def test_node_kwargs_fill_the_opsets_defaults_for_the_kernels_keywords():
    old, new = lookup("Softmax", "", 11), lookup("Softmax", "", 13)
    assert old.fn is new.fn  # one kernel for every opset
    assert node_kwargs(old, {}, 1) == {"axis": 1, "_opset": 11}
    assert node_kwargs(new, {}, 1) == {"axis": -1, "_opset": 13}
    assert node_kwargs(new, {"axis": 0}, 1)["axis"] == 0  # the node's attributes win
    # Conv's kernel does not name every schema attribute it could; nothing it cannot take
    conv = lookup("Conv", "", 11)
    kwargs = node_kwargs(conv, {"strides": [2, 2]}, 1)
    assert kwargs["strides"] == [2, 2] and kwargs["auto_pad"] == "NOTSET"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):  # function-level imports count too
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


@pytest.mark.parametrize(
    "package,forbidden",
    [
        ("ir", ("tensorkiln.kernels", "tensorkiln.ops", "tensorkiln.passes", "tensorkiln.runtime")),
        ("ops", ("tensorkiln.kernels", "tensorkiln.passes", "tensorkiln.runtime")),
    ],
)
def test_ir_and_ops_import_nothing_above_them(package, forbidden):
    for path in sorted((SRC / package).glob("*.py")):
        bad = [m for m in _imports(path) if m.startswith(forbidden)]
        assert not bad, f"{path.name} imports {bad}"

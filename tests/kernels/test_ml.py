"""ai.onnx.ml reference kernels against onnxruntime on fresh random inputs and random forests."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from tests.kernels.ort_oracle import one_node_model, run_kernel, run_ort

ML = "ai.onnx.ml"


def check_ml(op, inputs, attrs, *, ml_opset=3, n_outputs=1, rtol=1e-5, atol=1e-6):
    """Run an ai.onnx.ml node in onnxruntime and through the kernel; compare every output."""
    model = one_node_model(op, inputs, attrs, n_outputs=n_outputs, opset=21, domain=ML)
    for o in model.opset_import:
        if o.domain == ML:
            o.version = ml_opset
    expected = run_ort(model, inputs)
    kernel_attrs = {
        k: numpy_helper.to_array(v) if hasattr(v, "dims") else v for k, v in (attrs or {}).items()
    }
    got = run_kernel(op, inputs, kernel_attrs, n_outputs=n_outputs, opset=ml_opset, domain=ML)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape and g.dtype == e.dtype, (i, g.shape, e.shape, g.dtype, e.dtype)
        if e.dtype.kind == "f":
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol, err_msg=f"{op} output {i}")
        else:
            np.testing.assert_array_equal(g, e, err_msg=f"{op} output {i}")
    return got


def test_label_encoder_v2_mappings():
    rng = np.random.default_rng()
    words = ["a", "b", "c", "d", "e"]
    x = np.array(rng.choice(words, size=(3, 4)).tolist(), dtype=object)
    attrs = {"keys_strings": ["a", "c", "e"], "values_int64s": list(rng.integers(0, 9, 3))}
    check_ml("LabelEncoder", {"X": x}, attrs, ml_opset=2)
    keys = list(rng.integers(0, 20, 6).astype(float))
    xi = rng.integers(0, 20, size=(10,)).astype(np.int64)
    attrs = {"keys_int64s": [int(k) for k in dict.fromkeys(keys)], "values_floats": None}
    attrs["values_floats"] = list(rng.standard_normal(len(attrs["keys_int64s"])))
    attrs["default_float"] = 0.5
    check_ml("LabelEncoder", {"X": xi}, attrs, ml_opset=2)
    xf = rng.choice([0.5, 1.5, 2.5, -1.0], size=7).astype(np.float32)
    attrs = {"keys_floats": [0.5, 2.5], "values_strings": ["lo", "hi"], "default_string": "?"}
    check_ml("LabelEncoder", {"X": xf}, attrs, ml_opset=2)


def test_label_encoder_v4_tensors():
    rng = np.random.default_rng()
    keys = np.array([3, 7, 11], dtype=np.int64)
    attrs = {
        "keys_tensor": numpy_helper.from_array(keys),
        "values_tensor": numpy_helper.from_array(rng.standard_normal(3)),
        "default_tensor": numpy_helper.from_array(np.array([-2.0])),
    }
    x = rng.choice([3, 7, 11, 5], size=(2, 5)).astype(np.int64)
    check_ml("LabelEncoder", {"X": x}, attrs, ml_opset=4)


def test_label_encoder_v1():
    classes = ["x", "y", "z"]
    rng = np.random.default_rng()
    x = np.array(rng.choice(["x", "y", "z", "w"], size=6).tolist(), dtype=object)
    got = run_kernel("LabelEncoder", {"X": x}, {"classes_strings": classes}, opset=1, domain=ML)
    assert got[0].tolist() == [classes.index(s) if s in classes else -1 for s in x]
    back = run_kernel(
        "LabelEncoder", {"X": got[0]}, {"classes_strings": classes}, opset=1, domain=ML
    )
    assert back[0].tolist() == [s if s in classes else "_Unused" for s in x]


def test_simple_transforms():
    rng = np.random.default_rng()
    x = rng.standard_normal((4, 5)).astype(np.float32)
    check_ml("Binarizer", {"X": x}, {"threshold": float(rng.uniform(-0.5, 0.5))}, ml_opset=1)
    idx = rng.integers(0, 5, size=3).astype(np.int64)
    check_ml("ArrayFeatureExtractor", {"X": x, "Y": idx}, {}, ml_opset=1)
    check_ml("ArrayFeatureExtractor", {"X": x[0], "Y": idx}, {}, ml_opset=1)
    for norm in ["MAX", "L1", "L2"]:
        check_ml("Normalizer", {"X": x}, {"norm": norm}, ml_opset=1)
    attrs = {"offset": list(rng.standard_normal(5)), "scale": list(rng.uniform(0.5, 2, 5))}
    check_ml("Scaler", {"X": x}, attrs, ml_opset=1)
    xm = np.where(rng.random(x.shape) < 0.3, np.nan, x).astype(np.float32)
    attrs = {"imputed_value_floats": list(rng.standard_normal(5)), "replaced_value_float": np.nan}
    check_ml("Imputer", {"X": xm}, attrs, ml_opset=1)


# ----------------------------------------------------------------------------- random forests

BRANCHES = ["BRANCH_LEQ", "BRANCH_LT", "BRANCH_GTE", "BRANCH_GT", "BRANCH_EQ", "BRANCH_NEQ"]


def _random_tree(rng, n_features, depth):
    """Nodes of one tree as dicts, node 0 the root; leaves have mode LEAF."""
    nodes = []

    def grow(d):
        i = len(nodes)
        nodes.append({})
        if d == depth or (d > 0 and rng.random() < 0.25):
            nodes[i] = {"mode": "LEAF", "feature": 0, "value": 0.0, "true": 0, "false": 0}
            return i
        mode = str(rng.choice(BRANCHES))
        value = float(rng.choice([0.0, 0.5, -0.5])) if "EQ" in mode else float(rng.normal())
        t, f = grow(d + 1), grow(d + 1)
        nodes[i] = {"mode": mode, "feature": int(rng.integers(n_features)), "value": value}
        nodes[i].update({"true": t, "false": f, "missing": int(rng.integers(2))})
        return i

    grow(0)
    return nodes


def _legacy_attrs(rng, n_trees, n_features, n_out, prefix, weight_ids):
    attrs = {k: [] for k in ["nodes_treeids", "nodes_nodeids", "nodes_featureids", "nodes_modes"]}
    attrs.update({k: [] for k in ["nodes_values", "nodes_truenodeids", "nodes_falsenodeids"]})
    attrs["nodes_missing_value_tracks_true"] = []
    for k in ["treeids", "nodeids", "ids", "weights"]:
        attrs[f"{prefix}_{k}"] = []
    for t in range(n_trees):
        tree = _random_tree(rng, n_features, int(rng.integers(1, 5)))
        perm = rng.permutation(len(tree)) + 3  # node ids need not be 0..n-1 nor in order
        # onnxruntime takes the first node listed for a tree as its root; the rest may shuffle
        for i in [0, *(rng.permutation(len(tree) - 1) + 1)]:
            nd = tree[i]
            attrs["nodes_treeids"].append(t)
            attrs["nodes_nodeids"].append(int(perm[i]))
            attrs["nodes_featureids"].append(nd["feature"])
            attrs["nodes_modes"].append(nd["mode"])
            attrs["nodes_values"].append(nd["value"])
            attrs["nodes_truenodeids"].append(int(perm[nd["true"]]) if nd["mode"] != "LEAF" else 0)
            attrs["nodes_falsenodeids"].append(
                int(perm[nd["false"]]) if nd["mode"] != "LEAF" else 0
            )
            attrs["nodes_missing_value_tracks_true"].append(nd.get("missing", 0))
            if nd["mode"] == "LEAF":
                for target in weight_ids(rng, n_out):
                    attrs[f"{prefix}_treeids"].append(t)
                    attrs[f"{prefix}_nodeids"].append(int(perm[i]))
                    attrs[f"{prefix}_ids"].append(int(target))
                    attrs[f"{prefix}_weights"].append(float(rng.normal()))
    return attrs


def _features(rng, n_rows, n_features):
    x = rng.choice([0.0, 0.5, -0.5, np.nan], size=(n_rows, n_features)).astype(np.float32)
    return np.where(rng.random(x.shape) < 0.6, rng.normal(size=x.shape), x).astype(np.float32)


def _some_targets(rng, n_out):
    return rng.choice(n_out, size=int(rng.integers(1, n_out + 1)), replace=False)


@pytest.mark.parametrize("aggregate", ["SUM", "AVERAGE", "MIN", "MAX"])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX", "SOFTMAX_ZERO"])
def test_tree_ensemble_regressor(aggregate, post):
    rng = np.random.default_rng()
    attrs = _legacy_attrs(rng, 5, 4, 3, "target", _some_targets)
    attrs.update(n_targets=3, aggregate_function=aggregate, post_transform=post)
    if rng.random() < 0.5:
        attrs["base_values"] = list(rng.normal(size=3))
    check_ml("TreeEnsembleRegressor", {"X": _features(rng, 40, 4)}, attrs, rtol=1e-4, atol=1e-5)


def test_tree_ensemble_regressor_double_input_and_tensor_attrs():
    rng = np.random.default_rng()
    attrs = _legacy_attrs(rng, 3, 3, 1, "target", lambda r, n: [0])
    attrs["nodes_values_as_tensor"] = numpy_helper.from_array(np.array(attrs.pop("nodes_values")))
    attrs["n_targets"] = 1
    x = _features(rng, 25, 3).astype(np.float64)
    check_ml("TreeEnsembleRegressor", {"X": x}, attrs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("post", ["NONE", "LOGISTIC", "SOFTMAX"])
@pytest.mark.parametrize("strings", [False, True])
def test_tree_ensemble_classifier_multiclass(post, strings):
    rng = np.random.default_rng()
    attrs = _legacy_attrs(rng, 4, 4, 3, "class", _some_targets)
    attrs["post_transform"] = post
    if strings:
        attrs["classlabels_strings"] = ["cat", "dog", "eel"]
    else:
        attrs["classlabels_int64s"] = [10, 20, 30]
    if rng.random() < 0.5:
        attrs["base_values"] = list(rng.normal(size=3))
    check_ml("TreeEnsembleClassifier", {"X": _features(rng, 30, 4)}, attrs, n_outputs=2, rtol=1e-4)


@pytest.mark.parametrize("used", [0, 1])
@pytest.mark.parametrize("post", ["NONE", "LOGISTIC"])
@pytest.mark.parametrize("positive", [False, True])
def test_tree_ensemble_classifier_binary_one_class(used, post, positive):
    rng = np.random.default_rng()
    attrs = _legacy_attrs(rng, 4, 3, 2, "class", lambda r, n: [used])
    if positive:
        attrs["class_weights"] = list(rng.uniform(0, 0.4, len(attrs["class_weights"])))
    attrs.update(classlabels_int64s=[0, 1], post_transform=post)
    check_ml("TreeEnsembleClassifier", {"X": _features(rng, 30, 3)}, attrs, n_outputs=2, rtol=1e-4)


def _v5_attrs(rng, n_trees, n_features, n_targets):
    """TreeEnsemble-5 attributes of random trees (leaves in their own table)."""
    modes = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3}
    modes.update({"BRANCH_EQ": 4, "BRANCH_NEQ": 5})
    a = {k: [] for k in ["feat", "mode", "split", "tn", "fn", "tl", "fl", "miss", "lt", "lw"]}
    roots = []
    for _ in range(n_trees):
        tree = _random_tree(rng, n_features, int(rng.integers(1, 4)))
        node_pos, leaf_pos = {}, {}
        for i, nd in enumerate(tree):
            if nd["mode"] == "LEAF":
                leaf_pos[i] = len(a["lt"]) + len(leaf_pos)
            else:
                node_pos[i] = len(a["mode"]) + len(node_pos)
        for nd in tree:
            if nd["mode"] == "LEAF":
                a["lt"].append(int(rng.integers(n_targets)))
                a["lw"].append(float(rng.normal()))
        for nd in tree:
            if nd["mode"] == "LEAF":
                continue
            a["feat"].append(nd["feature"])
            a["mode"].append(modes[nd["mode"]])
            a["split"].append(nd["value"])
            a["miss"].append(nd["missing"])
            for side, key, leaf_key in (("true", "tn", "tl"), ("false", "fn", "fl")):
                child = nd[side]
                is_leaf = tree[child]["mode"] == "LEAF"
                a[key].append(leaf_pos[child] if is_leaf else node_pos[child])
                a[leaf_key].append(int(is_leaf))
        roots.append(node_pos[0])
    return {
        "nodes_featureids": a["feat"],
        "nodes_modes": numpy_helper.from_array(np.array(a["mode"], dtype=np.uint8)),
        "nodes_splits": numpy_helper.from_array(np.array(a["split"], dtype=np.float32)),
        "nodes_truenodeids": a["tn"],
        "nodes_falsenodeids": a["fn"],
        "nodes_trueleafs": a["tl"],
        "nodes_falseleafs": a["fl"],
        "nodes_missing_value_tracks_true": a["miss"],
        "leaf_targetids": a["lt"],
        "leaf_weights": numpy_helper.from_array(np.array(a["lw"], dtype=np.float32)),
        "tree_roots": roots,
        "n_targets": n_targets,
    }


@pytest.mark.parametrize("aggregate", [0, 1, 2, 3])
def test_tree_ensemble_v5(aggregate):
    rng = np.random.default_rng()
    attrs = _v5_attrs(rng, 4, 3, 2)
    attrs["aggregate_function"] = aggregate
    check_ml("TreeEnsemble", {"X": _features(rng, 30, 3)}, attrs, ml_opset=5, rtol=1e-4)


def test_tree_ensemble_v5_set_membership():
    # x0 in {1, 3} -> leaf 0 (weight 10), else x0 <= 2 -> leaf 1 (20) else leaf 2 (30)
    attrs = {
        "nodes_featureids": [0, 0],
        "nodes_modes": np.array([6, 0], dtype=np.uint8),
        "nodes_splits": np.array([np.nan, 2.0], dtype=np.float32),
        "nodes_truenodeids": [0, 1],
        "nodes_falsenodeids": [1, 2],
        "nodes_trueleafs": [1, 1],
        "nodes_falseleafs": [0, 1],
        "leaf_targetids": [0, 0, 0],
        "leaf_weights": np.array([10, 20, 30], dtype=np.float32),
        "tree_roots": [0],
        "membership_values": np.array([1, 3, np.nan], dtype=np.float32),
        "n_targets": 1,
    }
    x = np.random.default_rng().choice([0.0, 1.0, 2.0, 3.0, 4.0], size=(12, 1)).astype(np.float32)
    got = run_kernel("TreeEnsemble", {"X": x}, attrs, opset=5, domain=ML)[0]
    expected = np.where(np.isin(x, [1, 3]), 10, np.where(x <= 2, 20, 30)).astype(np.float32)
    np.testing.assert_array_equal(got, expected)

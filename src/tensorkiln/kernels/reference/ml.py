"""Operators of the ``ai.onnx.ml`` domain: encoders, simple transforms and tree ensembles.

Tree ensembles are evaluated for all rows and all trees at once: a [rows, trees] array of current
node indices advances one level per step until every entry sits on a leaf.
"""

from __future__ import annotations

import math

import numpy as np

from tensorkiln.kernels.registry import register

ML = "ai.onnx.ml"


def _str_list(values: object) -> list:
    """Attribute strings may arrive as bytes (from TENSOR attributes); make them str."""
    return [v.decode() if isinstance(v, bytes) else v for v in np.asarray(values).reshape(-1)]


# ----------------------------------------------------------------------------- LabelEncoder


def _lookup(X: np.ndarray, keys: np.ndarray, values: np.ndarray, default: object) -> np.ndarray:
    """``values[i]`` where ``X == keys[i]``, else ``default`` (NaN keys match NaN inputs)."""
    out_dtype = values.dtype
    if X.dtype == object or keys.dtype == object:
        table = dict(zip(_str_list(keys), values.tolist()))
        flat = [table.get(x, default) for x in X.reshape(-1)]
        return np.array(flat, dtype=out_dtype).reshape(X.shape)
    order = np.argsort(keys, kind="stable")
    skeys, svalues = keys[order], values[order]
    pos = np.searchsorted(skeys, X).clip(0, max(len(skeys) - 1, 0))
    found = skeys[pos] == X if len(skeys) else np.zeros(X.shape, bool)
    if X.dtype.kind == "f":
        nan_keys = np.flatnonzero(np.isnan(skeys))
        if len(nan_keys):
            found |= np.isnan(X)
            pos = np.where(np.isnan(X), nan_keys[0], pos)
    out = np.full(X.shape, default, dtype=out_dtype)
    out[found] = svalues[pos[found]]
    return out


def _label_encoder_1(
    X: np.ndarray, classes_strings: list[str] | None, default_int64: int, default_string: str
) -> np.ndarray:
    """LabelEncoder-1: strings to their index in ``classes_strings``, or int64 indexes back."""
    classes = np.array(classes_strings or [], dtype=object)
    if X.dtype == object:
        return _lookup(X, classes, np.arange(len(classes), dtype=np.int64), default_int64)
    valid = (X >= 0) & (len(classes) > X)
    out = np.full(X.shape, default_string, dtype=object)
    out[valid] = classes[X[valid]]
    return out


def _label_encoder_keys(X: np.ndarray, keys_floats, keys_int64s, keys_strings, keys_tensor):
    given = [k for k in (keys_floats, keys_int64s, keys_strings, keys_tensor) if k is not None]
    if len(given) != 1:
        raise ValueError("LabelEncoder: exactly one of the keys_* attributes must be given.")
    if keys_tensor is not None:
        k = np.asarray(keys_tensor).reshape(-1)
        return np.array(_str_list(k), dtype=object) if k.dtype.kind in "OSU" else k
    if keys_strings is not None:
        return np.array(keys_strings, dtype=object)
    return np.asarray(keys_floats, np.float32) if keys_int64s is None else np.asarray(keys_int64s)


@register("LabelEncoder", domain=ML, since=1)
def label_encoder(
    X: np.ndarray,
    *,
    classes_strings: list[str] | None = None,
    keys_floats: list[float] | None = None,
    keys_int64s: list[int] | None = None,
    keys_strings: list[str] | None = None,
    keys_tensor: np.ndarray | None = None,
    values_floats: list[float] | None = None,
    values_int64s: list[int] | None = None,
    values_strings: list[str] | None = None,
    values_tensor: np.ndarray | None = None,
    default_float: float = -0.0,
    default_int64: int = -1,
    default_string: str = "_Unused",
    default_tensor: np.ndarray | None = None,
    _opset: int = 4,
) -> np.ndarray:
    """Map each element of X through keys -> values, else the default (LabelEncoder-2/4);
    LabelEncoder-1 maps strings to their index in ``classes_strings`` and indexes back."""
    if _opset < 2:
        return _label_encoder_1(X, classes_strings, default_int64, default_string)
    keys = _label_encoder_keys(X, keys_floats, keys_int64s, keys_strings, keys_tensor)
    if values_tensor is not None:
        values = np.asarray(values_tensor).reshape(-1)
        if values.dtype.kind in "OSU":
            values = np.array(_str_list(values), dtype=object)
    elif values_strings is not None:
        values = np.array(values_strings, dtype=object)
    elif values_int64s is not None:
        values = np.asarray(values_int64s, dtype=np.int64)
    elif values_floats is not None:
        values = np.asarray(values_floats, dtype=np.float32)
    else:
        raise ValueError("LabelEncoder: one of the values_* attributes must be given.")
    if len(keys) != len(values):
        raise ValueError(f"LabelEncoder: {len(keys)} keys but {len(values)} values.")
    if default_tensor is not None:
        default = _str_list(default_tensor)[0]
    elif values.dtype == object:
        default = default_string
    elif values.dtype.kind == "f":
        default = default_float
    else:
        default = default_int64
    return _lookup(X, keys, values, default)


# ----------------------------------------------------------------------------- simple transforms


@register("Binarizer", domain=ML, since=1)
def binarizer(X: np.ndarray, *, threshold: float = 0.0) -> np.ndarray:
    """1 where X > threshold, else 0, in X's type."""
    return (threshold < X).astype(X.dtype)


@register("ArrayFeatureExtractor", domain=ML, since=1)
def array_feature_extractor(X: np.ndarray, Y: np.ndarray) -> np.ndarray:
    """The elements of X at indexes Y along its last axis ([1, len(Y)] for a 1-D X)."""
    idx = np.asarray(Y, dtype=np.int64).reshape(-1)
    last = X.shape[-1]
    if ((idx < 0) | (idx >= last)).any():
        raise ValueError(f"ArrayFeatureExtractor: indexes {idx} out of range for size {last}.")
    out = X[..., idx]
    return out.reshape(1, -1) if X.ndim == 1 else out


@register("Normalizer", domain=ML, since=1)
def normalizer(X: np.ndarray, *, norm: str = "MAX") -> np.ndarray:
    """Scale each row of X by its MAX, L1 or L2 norm (float32 output)."""
    x = np.atleast_2d(X).astype(np.float32)
    if norm == "MAX":
        scale = x.max(axis=1, keepdims=True)
    elif norm == "L1":
        scale = np.abs(x).sum(axis=1, keepdims=True)
    elif norm == "L2":
        scale = np.sqrt((x * x).sum(axis=1, keepdims=True))
    else:
        raise ValueError(f"Normalizer: norm must be MAX, L1 or L2, got {norm!r}.")
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(scale != 0, x / scale, x)
    return out.reshape(X.shape) if X.ndim == 1 else out


@register("Scaler", domain=ML, since=1)
def scaler(
    X: np.ndarray, *, offset: list[float] | None = None, scale: list[float] | None = None
) -> np.ndarray:
    """(X - offset) * scale, broadcast along the last axis (float32 output)."""
    off = np.asarray(offset if offset is not None else [0.0], np.float32)
    sc = np.asarray(scale if scale is not None else [1.0], np.float32)
    return ((X.astype(np.float32) - off) * sc).astype(np.float32)


@register("Imputer", domain=ML, since=1)
def imputer(
    X: np.ndarray,
    *,
    imputed_value_floats: list[float] | None = None,
    imputed_value_int64s: list[int] | None = None,
    replaced_value_float: float = 0.0,
    replaced_value_int64: int = 0,
) -> np.ndarray:
    """Replace the missing marker (NaN or ``replaced_value_*``) by per-feature imputed values."""
    if X.dtype.kind == "f":
        fill = np.asarray(imputed_value_floats or [], dtype=X.dtype)
        missing = np.isnan(X) if np.isnan(replaced_value_float) else replaced_value_float == X
    else:
        fill = np.asarray(imputed_value_int64s or [], dtype=X.dtype)
        missing = replaced_value_int64 == X
    if fill.size not in (1, X.shape[-1]):
        raise ValueError(
            f"Imputer: {fill.size} imputed values for {X.shape[-1]} features; give 1 or one each."
        )
    return np.where(missing, np.broadcast_to(fill, X.shape), X)


# ----------------------------------------------------------------------------- post transforms


def _erfinv(x: np.ndarray) -> np.ndarray:
    # Winitzki's approximation, the one onnxruntime uses for PROBIT (so results agree with it)
    sgn = np.where(x < 0, -1.0, 1.0)
    ln = np.log((1 - x) * (1 + x))
    v = 2 / (np.pi * 0.147) + 0.5 * ln
    return sgn * np.sqrt(-v + np.sqrt(v * v - ln / 0.147))


def _post_transform(scores: np.ndarray, kind: str) -> np.ndarray:
    if kind == "NONE":
        return scores
    if kind == "LOGISTIC":
        return 1 / (1 + np.exp(-scores))
    if kind == "PROBIT":
        return np.sqrt(2) * _erfinv(2 * scores - 1)
    if kind in ("SOFTMAX", "SOFTMAX_ZERO"):
        e = np.exp(scores - scores.max(axis=1, keepdims=True))
        if kind == "SOFTMAX_ZERO":
            e = np.where(scores == 0, 0, e)
        total = e.sum(axis=1, keepdims=True)
        return np.divide(e, total, out=np.zeros_like(e), where=total != 0)
    raise ValueError(f"unknown post_transform {kind!r}.")


# ----------------------------------------------------------------------------- tree traversal

_MODES = {"BRANCH_LEQ": 0, "BRANCH_LT": 1, "BRANCH_GTE": 2, "BRANCH_GT": 3}
_MODES.update({"BRANCH_EQ": 4, "BRANCH_NEQ": 5, "BRANCH_MEMBER": 6, "LEAF": 7})


class _Forest:
    """Flat node arrays of a tree ensemble; children index into the same arrays unless they are
    leaves, whose index then refers to the leaf table."""

    def __init__(self, feature, mode, split, true_next, false_next, true_leaf, false_leaf,
                 missing_true, roots, root_leaf, members=None):  # fmt: skip
        self.feature = np.asarray(feature, dtype=np.int64)
        self.mode = np.asarray(mode, dtype=np.int64)
        self.split = np.asarray(split, dtype=np.float64)
        self.true_next, self.false_next = np.asarray(true_next), np.asarray(false_next)
        self.true_leaf = np.asarray(true_leaf, dtype=bool)
        self.false_leaf = np.asarray(false_leaf, dtype=bool)
        self.missing_true = np.asarray(missing_true, dtype=bool)
        self.roots, self.root_leaf = np.asarray(roots), np.asarray(root_leaf, dtype=bool)
        self.members = members  # [node, max set size] NaN-padded, for BRANCH_MEMBER nodes

    def _go_true(self, x: np.ndarray, node: np.ndarray) -> np.ndarray:
        m, t = self.mode[node], self.split[node]
        tests = [x <= t, x < t, x >= t, x > t, x == t, x != t]
        res = np.select([m == k for k in range(6)], tests, default=False)
        member = m == 6
        if member.any():
            table = self.members[node[member]]
            res[member] = (table == x[member, None]).any(axis=1)
        return res | (self.missing_true[node] & np.isnan(x))

    def leaves(self, X: np.ndarray) -> np.ndarray:
        """The leaf reached by every row in every tree, as a [rows, trees] index array."""
        X = np.asarray(X, dtype=np.float64)
        X = X.reshape(len(X), math.prod(X.shape[1:]))  # not -1: zero rows leave it ambiguous
        cur = np.tile(self.roots, (len(X), 1))
        done = np.tile(self.root_leaf, (len(X), 1))
        for _ in range(len(self.mode) + 1):
            r, t = np.nonzero(~done)
            if not len(r):
                return cur
            node = cur[r, t]
            go = self._go_true(X[r, self.feature[node]], node)
            cur[r, t] = np.where(go, self.true_next[node], self.false_next[node])
            done[r, t] = np.where(go, self.true_leaf[node], self.false_leaf[node])
        raise ValueError("tree ensemble: the node links contain a cycle.")


def _member_table(modes: np.ndarray, membership_values: np.ndarray | None) -> np.ndarray | None:
    """Sets of BRANCH_MEMBER nodes, in node order, from the NaN-separated membership_values."""
    is_member = modes == 6
    if not is_member.any():
        return None
    if membership_values is None:
        raise ValueError("TreeEnsemble: set membership nodes need 'membership_values'.")
    vals = np.asarray(membership_values, dtype=np.float64).reshape(-1)
    sets = np.split(vals, np.flatnonzero(np.isnan(vals)) + 1)
    sets = [s[~np.isnan(s)] for s in sets][: int(is_member.sum())]
    if len(sets) != is_member.sum():
        raise ValueError("TreeEnsemble: membership_values must hold one set per member node.")
    table = np.full((len(modes), max(len(s) for s in sets) or 1), np.nan)
    for node, s in zip(np.flatnonzero(is_member), sets):
        table[node, : len(s)] = s
    return table


_AGGREGATES = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}
_TRANSFORMS = {0: "NONE", 1: "SOFTMAX", 2: "LOGISTIC", 3: "SOFTMAX_ZERO", 4: "PROBIT"}


def _aggregate(values: np.ndarray, has: np.ndarray, how: str) -> np.ndarray:
    """Combine per-tree [rows, trees, targets] values; targets no tree scored stay 0."""
    if how in ("SUM", "AVERAGE"):
        total = np.where(has, values, 0).sum(axis=1)
        return total / values.shape[1] if how == "AVERAGE" else total
    if how not in ("MIN", "MAX"):
        raise ValueError(f"aggregate_function must be AVERAGE, SUM, MIN or MAX, got {how!r}.")
    reduce, empty = (np.min, np.inf) if how == "MIN" else (np.max, -np.inf)
    out = reduce(np.where(has, values, empty), axis=1)
    return np.where(has.any(axis=1), out, 0)


@register("TreeEnsemble", domain=ML, since=5)
def tree_ensemble(
    X: np.ndarray,
    *,
    nodes_splits: np.ndarray,
    nodes_featureids: list[int],
    nodes_modes: np.ndarray,
    nodes_truenodeids: list[int],
    nodes_falsenodeids: list[int],
    nodes_trueleafs: list[int],
    nodes_falseleafs: list[int],
    leaf_targetids: list[int],
    leaf_weights: np.ndarray,
    tree_roots: list[int],
    n_targets: int | None = None,
    aggregate_function: int = 1,
    post_transform: int = 0,
    nodes_hitrates: np.ndarray | None = None,
    nodes_missing_value_tracks_true: list[int] | None = None,
    membership_values: np.ndarray | None = None,
) -> np.ndarray:
    """TreeEnsemble-5: [N, F] -> [N, n_targets] in X's type."""
    modes = np.asarray(nodes_modes, dtype=np.int64).reshape(-1)
    n = len(modes)
    roots = np.asarray(tree_roots, dtype=np.int64)
    tl, fl = np.asarray(nodes_trueleafs, bool), np.asarray(nodes_falseleafs, bool)
    tn, fn = np.asarray(nodes_truenodeids), np.asarray(nodes_falsenodeids)
    root_leaf = tl[roots] & fl[roots] & (tn[roots] == fn[roots])  # a tree that is one leaf
    missing = nodes_missing_value_tracks_true or [0] * n
    forest = _Forest(nodes_featureids, modes, np.asarray(nodes_splits).reshape(-1), tn, fn, tl, fl,
                     missing, roots, root_leaf, _member_table(modes, membership_values))  # fmt: skip
    reached = forest.leaves(X)
    k = int(n_targets) if n_targets is not None else int(max(leaf_targetids)) + 1
    targets = np.asarray(leaf_targetids, dtype=np.int64)[reached]
    onehot = targets[..., None] == np.arange(k)
    weights = np.asarray(leaf_weights, dtype=np.float64).reshape(-1)[reached]
    scores = _aggregate(
        np.where(onehot, weights[..., None], 0), onehot, _AGGREGATES[aggregate_function]
    )
    return _post_transform(scores, _TRANSFORMS[post_transform]).astype(X.dtype)


# ----------------------------------------------------------------------------- TreeEnsemble-1/3


def _tree_node_index(treeids: np.ndarray, nodeids: np.ndarray):
    """A function mapping (tree id, node id) pairs to positions in the node arrays."""
    width = int(nodeids.max(initial=0)) + 1
    keys = treeids * width + nodeids
    order = np.argsort(keys)

    def find(trees: np.ndarray, nodes: np.ndarray) -> np.ndarray:
        q = np.asarray(trees) * width + np.asarray(nodes)
        pos = order[np.searchsorted(keys[order], q).clip(0, len(keys) - 1)]
        if (keys[pos] != q).any():
            raise ValueError("tree ensemble: a node or target refers to a node id that is missing.")
        return pos

    return find


def _legacy_forest(attrs: dict) -> tuple[_Forest, np.ndarray, object]:
    """The forest of a TreeEnsembleRegressor/Classifier; nodes are their own leaves."""
    trees = np.asarray(attrs["nodes_treeids"], dtype=np.int64)
    nodes = np.asarray(attrs["nodes_nodeids"], dtype=np.int64)
    modes = np.array([_MODES[m] for m in _str_list(attrs["nodes_modes"])], dtype=np.int64)
    find = _tree_node_index(trees, nodes)
    branch = modes != 7
    tn = np.zeros(len(modes), np.int64)
    fn = np.zeros(len(modes), np.int64)
    tn[branch] = find(trees[branch], np.asarray(attrs["nodes_truenodeids"])[branch])
    fn[branch] = find(trees[branch], np.asarray(attrs["nodes_falsenodeids"])[branch])
    children = np.zeros(len(modes), bool)
    children[tn[branch]] = children[fn[branch]] = True
    tree_ids = np.unique(trees)
    roots = np.array([np.flatnonzero((trees == t) & ~children)[0] for t in tree_ids])
    values = attrs.get("nodes_values_as_tensor")
    values = attrs.get("nodes_values") if values is None else values
    missing = attrs.get("nodes_missing_value_tracks_true") or [0] * len(modes)
    forest = _Forest(attrs["nodes_featureids"], modes, values, tn, fn, modes[tn] == 7,
                     modes[fn] == 7, missing, roots, modes[roots] == 7)  # fmt: skip
    return forest, tree_ids, find


def _leaf_scores(X, forest, find, treeids, nodeids, ids, weights, k) -> tuple:
    """Per-tree [rows, trees, k] leaf values and the mask of the targets each leaf scores."""
    leaf = find(np.asarray(treeids, np.int64), np.asarray(nodeids, np.int64))
    table = np.zeros((len(forest.mode), k))
    has = np.zeros((len(forest.mode), k), dtype=bool)
    np.add.at(table, (leaf, np.asarray(ids, np.int64)), np.asarray(weights, np.float64))
    has[leaf, np.asarray(ids, np.int64)] = True
    reached = forest.leaves(X)
    return table[reached], has[reached]


def _tensor_or_list(tensor: np.ndarray | None, values: list[float] | None) -> np.ndarray:
    return np.asarray(tensor if tensor is not None else (values or []), dtype=np.float64)


@register("TreeEnsembleRegressor", domain=ML, since=1)
def tree_ensemble_regressor(
    X: np.ndarray,
    *,
    aggregate_function: str = "SUM",
    base_values: list[float] | None = None,
    base_values_as_tensor: np.ndarray | None = None,
    n_targets: int | None = None,
    post_transform: str = "NONE",
    target_ids: list[int] | None = None,
    target_nodeids: list[int] | None = None,
    target_treeids: list[int] | None = None,
    target_weights: list[float] | None = None,
    target_weights_as_tensor: np.ndarray | None = None,
    **nodes: object,
) -> np.ndarray:
    """TreeEnsembleRegressor: [N, F] -> float32 [N, n_targets]; the ``nodes_*`` attributes
    describe the trees (see the ONNX spec)."""
    forest, _, find = _legacy_forest(nodes)
    k = int(n_targets) if n_targets is not None else int(max(target_ids or [0])) + 1
    weights = _tensor_or_list(target_weights_as_tensor, target_weights)
    values, has = _leaf_scores(X, forest, find, target_treeids, target_nodeids, target_ids,
                               weights, k)  # fmt: skip
    scores = _aggregate(values, has, aggregate_function)
    base = _tensor_or_list(base_values_as_tensor, base_values)
    if len(base):
        # as onnxruntime: a target no reached leaf scores stays 0, without its base value
        scores = np.where(has.any(axis=1), scores + base, 0)
    return _post_transform(scores, post_transform).astype(np.float32)


def _binary_scores(score: np.ndarray, case: np.ndarray, post: str) -> np.ndarray:
    """Two class scores from one (onnxruntime's rule for a binary classifier scoring one class):
    [1 - s, s] when all weights are >= 0 (case 0/1), else [-s, s]; [logistic(-s), logistic(s)]
    with LOGISTIC."""
    if post == "LOGISTIC":
        return np.stack([1 / (1 + np.exp(score)), 1 / (1 + np.exp(-score))], axis=1)
    return np.stack([np.where(case <= 1, 1 - score, -score), score], axis=1)


def _classify_binary(scores, has, base, all_positive, one_class_used, post):
    """The two-class path of onnxruntime's tree classifier (the spec leaves it open)."""
    s0, s1, has1 = scores[:, 0], scores[:, 1], has[:, 1]
    if len(base) == 2:
        new1 = np.where(has1, base[1] + s0, s1 + base[1])
        s0 = np.where(has1, -new1, s0 + base[0])
        s1, has1 = new1, np.ones_like(has1)
    elif len(base) == 1:
        s0 = s0 + base[0]
    pos = np.where(has1, s1, np.where(has[:, 0], s0, 0))
    if one_class_used:
        threshold = 0.5 if all_positive else 0.0
        win = pos > threshold
        case = np.where(win, 0, 1) if all_positive else np.where(win, 2, 3)
    else:
        win = pos > 0
        case = np.full(len(pos), 3 if len(base) == 0 else -1)
    both = np.stack([s0, s1], axis=1)
    if post != "PROBIT" and (case >= 0).all():
        z = np.where(has1[:, None], _post_transform(both, post), _binary_scores(s0, case, post))
    else:
        z = _post_transform(both, post)
    return win, z


@register("TreeEnsembleClassifier", domain=ML, since=1)
def tree_ensemble_classifier(
    X: np.ndarray,
    *,
    base_values: list[float] | None = None,
    base_values_as_tensor: np.ndarray | None = None,
    class_ids: list[int] | None = None,
    class_nodeids: list[int] | None = None,
    class_treeids: list[int] | None = None,
    class_weights: list[float] | None = None,
    class_weights_as_tensor: np.ndarray | None = None,
    classlabels_int64s: list[int] | None = None,
    classlabels_strings: list[str] | None = None,
    post_transform: str = "NONE",
    **nodes: object,
) -> tuple[np.ndarray, np.ndarray]:
    """TreeEnsembleClassifier: [N, F] -> (labels [N], float32 scores [N, classes])."""
    labels = np.array(classlabels_strings, dtype=object) if classlabels_strings else None
    labels = np.asarray(classlabels_int64s, dtype=np.int64) if labels is None else labels
    if labels is None or not len(labels):
        raise ValueError("TreeEnsembleClassifier: give classlabels_int64s or classlabels_strings.")
    forest, _, find = _legacy_forest(nodes)
    weights = _tensor_or_list(class_weights_as_tensor, class_weights)
    values, has = _leaf_scores(X, forest, find, class_treeids, class_nodeids, class_ids, weights,
                               len(labels))  # fmt: skip
    scores, has = np.where(has, values, 0).sum(axis=1), has.any(axis=1)
    base = _tensor_or_list(base_values_as_tensor, base_values)
    if len(labels) > 2:
        if len(base):
            scores, has = scores + base, np.ones_like(has)
        best = np.where(has, scores, -np.inf).argmax(axis=1)
        return labels[best], _post_transform(scores, post_transform).astype(np.float32)
    one_class_used = len(labels) == 2 and len(set(class_ids or [])) == 1
    win, z = _classify_binary(scores, has, base, bool((weights >= 0).all()), one_class_used,
                              post_transform)  # fmt: skip
    return labels[np.where(win, 1, 0)], z.astype(np.float32)

"""Operators of the ``ai.onnx.ml`` domain on the device: encoders, simple transforms, tree
ensembles.

Tree ensembles traverse every tree for every row at once: a [rows, trees] tensor of current node
indices advances one level per step, for as many steps as the deepest tree needs (found on the
host from the attributes, so the loop never waits on the device). The forest's structure is parsed
by the reference's host helpers, from the attributes, and uploaded.

Strings have no torch dtype and live on the host: LabelEncoder-1, string maps of LabelEncoder,
string inputs of ArrayFeatureExtractor and string class labels are computed there (a classifier's
winning class indices are read back to pick its string labels).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from tensorkiln.kernels.cuda.convert import to_numpy, to_torch
from tensorkiln.kernels.cuda.host import register_host
from tensorkiln.kernels.reference import ml as ref
from tensorkiln.kernels.registry import register

ML = "ai.onnx.ml"
Value = torch.Tensor | np.ndarray

# ----------------------------------------------------------------------------- LabelEncoder

# LabelEncoder-1 maps strings to ints and back; LabelEncoder-2+ runs numeric maps on the device
# (registered below, over the host entry of its version) and string maps through this host path.
register_host(
    "LabelEncoder",
    "strings have no device representation: LabelEncoder-1 and string keys or values map on the "
    "host (numeric maps of LabelEncoder-2+ run on the device)",
    domain=ML,
)


def _has_strings(*arrays: Any) -> bool:
    return any(isinstance(a, np.ndarray) and a.dtype.kind in "OSU" for a in arrays)


def _numeric_lookup(
    X: torch.Tensor, keys: np.ndarray, values: np.ndarray, default: Any
) -> torch.Tensor:
    """``values[i]`` where ``X == keys[i]``, else ``default`` (NaN keys match NaN inputs); the
    table is sorted on the host, the lookup is a searchsorted on the device."""
    device = X.device
    out = torch.full(X.shape, default, dtype=to_torch(values[:0], device).dtype, device=device)
    order = np.argsort(keys, kind="stable")
    skeys, svalues = keys[order], values[order]
    is_nan = np.isnan(skeys) if skeys.dtype.kind == "f" else np.zeros(len(skeys), bool)
    nan_value = svalues[np.flatnonzero(is_nan)[0]] if is_nan.any() else None
    skeys, svalues = skeys[~is_nan], svalues[~is_nan]
    if len(skeys):
        common = torch.promote_types(X.dtype, to_torch(skeys[:0], device).dtype)
        table = to_torch(skeys, device).to(common)
        x = X.to(common).contiguous()
        pos = torch.searchsorted(table, x).clamp(0, len(skeys) - 1)
        found = table[pos] == x
        out = torch.where(found, to_torch(svalues, device)[pos], out)
    if nan_value is not None and X.is_floating_point():
        out = torch.where(torch.isnan(X), torch.full((), nan_value.item(), dtype=out.dtype,
                                                     device=device), out)  # fmt: skip
    return out


def _label_values(values_floats, values_int64s, values_strings, values_tensor) -> np.ndarray:
    if values_tensor is not None:
        values = np.asarray(values_tensor).reshape(-1)
        if values.dtype.kind in "OSU":
            values = np.array(ref._str_list(values), dtype=object)
        return values
    if values_strings is not None:
        return np.array(values_strings, dtype=object)
    if values_int64s is not None:
        return np.asarray(values_int64s, dtype=np.int64)
    if values_floats is not None:
        return np.asarray(values_floats, dtype=np.float32)
    raise ValueError("LabelEncoder: one of the values_* attributes must be given.")


@register("LabelEncoder", domain=ML, since=2, backend="cuda")
def label_encoder(
    X: Value,
    *,
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
) -> Value:
    """LabelEncoder-2/4: map each element of X through keys -> values, else the default."""
    attrs = dict(locals())
    del attrs["X"]
    keys = ref._label_encoder_keys(X, keys_floats, keys_int64s, keys_strings, keys_tensor)
    values = _label_values(values_floats, values_int64s, values_strings, values_tensor)
    if isinstance(X, np.ndarray) or _has_strings(keys, values):  # strings: on the host
        device = X.device if isinstance(X, torch.Tensor) else None
        out = ref.label_encoder(to_numpy(X), **attrs)
        return out if out.dtype == object or device is None else to_torch(out, device)
    if len(keys) != len(values):
        raise ValueError(f"LabelEncoder: {len(keys)} keys but {len(values)} values.")
    if default_tensor is not None:
        default = np.asarray(default_tensor).reshape(-1)[0].item()
    elif values.dtype.kind == "f":
        default = default_float
    else:
        default = default_int64
    return _numeric_lookup(X, keys, values, default)


# ----------------------------------------------------------------------------- simple transforms


@register("Binarizer", domain=ML, since=1, backend="cuda")
def binarizer(X: torch.Tensor, *, threshold: float = 0.0) -> torch.Tensor:
    """1 where X > threshold, else 0, in X's type."""
    return (threshold < X).to(X.dtype)


@register("ArrayFeatureExtractor", domain=ML, since=1, backend="cuda")
def array_feature_extractor(X: Value, Y: torch.Tensor) -> Value:
    """The elements of X at indexes Y along its last axis ([1, len(Y)] for a 1-D X)."""
    if isinstance(X, np.ndarray):  # strings live on the host
        return ref.array_feature_extractor(X, to_numpy(Y))
    idx = Y.reshape(-1).to(device=X.device, dtype=torch.int64)
    out = X.index_select(X.dim() - 1, idx)  # raises on an index out of range
    return out.reshape(1, -1) if X.dim() == 1 else out


@register("Normalizer", domain=ML, since=1, backend="cuda")
def normalizer(X: torch.Tensor, *, norm: str = "MAX") -> torch.Tensor:
    """Scale each row of X by its MAX, L1 or L2 norm (float32 output)."""
    x = torch.atleast_2d(X).to(torch.float32)
    if norm == "MAX":
        scale = x.amax(dim=1, keepdim=True)
    elif norm == "L1":
        scale = x.abs().sum(dim=1, keepdim=True)
    elif norm == "L2":
        scale = torch.sqrt((x * x).sum(dim=1, keepdim=True))
    else:
        raise ValueError(f"Normalizer: norm must be MAX, L1 or L2, got {norm!r}.")
    out = torch.where(scale != 0, x / scale, x)
    return out.reshape(X.shape) if X.dim() == 1 else out


@register("Scaler", domain=ML, since=1, backend="cuda")
def scaler(
    X: torch.Tensor, *, offset: list[float] | None = None, scale: list[float] | None = None
) -> torch.Tensor:
    """(X - offset) * scale, broadcast along the last axis (float32 output)."""
    f32 = {"dtype": torch.float32, "device": X.device}
    off = torch.tensor(offset if offset is not None else [0.0], **f32)
    sc = torch.tensor(scale if scale is not None else [1.0], **f32)
    return (X.to(torch.float32) - off) * sc


@register("Imputer", domain=ML, since=1, backend="cuda")
def imputer(
    X: torch.Tensor,
    *,
    imputed_value_floats: list[float] | None = None,
    imputed_value_int64s: list[int] | None = None,
    replaced_value_float: float = 0.0,
    replaced_value_int64: int = 0,
) -> torch.Tensor:
    """Replace the missing marker (NaN or ``replaced_value_*``) by per-feature imputed values."""
    if X.is_floating_point():
        fill = torch.tensor(imputed_value_floats or [], dtype=X.dtype, device=X.device)
        if np.isnan(replaced_value_float):
            missing = torch.isnan(X)
        else:
            missing = replaced_value_float == X
    else:
        fill = torch.tensor(imputed_value_int64s or [], dtype=X.dtype, device=X.device)
        missing = replaced_value_int64 == X
    if fill.numel() not in (1, X.shape[-1]):
        raise ValueError(
            f"Imputer: {fill.numel()} imputed values for {X.shape[-1]} features; give 1 or one "
            "each."
        )
    return torch.where(missing, fill.expand(X.shape), X)


# ----------------------------------------------------------------------------- post transforms


def _erfinv(x: torch.Tensor) -> torch.Tensor:
    # Winitzki's approximation, the one onnxruntime uses for PROBIT (so results agree with it)
    sgn = torch.where(x < 0, -1.0, 1.0).to(x.dtype)
    ln = torch.log((1 - x) * (1 + x))
    v = 2 / (np.pi * 0.147) + 0.5 * ln
    return sgn * torch.sqrt(-v + torch.sqrt(v * v - ln / 0.147))


def _post_transform(scores: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "NONE":
        return scores
    if kind == "LOGISTIC":
        return 1 / (1 + torch.exp(-scores))
    if kind == "PROBIT":
        return np.sqrt(2) * _erfinv(2 * scores - 1)
    if kind in ("SOFTMAX", "SOFTMAX_ZERO"):
        if not scores.shape[1]:
            return scores
        e = torch.exp(scores - scores.amax(dim=1, keepdim=True))
        if kind == "SOFTMAX_ZERO":
            e = torch.where(scores == 0, torch.zeros_like(e), e)
        total = e.sum(dim=1, keepdim=True)
        return torch.where(total != 0, e / torch.where(total != 0, total, 1), 0).to(e.dtype)
    raise ValueError(f"unknown post_transform {kind!r}.")


# ----------------------------------------------------------------------------- tree traversal


def _depth(forest: ref._Forest) -> int:
    """How many steps the deepest tree needs (a host walk over the attributes)."""
    tn, fn = np.asarray(forest.true_next, np.int64), np.asarray(forest.false_next, np.int64)
    frontier = np.unique(np.asarray(forest.roots, np.int64)[~forest.root_leaf])
    depth = 0
    while len(frontier):
        depth += 1
        if depth > len(forest.mode):
            raise ValueError("tree ensemble: the node links contain a cycle.")
        nxt = [
            tn[frontier][~forest.true_leaf[frontier]],
            fn[frontier][~forest.false_leaf[frontier]],
        ]
        frontier = np.unique(np.concatenate(nxt))
    return depth


class _DeviceForest:
    """A forest's node arrays on the device."""

    def __init__(self, forest: ref._Forest, device: torch.device) -> None:
        self.depth = _depth(forest)

        def up(a: Any, dtype: np.dtype) -> torch.Tensor:
            return to_torch(np.ascontiguousarray(np.asarray(a, dtype=dtype)), device)

        self.feature = up(forest.feature, np.int64)
        self.mode = up(forest.mode, np.int64)
        self.split = up(forest.split, np.float64)
        self.true_next = up(forest.true_next, np.int64)
        self.false_next = up(forest.false_next, np.int64)
        self.true_leaf = up(forest.true_leaf, np.bool_)
        self.false_leaf = up(forest.false_leaf, np.bool_)
        self.missing_true = up(forest.missing_true, np.bool_)
        self.roots = up(forest.roots, np.int64)
        self.root_leaf = up(forest.root_leaf, np.bool_)
        self.members = None if forest.members is None else up(forest.members, np.float64)

    def _go_true(self, x: torch.Tensor, node: torch.Tensor) -> torch.Tensor:
        m, t = self.mode[node], self.split[node]
        res = (
            ((m == 0) & (x <= t))
            | ((m == 1) & (x < t))
            | ((m == 2) & (x >= t))
            | ((m == 3) & (x > t))
            | ((m == 4) & (x == t))
            | ((m == 5) & (x != t))
        )
        if self.members is not None:
            hit = (self.members[node] == x.unsqueeze(-1)).any(dim=-1)
            res = res | ((m == 6) & hit)
        return res | (self.missing_true[node] & torch.isnan(x))

    def leaves(self, X: torch.Tensor) -> torch.Tensor:
        """The leaf reached by every row in every tree, as a [rows, trees] index tensor."""
        X = X.to(torch.float64).reshape(X.shape[0], math.prod(X.shape[1:]))
        rows, trees = X.shape[0], self.roots.shape[0]
        cur = self.roots.expand(rows, trees)
        done = self.root_leaf.expand(rows, trees)
        for _ in range(self.depth):
            node = torch.where(done, 0, cur)  # a finished entry may hold a leaf-table index
            x = X.gather(1, self.feature[node])
            go = self._go_true(x, node)
            nxt = torch.where(go, self.true_next[node], self.false_next[node])
            leaf = torch.where(go, self.true_leaf[node], self.false_leaf[node])
            cur = torch.where(done, cur, nxt)
            done = done | leaf
        return cur


def _aggregate(values: torch.Tensor, has: torch.Tensor, how: str) -> torch.Tensor:
    """Combine per-tree [rows, trees, targets] values; targets no tree scored stay 0."""
    zero = torch.zeros((), dtype=values.dtype, device=values.device)
    if how in ("SUM", "AVERAGE"):
        total = torch.where(has, values, zero).sum(dim=1)
        return total / values.shape[1] if how == "AVERAGE" else total
    if how not in ("MIN", "MAX"):
        raise ValueError(f"aggregate_function must be AVERAGE, SUM, MIN or MAX, got {how!r}.")
    empty = torch.full((), np.inf if how == "MIN" else -np.inf, dtype=values.dtype,
                       device=values.device)  # fmt: skip
    masked = torch.where(has, values, empty)
    if not values.shape[1]:
        return masked.sum(dim=1)  # no trees: zeros of the right shape
    out = masked.amin(dim=1) if how == "MIN" else masked.amax(dim=1)
    return torch.where(has.any(dim=1), out, zero)


_AGGREGATES = {0: "AVERAGE", 1: "SUM", 2: "MIN", 3: "MAX"}
_TRANSFORMS = {0: "NONE", 1: "SOFTMAX", 2: "LOGISTIC", 3: "SOFTMAX_ZERO", 4: "PROBIT"}


@register("TreeEnsemble", domain=ML, since=5, backend="cuda")
def tree_ensemble(
    X: torch.Tensor,
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
) -> torch.Tensor:
    """TreeEnsemble-5: [N, F] -> [N, n_targets] in X's type."""
    modes = np.asarray(nodes_modes, dtype=np.int64).reshape(-1)
    n = len(modes)
    roots = np.asarray(tree_roots, dtype=np.int64)
    tl, fl = np.asarray(nodes_trueleafs, bool), np.asarray(nodes_falseleafs, bool)
    tn, fn = np.asarray(nodes_truenodeids), np.asarray(nodes_falsenodeids)
    root_leaf = tl[roots] & fl[roots] & (tn[roots] == fn[roots])  # a tree that is one leaf
    missing = nodes_missing_value_tracks_true or [0] * n
    forest = ref._Forest(nodes_featureids, modes, np.asarray(nodes_splits).reshape(-1), tn, fn,
                         tl, fl, missing, roots, root_leaf,
                         ref._member_table(modes, membership_values))  # fmt: skip
    device = X.device
    reached = _DeviceForest(forest, device).leaves(X)
    k = int(n_targets) if n_targets is not None else int(max(leaf_targetids)) + 1
    targets = to_torch(np.asarray(leaf_targetids, dtype=np.int64), device)[reached]
    onehot = targets.unsqueeze(-1) == torch.arange(k, device=device)
    weights = to_torch(np.asarray(leaf_weights, dtype=np.float64).reshape(-1), device)[reached]
    values = torch.where(onehot, weights.unsqueeze(-1), 0.0)
    scores = _aggregate(values, onehot, _AGGREGATES[aggregate_function])
    return _post_transform(scores, _TRANSFORMS[post_transform]).to(X.dtype)


# ----------------------------------------------------------------------------- TreeEnsemble-1/3


def _leaf_scores(X, forest, find, treeids, nodeids, ids, weights, k) -> tuple:
    """Per-tree [rows, trees, k] leaf values and the mask of the targets each leaf scores."""
    leaf = find(np.asarray(treeids, np.int64), np.asarray(nodeids, np.int64))
    table = np.zeros((len(forest.mode), k))
    has = np.zeros((len(forest.mode), k), dtype=bool)
    np.add.at(table, (leaf, np.asarray(ids, np.int64)), np.asarray(weights, np.float64))
    has[leaf, np.asarray(ids, np.int64)] = True
    reached = _DeviceForest(forest, X.device).leaves(X)
    return to_torch(table, X.device)[reached], to_torch(has, X.device)[reached]


def _base(tensor: np.ndarray | None, values: list[float] | None, device) -> torch.Tensor:
    return to_torch(ref._tensor_or_list(tensor, values), device)


@register("TreeEnsembleRegressor", domain=ML, since=1, backend="cuda")
def tree_ensemble_regressor(
    X: torch.Tensor,
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
) -> torch.Tensor:
    """TreeEnsembleRegressor: [N, F] -> float32 [N, n_targets]."""
    forest, _, find = ref._legacy_forest(nodes)
    k = int(n_targets) if n_targets is not None else int(max(target_ids or [0])) + 1
    weights = ref._tensor_or_list(target_weights_as_tensor, target_weights)
    values, has = _leaf_scores(X, forest, find, target_treeids, target_nodeids, target_ids,
                               weights, k)  # fmt: skip
    scores = _aggregate(values, has, aggregate_function)
    base = _base(base_values_as_tensor, base_values, X.device)
    if len(base):
        # as onnxruntime: a target no reached leaf scores stays 0, without its base value
        scores = torch.where(has.any(dim=1), scores + base, 0.0)
    return _post_transform(scores, post_transform).to(torch.float32)


def _binary_scores(score: torch.Tensor, case: torch.Tensor, post: str) -> torch.Tensor:
    """Two class scores from one (onnxruntime's rule for a binary classifier scoring one class):
    [1 - s, s] when all weights are >= 0 (case 0/1), else [-s, s]; [logistic(-s), logistic(s)]
    with LOGISTIC."""
    if post == "LOGISTIC":
        return torch.stack([1 / (1 + torch.exp(score)), 1 / (1 + torch.exp(-score))], dim=1)
    return torch.stack([torch.where(case <= 1, 1 - score, -score), score], dim=1)


def _classify_binary(scores, has, base, all_positive, one_class_used, post):
    """The two-class path of onnxruntime's tree classifier (the spec leaves it open)."""
    s0, s1, has1 = scores[:, 0], scores[:, 1], has[:, 1]
    if len(base) == 2:
        new1 = torch.where(has1, base[1] + s0, s1 + base[1])
        s0 = torch.where(has1, -new1, s0 + base[0])
        s1, has1 = new1, torch.ones_like(has1)
    elif len(base) == 1:
        s0 = s0 + base[0]
    zero = torch.zeros((), dtype=s0.dtype, device=s0.device)
    pos = torch.where(has1, s1, torch.where(has[:, 0], s0, zero))
    if one_class_used:
        threshold = 0.5 if all_positive else 0.0
        win = pos > threshold
        case = torch.where(win, 0, 1) if all_positive else torch.where(win, 2, 3)
        every_case_known = True
    else:
        win = pos > 0
        case = torch.full(pos.shape, 3 if len(base) == 0 else -1, device=pos.device)
        every_case_known = len(base) == 0 or not len(pos)
    both = torch.stack([s0, s1], dim=1)
    if post != "PROBIT" and every_case_known:
        z = torch.where(
            has1.unsqueeze(1), _post_transform(both, post), _binary_scores(s0, case, post)
        )
    else:
        z = _post_transform(both, post)
    return win, z


@register("TreeEnsembleClassifier", domain=ML, since=1, backend="cuda")
def tree_ensemble_classifier(
    X: torch.Tensor,
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
) -> tuple[Value, torch.Tensor]:
    """TreeEnsembleClassifier: [N, F] -> (labels [N], float32 scores [N, classes])."""
    if classlabels_strings:
        labels: np.ndarray | None = np.array(classlabels_strings, dtype=object)
    else:
        labels = np.asarray(classlabels_int64s or [], dtype=np.int64)
    if not len(labels):
        raise ValueError("TreeEnsembleClassifier: give classlabels_int64s or classlabels_strings.")
    device = X.device
    forest, _, find = ref._legacy_forest(nodes)
    weights = ref._tensor_or_list(class_weights_as_tensor, class_weights)
    values, has = _leaf_scores(X, forest, find, class_treeids, class_nodeids, class_ids, weights,
                               len(labels))  # fmt: skip
    scores = torch.where(has, values, 0.0).sum(dim=1)
    has = has.any(dim=1)
    base = _base(base_values_as_tensor, base_values, device)
    if len(labels) > 2:
        if len(base):
            scores, has = scores + base, torch.ones_like(has)
        best = torch.where(has, scores, -np.inf).argmax(dim=1)
        z = _post_transform(scores, post_transform).to(torch.float32)
        return _pick_labels(labels, best), z
    one_class_used = len(labels) == 2 and len(set(class_ids or [])) == 1
    win, z = _classify_binary(scores, has, base, bool((weights >= 0).all()), one_class_used,
                              post_transform)  # fmt: skip
    return _pick_labels(labels, win.to(torch.int64)), z.to(torch.float32)


def _pick_labels(labels: np.ndarray, index: torch.Tensor) -> Value:
    if labels.dtype == object:  # string labels live on the host: read the winning indices back
        return labels[index.cpu().numpy()]
    return to_torch(labels, index.device)[index]

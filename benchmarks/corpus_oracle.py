"""Arbiters for the corpus check, used when tensorkiln and onnxruntime disagree.

A disagreement has two sides; onnxruntime is not always the right one (its Sigmoid is an
approximation that is 2e-2 off in the far tail, its summation order differs from torch's). Two
arbiters tell which side is wrong, each stated in benchmarks/RESULTS.md:

* ``float64``: the model converted to double (initializers, graph inputs and outputs, Cast targets,
  constants) and run by onnxruntime; the few ops it has no double kernel of (Conv) stay float32
  between casts, where their rounding is float32's but well conditioned, and the oracle's name
  lists them. Both sides are measured against it; tensorkiln passes when it is within the
  strict bound of exact arithmetic, or at least as close to it as onnxruntime is.
* ``fp16 floor``: for an fp16 engine further from float64 than the bound, how far the same
  optimized graph lands from float64 when every one of its values is stored in float16 and every
  layer computes exactly (the reference backend, whose kernels compute in float32 and round
  their outputs to float16, after the precision pass the cuda build runs): what float16 storage
  of this graph costs whatever its kernels. tensorkiln passes within that distance (PP-OCRv4
  det: 1.5e-2 for the exact float16 graph, 1.0e-2 for the engine, on the page).
* ``noise floor``: for a model no float64 oracle runs (a quantized contrib op), how far
  onnxruntime's own output moves when its input moves by what the engine's precision rounds away
  (one float32 ulp; for fp16, the input rounded to float16). Dynamic quantization makes a model
  discontinuous: a value on a rounding boundary flips a whole grid step, so onnxruntime disagrees
  with itself by that much, and tensorkiln passes within twice that distance (the engine rounds
  at every layer, not only at the input).

And sample inputs a model was made for, where random values say nothing (``document_image``).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

F32, F64 = TensorProto.FLOAT, TensorProto.DOUBLE


# ---------------------------------------------------------------- float64 oracle


def to_float64(
    model: onnx.ModelProto, keep: set[str] = frozenset(), floats: set[str] = frozenset()
) -> onnx.ModelProto:
    """A copy of ``model`` computing in double wherever it computed in float, but the ops in
    ``keep``, whose float inputs and outputs (``floats``: names) are cast to float32 and back."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    _graph_to_float64(out.graph)
    if keep:
        _keep_float32(out.graph, keep, floats)
    return out


def _keep_float32(g: onnx.GraphProto, keep: set[str], floats: set[str]) -> None:
    nodes = []
    for k, n in enumerate(g.node):
        if n.op_type not in keep:
            nodes.append(n)
            continue
        for i, name in enumerate(n.input):
            if name in floats:
                nodes.append(helper.make_node("Cast", [name], [f"{name}__f32_{k}"], to=F32))
                n.input[i] = f"{name}__f32_{k}"
        after = []
        for i, name in enumerate(n.output):
            if name in floats:
                n.output[i] = f"{name}__f32"
                after.append(helper.make_node("Cast", [n.output[i]], [name], to=F64))
        nodes += [n, *after]
    del g.node[:]
    g.node.extend(nodes)


# inputs that stay float32 in a double model: coordinates and scales, not data
_FLOAT32_INPUTS = {"Resize": (1, 2), "Upsample": (1,)}


def _graph_to_float64(g: onnx.GraphProto) -> None:
    scales = {
        n.input[i]
        for n in g.node
        for i in _FLOAT32_INPUTS.get(n.op_type, ())
        if i < len(n.input) and n.input[i]
    }
    for i, t in enumerate(g.initializer):
        if t.data_type == F32 and t.name not in scales:
            g.initializer[i].CopyFrom(_tensor64(t))
    for v in [*g.input, *g.output]:
        if v.type.tensor_type.elem_type == F32:
            v.type.tensor_type.elem_type = F64
    del g.value_info[:]  # re-inferred by the runtime
    for n in g.node:
        if n.op_type == "Constant" and n.output[0] in scales:
            continue
        for a in n.attribute:
            _attr_to_float64(n, a)


def _attr_to_float64(node: onnx.NodeProto, a: onnx.AttributeProto) -> None:
    if a.name == "to" and node.op_type == "Cast" and a.i == F32:
        a.i = F64
    elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == F32:
        a.t.CopyFrom(_tensor64(a.t))
    elif node.op_type == "Constant" and a.name in ("value_float", "value_floats"):
        values = np.array(a.f if a.name == "value_float" else list(a.floats), np.float64)
        a.CopyFrom(helper.make_attribute("value", numpy_helper.from_array(values)))
    elif a.type == onnx.AttributeProto.GRAPH:
        _graph_to_float64(a.g)
    elif a.type == onnx.AttributeProto.GRAPHS:
        for sub in a.graphs:
            _graph_to_float64(sub)


def _tensor64(t: onnx.TensorProto) -> onnx.TensorProto:
    return numpy_helper.from_array(numpy_helper.to_array(t).astype(np.float64), t.name)


def run_float64(
    model: onnx.ModelProto, feeds: dict[str, np.ndarray], tries: int = 16
) -> tuple[list[np.ndarray] | None, str]:
    """The model's outputs computed in double by onnxruntime and the oracle's name, or None and
    why it could not. Ops onnxruntime has no double kernel of (Conv, ...) stay float32 between
    casts, and the name says which: their rounding is float32's, the rest is exact to double."""
    import onnxruntime as ort

    feeds64 = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
    floats = _float_values(model)
    kept: set[str] = set()
    for _ in range(tries):
        m64 = to_float64(model, kept, floats)
        try:
            sess = ort.InferenceSession(m64.SerializeToString(), providers=["CPUExecutionProvider"])
            outs = sess.run(None, {i.name: feeds64[i.name] for i in sess.get_inputs()})
        except Exception as exc:  # an op without a double kernel: keep it in float32, retry
            message = str(exc)
            missing = re.search(r"implementation for (\w+)\(\d+\) node", message)
            if missing is None or missing.group(1) in kept:
                return None, f"no float64 oracle: {message.splitlines()[0][:200]}"
            kept.add(missing.group(1))
            continue
        name = "onnxruntime float64"
        return outs, name + (f" ({', '.join(sorted(kept))} in float32)" if kept else "")
    return None, f"no float64 oracle: more than {tries} ops lack a double kernel"


def _float_values(model: onnx.ModelProto) -> set[str]:
    """Names of the float32 values of the model's main graph, by onnx's shape inference."""
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    typed = [*g.input, *g.output, *g.value_info]
    names = {v.name for v in typed if v.type.tensor_type.elem_type == F32}
    return names | {t.name for t in g.initializer if t.data_type == F32}


# ---------------------------------------------------------------- fp16 floor


def fp16_floor(
    model: onnx.ModelProto,
    feeds: dict[str, np.ndarray],
    f64: list[np.ndarray],
    metric: Callable[[list[np.ndarray], list[np.ndarray]], float],
) -> float:
    """How far from the float64 outputs ``f64`` the model lands, by ``metric``, when its
    optimized graph (the cuda build's passes) stores every value in float16 and computes each
    layer exactly: the reference backend after the precision pass (see the module doc)."""
    import tensorkiln
    from tensorkiln.builder.builder import optimize
    from tensorkiln.ir import DType
    from tensorkiln.precision import reduce_precision
    from tensorkiln.runtime import Runner

    graph = tensorkiln.import_onnx(model)
    optimize(graph, 3, backend="cuda")
    reduce_precision(graph, DType.FLOAT16)
    outs = Runner(graph).infer(feeds)
    return metric([np.asarray(outs[v.name], np.float64) for v in graph.outputs], f64)


# ---------------------------------------------------------------- noise floor


def noise_floor(
    run: Callable[[dict[str, np.ndarray]], list[np.ndarray]],
    feeds: dict[str, np.ndarray],
    want: list[np.ndarray],
    metric: Callable[[list[np.ndarray], list[np.ndarray]], float],
    fp16: bool,
    seed: int = 1,
) -> float:
    """The most onnxruntime's outputs (``run``) move, by ``metric``, when the float inputs move by
    one float32 ulp (two random draws) or, for ``fp16``, are also rounded to float16."""
    rng = np.random.default_rng(seed)
    moved = []
    for _ in range(2):
        nudged = {k: _nudge(v, rng) for k, v in feeds.items()}
        moved.append(metric(run(nudged), want))
    if fp16:
        rounded = {
            k: v.astype(np.float16).astype(v.dtype) if v.dtype == np.float32 else v
            for k, v in feeds.items()
        }
        moved.append(metric(run(rounded), want))
    return max(moved)


def _nudge(x: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if x.dtype != np.float32:
        return x
    up = rng.random(x.shape) < 0.5
    return np.nextafter(x, np.where(up, np.inf, -np.inf).astype(np.float32))


# ---------------------------------------------------------------- input recipes

# PaddleOCR's detector normalization (ImageNet's mean and std on a 0..1 image)
_MEAN = np.array([0.485, 0.456, 0.406], np.float32)
_STD = np.array([0.229, 0.224, 0.225], np.float32)


def document_image(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A synthetic document page [1, 3, H, W], normalized as PaddleOCR normalizes: a light, noisy
    background with lines of dark text-like strokes (random glyph-sized bars and blocks)."""
    _, channels, height, width = shape
    page = rng.uniform(0.85, 1.0, (height, width)).astype(np.float32)
    line_height = max(6, height // 6)
    for top in range(line_height // 2, height - line_height, line_height + line_height // 2):
        x = int(rng.integers(2, max(3, width // 8)))
        while x < width - 4:
            glyph = int(rng.integers(3, max(4, line_height)))
            for _ in range(int(rng.integers(2, 5))):  # a few strokes per glyph
                y0 = top + int(rng.integers(0, line_height - 2))
                x0 = x + int(rng.integers(0, glyph))
                h, w = int(rng.integers(1, line_height - (y0 - top) + 1)), int(rng.integers(1, 3))
                if rng.random() < 0.5:
                    h, w = w, int(rng.integers(1, glyph + 1))  # a horizontal stroke
                page[y0 : y0 + h, x0 : x0 + w] = rng.uniform(0.0, 0.25)
            x += glyph + int(rng.integers(1, 4))
    image = np.repeat(page[None], channels, axis=0)
    image = (image - _MEAN[:channels, None, None]) / _STD[:channels, None, None]
    return image[None].astype(np.float32)

"""``tensorkiln compare --layerwise``: every intermediate tensor of an engine against a reference,
in the engine's layer order, and the first layer whose output goes beyond tolerance (Polygraphy's
``--onnx-outputs mark all`` / ``--trt-outputs mark all`` comparison, in one command).

The reference is onnxruntime running the model with every node output marked as a graph output,
or a float32 engine built from the same model on the same backend (``--reference fp32``), which
also compares the tensors a quantized or fp16 engine keeps that onnxruntime cannot see. A tensor is
compared when both sides have it by name: a fused layer's output carries the name of the last
node it replaced, so fused chains are compared at their ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx

from tensorkiln.cli.common import CLIError


@dataclass
class LayerTensor:
    layer: str  # the engine layer that produced it
    op: str
    precision: str
    tensor: str
    value: np.ndarray


def engine_tensors(engine: Any, feeds: dict[str, np.ndarray]) -> list[LayerTensor]:
    """Every output of every layer of ``engine`` on ``feeds``, in order, as numpy."""
    seen: list[LayerTensor] = []
    with engine.create_execution_context() as ctx:
        for name, arr in feeds.items():
            ctx.set_input_shape(name, np.shape(arr))

        def observe(node: Any, outputs: list[Any]) -> None:
            op = node.op if node.domain in ("", "ai.onnx") else f"{node.domain}.{node.op}"
            for v, x in zip(node.outputs, outputs):
                if v is None or x is None:
                    continue
                host = ctx.backend.to_host(x)
                if isinstance(host, np.ndarray):
                    seen.append(LayerTensor(node.name, op, node.precision or "fp32", v.name, host))

        ctx.infer(feeds, observer=observe)
    return seen


def onnxruntime_tensors(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
    """Every node output of ``model`` (a ModelProto, external data loaded) under onnxruntime."""
    try:
        import onnxruntime as ort
    except ImportError:
        raise CLIError(
            "compare --layerwise against onnxruntime needs onnxruntime; install it, or compare "
            "against a float32 engine with --reference fp32"
        ) from None
    marked = onnx.ModelProto()
    marked.CopyFrom(model)
    present = {o.name for o in marked.graph.output}
    for node in marked.graph.node:
        for name in node.output:
            if name and name not in present:
                marked.graph.output.append(onnx.ValueInfoProto(name=name))
                present.add(name)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(
            marked.SerializeToString(), options, providers=["CPUExecutionProvider"]
        )
        names = [o.name for o in session.get_outputs()]
        return dict(zip(names, session.run(names, feeds)))
    except Exception as exc:  # onnxruntime raises its own exception types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CLIError(
            f"onnxruntime cannot run the model with its tensors marked: {first}"
        ) from None


def compare_layers(
    ours: list[LayerTensor],
    reference: dict[str, np.ndarray],
    stats: Callable[[np.ndarray, np.ndarray], dict],
) -> list[dict]:
    """One row per engine tensor the reference also has, in the engine's order."""
    rows = []
    for t in ours:
        if t.tensor not in reference:
            continue
        r = stats(t.value, np.asarray(reference[t.tensor]))
        rows.append({"layer": t.layer, "op": t.op, "precision": t.precision,
                     "tensor": t.tensor, **r})  # fmt: skip
    return rows


def first_failure(rows: list[dict]) -> dict | None:
    return next((r for r in rows if not r["passed"]), None)

"""Quick start: run a small CNN on scikit-learn's digits test set with tensorkiln.

    python examples/digits.py                   # build in memory from examples/digits_cnn.onnx
    python examples/digits.py digits.engine     # or run an engine made by `tensorkiln build`

Needs numpy and tensorkiln; compares against onnxruntime when it is installed. Exits with
status 1 if accuracy is below 0.9 or if the logits disagree with onnxruntime.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

import tensorkiln

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE / "digits_cnn.onnx"
TEST_PATH = HERE / "digits_test.npz"
MIN_ACCURACY = 0.9
RTOL = 1e-4  # relative to the largest logit magnitude


def open_model(argv: list[str]):
    """An execution context of the engine named on the command line, or of the bundled model."""
    from tensorkiln.builder import Builder
    from tensorkiln.engine import Engine

    if argv:
        engine = Engine.load(argv[0])
        print(f"engine: {argv[0]} ({engine.num_layers} layers, backend {engine.backend})")
    else:
        engine = Builder().build(MODEL_PATH)
        print(f"model: {MODEL_PATH.name} (built in memory, {engine.num_layers} layers)")
    return engine.create_execution_context(), engine.inputs[0].name, engine.outputs[0].name


def per_image_latency_ms(ctx, name: str, images: np.ndarray) -> np.ndarray:
    ctx.infer({name: images[:1]})  # warm-up
    times = []
    for i in range(len(images)):
        start = time.perf_counter()
        ctx.infer({name: images[i : i + 1]})
        times.append(time.perf_counter() - start)
    return np.asarray(times) * 1e3


def batch_logits(ctx, name: str, output: str, images: np.ndarray) -> tuple[np.ndarray, float]:
    start = time.perf_counter()
    logits = ctx.infer({name: images})[output]
    return logits, time.perf_counter() - start


def onnxruntime_logits(images: np.ndarray) -> np.ndarray | None:
    try:
        import onnxruntime as ort
    except ImportError:
        return None
    session = ort.InferenceSession(str(MODEL_PATH), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: images})[0]


def main(argv: list[str]) -> int:
    data = np.load(TEST_PATH)
    images, labels = data["images"], data["labels"]
    ctx, name, output = open_model(argv)
    with ctx:
        logits, batch_s = batch_logits(ctx, name, output, images)
        latency = per_image_latency_ms(ctx, name, images)
    accuracy = float((logits.argmax(1) == labels).mean())
    ok = accuracy >= MIN_ACCURACY
    print(f"accuracy: {accuracy:.4f} ({len(labels)} test images)")
    print(
        f"latency: batch 1 median {np.median(latency):.3f} ms, p90 "
        f"{np.percentile(latency, 90):.3f} ms; batch {len(labels)}: {batch_s * 1e3:.1f} ms "
        f"({len(labels) / batch_s:.0f} images/s)"
    )
    reference = onnxruntime_logits(images)
    if reference is None:
        print("onnxruntime: not installed, comparison skipped")
    else:
        diff = float(np.abs(logits - reference).max())
        scale = float(np.abs(reference).max())
        agree = float((logits.argmax(1) == reference.argmax(1)).mean())
        ok = ok and diff <= RTOL * scale and agree == 1.0
        print(
            f"onnxruntime: max |logit diff| {diff:.2e} (max |logit| {scale:.1f}), "
            f"argmax agreement {agree:.2%}"
        )
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except tensorkiln.TensorkilnError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)

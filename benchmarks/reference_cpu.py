"""tensorkiln's reference (numpy) backend next to onnxruntime on the CPU, on real architectures.

    python benchmarks/reference_cpu.py [--runs 10] [--rounds 3] [--models ...] [--exporters ...]

Exports full-size ResNet-50 (batch 1, 224x224), BERT-base and GPT-2 (batch 1, seq 128) and a
small nn.TransformerEncoder with both torch exporters (dynamo also at opset 23, where attention
is one ONNX Attention node) into a temporary folder; for each model it first checks tensorkiln's
outputs against onnxruntime's on the same inputs, then times both in this process: warm-up runs, then --rounds rounds alternating between the two runtimes, each the median
of at least --runs runs; the lowest round median is reported (robust to bursts of load from other
processes). onnxruntime runs with default session options and 2 intra-op threads. Prints a
markdown table and the versions, for benchmarks/RESULTS.md.
Needs torch, transformers, onnxscript and onnxruntime; the models come from
tests/models/test_architectures.py, which runs the same architectures at small sizes.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from tests.models.test_architectures import (  # noqa: E402
    BUILDERS,
    export,
    max_rel_diff,
    run_onnxruntime,
)

import tensorkiln  # noqa: E402

ORT_THREADS = 2
AGREE_RTOL = 1e-4  # max |diff| / max |onnxruntime output|, per output


@dataclass
class Row:
    model: str
    exporter: str
    tensorkiln_ms: float | None = None
    onnxruntime_ms: float | None = None
    max_rel_diff: float | None = None
    note: str = ""


def median_ms(fn: Callable[[], object], runs: int) -> float:
    """Median ms of ``fn`` over at least ``runs`` runs, more for quick models (about 1 s)."""
    start = time.perf_counter()
    fn()
    runs = max(runs, min(200, int(1.0 / max(time.perf_counter() - start, 1e-6))))
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) * 1e3


def time_both(
    tensorkiln_fn: Callable[[], object],
    onnxruntime_fn: Callable[[], object],
    warmup: int,
    runs: int,
    rounds: int,
) -> tuple[float, float]:
    """Each runtime's lowest median over ``rounds`` rounds of ``runs`` runs.

    The rounds alternate between the two runtimes, so a burst of load from other processes
    hits both alike, and the lowest median keeps the round it spared. Within a round one
    runtime runs alone: onnxruntime's thread pool spins for a while after each run and would
    take the cores from numpy if single runs alternated.
    """
    for _ in range(warmup):
        tensorkiln_fn()
        onnxruntime_fn()
    tk, ort = [], []
    for _ in range(rounds):
        tk.append(median_ms(tensorkiln_fn, runs))
        ort.append(median_ms(onnxruntime_fn, runs))
    return min(tk), min(ort)


def ort_session(path: Path):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = ORT_THREADS
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


# exporter name -> torch.onnx.export options; from opset 23 the dynamo exporter writes
# scaled dot-product attention as one ONNX Attention node.
EXPORTERS = {
    "torchscript": {"dynamo": False},
    "dynamo": {"dynamo": True},
    "dynamo-opset23": {"dynamo": True, "opset": 23},
}


def measure(name: str, exporter: str, folder: Path, args: argparse.Namespace) -> Row:
    row = Row(name, exporter)
    model, feeds = BUILDERS[name](full=True)
    try:  # the exporters print progress on stdout; keep stdout for the table
        with contextlib.redirect_stdout(sys.stderr):
            path = export(model, feeds, folder / f"{name}-{exporter}", **EXPORTERS[exporter])
    except Exception as exc:
        row.note = f"export failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return row
    del model
    try:
        runner = tensorkiln.Runner(path)
        tk_feeds = {n: feeds[n] for n in runner.input_names}
        outputs = runner.infer(tk_feeds)
    except tensorkiln.TensorkilnError as exc:
        row.note = f"tensorkiln failed: {type(exc).__name__}: {str(exc)[:160]}"
        return row
    got = [outputs[n] for n in runner.output_names]
    row.max_rel_diff = max_rel_diff(got, run_onnxruntime(path, feeds, threads=ORT_THREADS))
    if row.max_rel_diff > AGREE_RTOL:
        row.note = "outputs disagree with onnxruntime; not timed"
        return row
    session = ort_session(path)
    ort_feeds = {i.name: feeds[i.name] for i in session.get_inputs()}
    row.tensorkiln_ms, row.onnxruntime_ms = time_both(
        lambda: runner.infer(tk_feeds),
        lambda: session.run(None, ort_feeds),
        args.warmup,
        args.runs,
        args.rounds,
    )
    return row


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_average() -> str:
    return ", ".join(f"{x:.1f}" for x in os.getloadavg())


def environment(load_at_start: str) -> list[str]:
    import onnx
    import onnxruntime
    import torch
    import transformers

    return [
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- CPU: {os.cpu_count()} cores, {cpu_name()};"
        f" load average (1, 5, 15 min) at the start {load_at_start}, at the end {load_average()}",
        f"- python {platform.python_version()}, numpy {np.__version__}, onnx {onnx.__version__},"
        f" onnxruntime {onnxruntime.__version__}, torch {torch.__version__},"
        f" transformers {transformers.__version__}, tensorkiln {tensorkiln.__version__}",
    ]


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row]) -> list[str]:
    lines = [
        "| model | exporter | tensorkiln ms | onnxruntime ms | ratio | max rel diff | note |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        ratio = None
        if r.tensorkiln_ms is not None and r.onnxruntime_ms:
            ratio = r.tensorkiln_ms / r.onnxruntime_ms
        lines.append(
            f"| {r.model} | {r.exporter} | {fmt(r.tensorkiln_ms, '.1f')} | "
            f"{fmt(r.onnxruntime_ms, '.1f')} | {fmt(ratio, '.1f')}x | "
            f"{fmt(r.max_rel_diff, '.1e')} | {r.note} |"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10, help="timed runs per round (median)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds per model (lowest median)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed runs first")
    parser.add_argument("--models", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    parser.add_argument("--exporters", nargs="+", default=list(EXPORTERS), choices=list(EXPORTERS))
    args = parser.parse_args(argv)
    rows = []
    load_at_start = load_average()
    with tempfile.TemporaryDirectory(prefix="tensorkiln-bench-") as tmp:
        for name in args.models:
            for exporter in args.exporters:
                row = measure(name, exporter, Path(tmp), args)
                print(f"{row.model} {row.exporter}: {row}", file=sys.stderr, flush=True)
                rows.append(row)
    print("\n".join([*table(rows), "", *environment(load_at_start)]))
    return 0 if all(r.max_rel_diff is not None and not r.note for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

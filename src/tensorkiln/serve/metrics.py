"""Prometheus metrics of the server, in the text format on ``/metrics``.

Triton's own metric names are used where Triton has them, so dashboards built for it keep
working: per model and version, nv_inference_request_success / _failure (requests),
nv_inference_count (inferences: batch rows), nv_inference_exec_count (engine runs), and the
cumulative microseconds nv_inference_request_duration_us, nv_inference_queue_duration_us and
nv_inference_compute_infer_duration_us. Histograms that Triton lacks are named tensorkiln_*:
request, queue and compute seconds, and rows per engine run. GPU memory in use is
nv_gpu_memory_used_bytes, where there is a GPU. Each server has a registry of its own.

Triton's counters are written as Triton writes them (``# TYPE nv_inference_count counter`` and
samples under that bare name): prometheus-client would name them ``nv_inference_count_total``
and add ``_created`` samples, and queries written for Triton would find nothing. Their values
are read from the statistics the server keeps for Triton's statistics extension (core.ModelStats),
not counted a second time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

LABELS = ("model", "version")
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# Triton's counters, per model version: (name, help, the value from the version's statistics,
# a core.ModelStats, which counts the same requests and runs for the statistics extension)
COUNTERS: tuple[tuple[str, str, Callable[[Any], float]], ...] = (
    ("nv_inference_request_success", "successful inference requests",
     lambda s: s.durations["success"][0]),
    ("nv_inference_request_failure", "failed inference requests",
     lambda s: s.durations["fail"][0]),
    ("nv_inference_count", "inferences performed (batch rows)", lambda s: s.inference_count),
    ("nv_inference_exec_count", "engine runs (batches)", lambda s: s.execution_count),
    ("nv_inference_request_duration_us", "cumulative request duration (microseconds)",
     lambda s: s.durations["success"][1] / 1e3),
    ("nv_inference_queue_duration_us", "cumulative time requests waited in the queue (us)",
     lambda s: s.durations["queue"][1] / 1e3),
    ("nv_inference_compute_infer_duration_us", "cumulative engine run time (us)",
     lambda s: s.durations["compute_infer"][1] / 1e3),
)  # fmt: skip


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """The server's counters and histograms (one registry per server). ``stats`` gives the
    model versions' statistics, (model, version) -> core.ModelStats, which Triton's counters
    are read from."""

    def __init__(self, stats: Callable[[], Mapping[tuple[str, int], Any]] = dict) -> None:
        r = self.registry = CollectorRegistry()
        self._stats = stats
        self.request_s = Histogram(
            "tensorkiln_request_duration_seconds", "request duration", LABELS,
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.queue_s = Histogram(
            "tensorkiln_queue_duration_seconds", "time a request waited for its engine run",
            LABELS, buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.compute_s = Histogram(
            "tensorkiln_compute_duration_seconds", "engine run time", LABELS,
            buckets=_SECONDS, registry=r,
        )  # fmt: skip
        self.batch_rows = Histogram(
            "tensorkiln_batch_size", "rows per engine run", LABELS, buckets=_ROWS, registry=r
        )
        self.gpu_memory = Gauge(
            "nv_gpu_memory_used_bytes", "GPU memory in use by this process", ["gpu"], registry=r
        )

        # (model, version) -> its histograms: prometheus-client's labels() takes a lock and
        # builds a key on every call, which every request would pay
        self._children: dict[tuple[str, int], tuple[Any, Any, Any, Any]] = {}

    def _of(self, model: str, version: int) -> tuple[Any, Any, Any, Any]:
        children = self._children.get((model, version))
        if children is None:
            labels = (model, str(version))
            children = self._children[(model, version)] = tuple(
                h.labels(*labels)
                for h in (self.request_s, self.queue_s, self.compute_s, self.batch_rows)
            )
        return children

    def request(self, model: str, version: int, ok: bool, seconds: float) -> None:
        if ok:
            self._of(model, version)[0].observe(seconds)

    def run(self, model: str, version: int, rows: int, requests_queue_s: list[float],
            compute_s: float) -> None:  # fmt: skip
        """One engine run of ``rows`` rows for requests that waited ``requests_queue_s``."""
        _, queue_s, compute, batch_rows = self._of(model, version)
        compute.observe(compute_s)
        batch_rows.observe(rows)
        for q in requests_queue_s:
            queue_s.observe(q)

    def counter_values(self, name: str) -> dict[tuple[str, str], float]:
        """Triton counter ``name``'s value per (model, version)."""
        value = next(v for n, _, v in COUNTERS if n == name)
        return {(m, str(v)): float(value(s)) for (m, v), s in sorted(self._stats().items())}

    def _counters_text(self) -> str:
        lines = []
        for name, doc, _ in COUNTERS:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} counter"]
            for (model, version), value in self.counter_values(name).items():
                lines.append(
                    f'{name}{{model="{_escape(model)}",version="{_escape(version)}"}} {value!r}'
                )
        return "\n".join(lines) + "\n"

    def exposition(self) -> bytes:
        """The text format, GPU memory read now."""
        self._read_gpu_memory()
        return self._counters_text().encode() + generate_latest(self.registry)

    def _read_gpu_memory(self) -> None:
        try:
            import torch  # lazy: torch is optional (a GPU server has it)
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        for i in range(torch.cuda.device_count()):
            self.gpu_memory.labels(str(i)).set(torch.cuda.memory_reserved(i))

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
and add ``_created`` samples, and queries written for Triton would find nothing.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Gauge, Histogram, generate_latest

LABELS = ("model", "version")
_SECONDS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class TritonCounter:
    """A counter per (model, version), exposed under its bare name as Triton exposes it."""

    def __init__(self, name: str, doc: str) -> None:
        self.name, self.doc = name, doc
        self.values: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def inc(self, labels: tuple[str, str], amount: float = 1.0) -> None:
        with self._lock:
            self.values[labels] = self.values.get(labels, 0.0) + amount

    def text(self) -> str:
        lines = [f"# HELP {self.name} {self.doc}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self.values.items())
        for (model, version), value in items:
            lines.append(
                f'{self.name}{{model="{_escape(model)}",version="{_escape(version)}"}} {value!r}'
            )
        return "\n".join(lines) + "\n"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class Metrics:
    """The server's counters and histograms (one registry per server)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.counters: dict[str, TritonCounter] = {}

        def counter(name: str, doc: str) -> TritonCounter:
            self.counters[name] = TritonCounter(name, doc)
            return self.counters[name]

        self.success = counter("nv_inference_request_success", "successful inference requests")
        self.failure = counter("nv_inference_request_failure", "failed inference requests")
        self.count = counter("nv_inference_count", "inferences performed (batch rows)")
        self.exec_count = counter("nv_inference_exec_count", "engine runs (batches)")
        self.request_us = counter(
            "nv_inference_request_duration_us", "cumulative request duration (microseconds)"
        )
        self.queue_us = counter(
            "nv_inference_queue_duration_us", "cumulative time requests waited in the queue (us)"
        )
        self.compute_us = counter(
            "nv_inference_compute_infer_duration_us", "cumulative engine run time (us)"
        )
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

    def request(self, model: str, version: int, ok: bool, seconds: float) -> None:
        labels = (model, str(version))
        (self.success if ok else self.failure).inc(labels)
        if ok:
            self.request_us.inc(labels, seconds * 1e6)
            self.request_s.labels(*labels).observe(seconds)

    def run(self, model: str, version: int, rows: int, requests_queue_s: list[float],
            compute_s: float) -> None:  # fmt: skip
        """One engine run of ``rows`` rows for requests that waited ``requests_queue_s``."""
        labels = (model, str(version))
        self.count.inc(labels, rows)
        self.exec_count.inc(labels)
        self.compute_us.inc(labels, compute_s * 1e6)
        self.compute_s.labels(*labels).observe(compute_s)
        self.batch_rows.labels(*labels).observe(rows)
        for q in requests_queue_s:
            self.queue_us.inc(labels, q * 1e6)
            self.queue_s.labels(*labels).observe(q)

    def exposition(self) -> bytes:
        """The text format, GPU memory read now."""
        self._read_gpu_memory()
        counters = "".join(c.text() for c in self.counters.values()).encode()
        return counters + generate_latest(self.registry)

    def _read_gpu_memory(self) -> None:
        try:
            import torch  # lazy: torch is optional (a GPU server has it)
        except ImportError:
            return
        if not torch.cuda.is_available():
            return
        for i in range(torch.cuda.device_count()):
            self.gpu_memory.labels(str(i)).set(torch.cuda.memory_reserved(i))

"""Run ONNX's backend test suite against tensorkiln and print the counts as a markdown table.

    python scripts/conformance_report.py                     # the reference backend (README)
    python scripts/conformance_report.py --backend cuda      # the cuda backend's kernels
    python scripts/conformance_report.py --backend cuda --optimized   # through level-3 engines

Counts only the "_cpu" variants: ONNX's suite also generates CUDA variants, which these backends
skip; the cuda backend's run uses the GPU when there is one (its case names still end in _cpu).
"""

from __future__ import annotations

import argparse
import collections
import sys

import pytest

KINDS = {
    "OnnxBackendNodeModelTest": "node",
    "OnnxBackendSimpleModelTest": "simple",
    "OnnxBackendPyTorchConvertedModelTest": "pytorch-converted",
    "OnnxBackendPyTorchOperatorModelTest": "pytorch-operator",
    "OnnxBackendRealModelTest": "light models",
}


class _Collect:
    def __init__(self) -> None:
        self.counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.failed: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.nodeid.endswith("_cpu"):
            return
        cls = report.nodeid.split("::")[-2]
        kind = KINDS.get(cls, cls)
        if report.when == "call" or (report.when == "setup" and report.outcome != "passed"):
            outcome = {"passed": "passed", "failed": "failed", "skipped": "excluded"}[
                report.outcome
            ]
            self.counts[kind][outcome] += 1
            if outcome == "failed":
                self.failed.append(report.nodeid.split("::")[-1])


SUITES = {
    ("reference", False): "tests/conformance/test_onnx_backend.py",
    ("reference", True): "tests/conformance/test_onnx_backend_optimized.py",
    ("cuda", False): "tests/conformance/test_onnx_backend_cuda.py",
    ("cuda", True): "tests/conformance/test_onnx_backend_cuda_optimized.py",
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", choices=("reference", "cuda"), default="reference")
    ap.add_argument("--optimized", action="store_true", help="through level-3 engines")
    args = ap.parse_args()
    collect = _Collect()
    suite = SUITES[(args.backend, args.optimized)]
    pytest.main(["-q", "-p", "no:cacheprovider", "--tb=no", suite], plugins=[collect])
    print("\n| cases | total | passed | failed | excluded | pass rate |")
    print("|---|---:|---:|---:|---:|---:|")
    for kind in KINDS.values():
        c = collect.counts.get(kind)
        if not c:
            continue
        total = sum(c.values())
        print(
            f"| {kind} | {total} | {c['passed']} | {c['failed']} | {c['excluded']} | "
            f"{100 * c['passed'] / total:.1f}% |"
        )
    if collect.failed:
        print("\nfailed:", ", ".join(sorted(collect.failed)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

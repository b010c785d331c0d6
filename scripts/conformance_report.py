"""Run ONNX's backend test suite against tensorkiln and print the counts as a markdown table.

    python scripts/conformance_report.py          # the table README shows

Counts only the CPU variants (the suite also generates CUDA variants, which a CPU backend skips).
"""

from __future__ import annotations

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


def main() -> int:
    collect = _Collect()
    pytest.main(["-q", "-p", "no:cacheprovider", "--tb=no", "tests/conformance"], plugins=[collect])
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

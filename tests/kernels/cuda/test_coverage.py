"""Every op the reference backend runs, the cuda backend runs too; the few that run on the host
are listed here by name, each with the reason, so no copy to the host is silent."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tensorkiln.cli.main import main
from tensorkiln.kernels.registry import _REGISTRY, registered_ops

# The ops the cuda backend runs through their numpy kernels on the host, and why (nothing else).
EXPECTED_HOST_OPS = {
    ("", "ImageDecoder"): "compressed image decoding (Pillow) is host code",
    ("", "RegexFullMatch"): "string tensors have no device representation",
    ("", "StringConcat"): "string tensors have no device representation",
    ("", "StringNormalizer"): "string tensors have no device representation",
    ("", "StringSplit"): "string tensors have no device representation",
    ("", "TfIdfVectorizer"): "n-gram matching over a token pool, with string inputs",
    ("ai.onnx.ml", "LabelEncoder"): "string keys and values (numeric maps run on the device)",
}


def test_every_reference_op_has_a_cuda_kernel() -> None:
    missing = sorted(set(registered_ops("reference")) - set(registered_ops("cuda")))
    assert not missing, f"ops without a cuda kernel: {missing}"


def test_every_opset_version_is_covered() -> None:
    registered_ops("cuda")
    gaps = []
    for (backend, domain, op), entries in _REGISTRY.items():
        if backend != "reference":
            continue
        cuda = {e.since for e in _REGISTRY.get(("cuda", domain, op), [])}
        first = min(cuda, default=None)
        if first is None or first > min(e.since for e in entries):
            gaps.append((domain, op))
    assert not gaps, f"cuda kernels start at a later opset than the reference for {gaps}"


def test_host_ops_are_exactly_the_listed_ones() -> None:
    from tensorkiln.kernels.cuda.host import HOST_OPS

    assert set(HOST_OPS) == set(EXPECTED_HOST_OPS)
    assert all(reason.strip() for reason in HOST_OPS.values())


def test_ops_command_marks_host_ops(capsys) -> None:
    assert main(["ops", "--backend", "cuda"]) == 0
    out = capsys.readouterr()
    lines = [line for line in out.out.splitlines() if "\thost: " in line]
    assert len(lines) == len(EXPECTED_HOST_OPS)
    assert "ai.onnx\tStringSplit\thost: strings" in out.out
    assert f"{len(EXPECTED_HOST_OPS)} of them on the host" in out.err

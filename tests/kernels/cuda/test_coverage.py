"""Every op the reference backend runs, the cuda backend runs too; the few that run on the host
are listed here by name, each with the reason, so no copy to the host is silent."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from tensorkiln.cli.main import main
from tensorkiln.kernels.registry import _REGISTRY, registered_ops

# The ops the cuda backend runs through their numpy kernels on the host, and why (nothing else).
_ML = "ai.onnx.ml"
_TRAINING = "ai.onnx.preview.training"
EXPECTED_HOST_OPS = {
    ("", "ImageDecoder"): "compressed image decoding (Pillow) is host code",
    ("", "RegexFullMatch"): "string tensors have no device representation",
    ("", "StringConcat"): "string tensors have no device representation",
    ("", "StringNormalizer"): "string tensors have no device representation",
    ("", "StringSplit"): "string tensors have no device representation",
    ("", "TfIdfVectorizer"): "n-gram matching over a token pool, with string inputs",
    **{
        (_ML, op): "classical ML over small tabular rows, with string keys and labels"
        for op in (
            "LabelEncoder",
            "ArrayFeatureExtractor",
            "Binarizer",
            "Normalizer",
            "Scaler",
            "Imputer",
            "TreeEnsemble",
            "TreeEnsembleClassifier",
            "TreeEnsembleRegressor",
        )
    },
    **{
        ("", op): "sequences and optionals are host containers"
        for op in (
            "SequenceConstruct",
            "SequenceEmpty",
            "SequenceAt",
            "SequenceErase",
            "SequenceInsert",
            "SequenceLength",
            "SplitToSequence",
            "ConcatFromSequence",
            "Optional",
            "OptionalGetElement",
            "OptionalHasElement",
        )
    },
    **{
        ("", op): "signal front ends and constant tables, not in the measured models"
        for op in (
            "DFT",
            "STFT",
            "HannWindow",
            "HammingWindow",
            "BlackmanWindow",
            "MelWeightMatrix",
        )
    },
    **{
        ("", op): "training losses"
        for op in ("NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss")
    },
    **{(_TRAINING, op): "optimizer steps" for op in ("Adagrad", "Adam", "Momentum")},
    **{
        ("", op): "random sampling"
        for op in (
            "RandomUniform",
            "RandomUniformLike",
            "RandomNormal",
            "RandomNormalLike",
            "Bernoulli",
            "Multinomial",
        )
    },
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

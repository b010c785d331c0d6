"""The per-layer profile's pieces: device peaks by name, the roof a layer is measured against,
the roofline arithmetic, and profiles of graphs whose values are not all plain tensors."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.ops.cost import Cost
from tensorkiln.runtime.peaks import device_peaks, known_peaks
from tensorkiln.runtime.profile import layer_row, profile_layers, rates, summarize


@pytest.mark.parametrize(
    ("name", "label", "fp16", "fp32", "gbps"),
    [
        ("NVIDIA H200", "H200 SXM", 989.5, 67.0, 4800.0),
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 989.5, 67.0, 3350.0),
        ("NVIDIA H100 PCIe", "H100 PCIe", 756.0, 51.0, 2000.0),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM4 80GB", 312.0, 19.5, 2039.0),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 312.0, 19.5, 1555.0),
        ("NVIDIA A100 80GB PCIe", "A100 PCIe 80GB", 312.0, 19.5, 1935.0),
    ],
)
def test_known_devices_have_their_datasheet_peaks(name, label, fp16, fp32, gbps) -> None:
    peaks = known_peaks(name)
    assert peaks is not None and peaks.name == label and peaks.gbps == gbps
    assert peaks.tflops["fp16"] == peaks.tflops["bf16"] == fp16 and peaks.tflops["fp32"] == fp32


@pytest.mark.parametrize("name", ["cpu", "NVIDIA H200 NVL", "NVIDIA GeForce RTX 4090", ""])
def test_other_devices_have_no_peaks_unless_given(name) -> None:
    assert known_peaks(name) is None and device_peaks(name) is None
    given = device_peaks(name, 12.5, 300.0)
    assert given is not None and given.gbps == 300.0 and given.source == "given"
    assert set(given.tflops.values()) == {12.5}


def test_given_peaks_replace_the_datasheet_ones() -> None:
    peaks = device_peaks("NVIDIA H200", peak_gbps=4000.0)
    assert peaks.gbps == 4000.0 and peaks.tflops["fp16"] == 989.5
    assert peaks.source == "datasheet, given"
    peaks = device_peaks("NVIDIA H200", peak_tflops=500.0)
    assert peaks.gbps == 4800.0 and peaks.compute_tflops("fp32", False) == 500.0


def test_a_layer_is_measured_against_its_precisions_roof() -> None:
    h200 = known_peaks("NVIDIA H200")
    rng = np.random.default_rng()
    flops, nbytes = int(rng.integers(10**9, 10**11)), int(rng.integers(10**6, 10**8))
    seconds = float(rng.uniform(1e-4, 1e-2))
    for precision, products, roof in [("fp16", True, 989.5), ("bf16", True, 989.5),
                                      ("tf32", True, 494.5), ("fp32", True, 67.0),
                                      ("fp16", False, 67.0)]:  # fmt: skip
        row = layer_row("l", "MatMul", seconds * 3, 3, 50.0, Cost(flops, nbytes, products),
                        precision, h200)  # fmt: skip
        assert row["peak_tflops"] == roof and row["peak_gbps"] == 4800.0
        compute, memory = flops / (roof * 1e12), nbytes / 4800e9
        assert row["bound"] == ("compute" if flops / nbytes > roof * 1e12 / 4800e9 else "memory")
        assert row["roofline_percent"] == pytest.approx(100 * max(compute, memory) / seconds)
        assert row["average_ms"] == pytest.approx(seconds * 1e3)
        assert row["tflops"] == pytest.approx(flops / seconds / 1e12)
    assert (
        layer_row(
            "l", "Conv", 1.0, 1, 1.0, Cost(1, 1, True), "fp8", known_peaks("NVIDIA A100-SXM4-80GB")
        )["bound"]
        is None
    )  # fmt: skip  (an A100 has no fp8 roof)


def test_rates_with_nothing_to_divide_by() -> None:
    zero_time = rates(100, 100, 0.0, 1.0, 1.0)
    assert zero_time["tflops"] is None and zero_time["roofline_percent"] is None
    assert zero_time["bound"] == "memory"  # (the bound does not need a time)
    no_bytes = rates(0, 0, 1e-3, 1.0, 1.0)
    assert no_bytes["intensity"] is None and no_bytes["roofline_percent"] == 0.0
    unknown = rates(None, None, 1e-3, 1.0, 1.0)
    assert unknown["gflop"] is None and unknown["bound"] is None
    assert summarize([])["tflops"] is None


def test_sequences_and_data_dependent_shapes_profile_without_counts_where_unknown() -> None:
    """SplitToSequence makes a sequence (no tensor shape: its layer's counts are unknown);
    NonZero's output shape is known only once it ran: the profile counts it all the same."""
    nodes = [
        helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"),
        helper.make_node("Cast", ["nz"], ["nzf"], to=TensorProto.FLOAT, name="cast"),
        helper.make_node("Relu", ["nzf"], ["r"], name="relu"),
        helper.make_node("SplitToSequence", ["x"], ["seq"], axis=0, name="split"),
        helper.make_node("SequenceAt", ["seq", "zero"], ["y"], name="at"),
    ]
    graph = helper.make_graph(
        nodes,
        "odd",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("r", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [helper.make_tensor("zero", TensorProto.INT64, [], [0])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    engine = Builder("reference").build(
        model.SerializeToString(), BuilderConfig(optimization_level=0), progress=False
    )
    rng = np.random.default_rng()
    x = (rng.standard_normal((5, 3)) * rng.integers(0, 2, (5, 3))).astype(np.float32)
    with engine.create_execution_context() as ctx:
        rows = {r["name"]: r for r in profile_layers(ctx, {"x": x}, 2)}
    nonzero = int(np.count_nonzero(x))
    assert rows["relu"]["flops"] == 2 * nonzero and rows["relu"]["bytes"] == 2 * 4 * 2 * nonzero
    assert rows["split"]["flops"] is None and rows["split"]["bytes"] is None
    assert rows["at"]["flops"] is None and rows["at"]["gbps"] is None

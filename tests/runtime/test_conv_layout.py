"""Which graph inputs the executor uploads channels-last (runtime/executor.py's _conv_inputs):
those that only convolutions read, directly or (INT8/FP8 engines) through a QuantizeLinear that
only convolutions read; and the Triton convolution's output layout, which must follow torch's
rule (channels-last when the input or the weight is) whatever tactic runs the layer."""

from __future__ import annotations

import numpy as np
import pytest

from tensorkiln.ir import DType, Graph, Node, TensorType, Value
from tensorkiln.runtime.executor import _conv_inputs, _conv_weights


def _v(name, dtype, shape, const=None):
    return Value(name, TensorType(dtype, shape), const=const)


def _graph(extra_reader: str | None = None, c: int = 8) -> tuple[Graph, Value]:
    rng = np.random.default_rng()
    x = _v("x", DType.FLOAT, (1, c, 8, 8))
    s = _v("s", DType.FLOAT, (), np.float32(0.05))
    zp = _v("zp", DType.INT8, (), np.int8(0))
    wq = _v("wq", DType.INT8, (4, c, 3, 3), rng.integers(-127, 128, (4, c, 3, 3)).astype(np.int8))
    ws = _v("ws", DType.FLOAT, (4,), np.full(4, 0.01, np.float32))
    q, y = _v("q", DType.INT8, (1, c, 8, 8)), _v("y", DType.FLOAT, (1, 4, 6, 6))
    nodes = [
        Node("QuantizeLinear", [x, s, zp], [q], name="quantize"),
        Node("QConvAct", [q, s, wq, ws], [y], domain="tensorkiln", name="conv"),
    ]
    outputs = [y]
    if extra_reader is not None:
        other = _v("other", DType.FLOAT if extra_reader == "x" else DType.INT8, (1, c, 8, 8))
        nodes.append(Node("Identity", [x if extra_reader == "x" else q], [other], name="id"))
        outputs.append(other)
    graph = Graph(inputs=[x], outputs=outputs, initializers=[s, zp, wq, ws],
                  opsets={"": 21, "tensorkiln": 1}, nodes=nodes)  # fmt: skip
    return graph, x


def test_an_input_quantized_for_convolutions_alone_goes_channels_last() -> None:
    graph, x = _graph()
    weights = _conv_weights(graph)
    assert {w.name for w in weights} == {"wq"}
    assert _conv_inputs(graph, weights) == {x}
    for reader in ("x", "q"):  # another reader of the input, or of its quantized values
        graph, _ = _graph(reader)
        assert _conv_inputs(graph, _conv_weights(graph)) == frozenset()


def test_a_three_channel_image_quantized_for_its_stem_stays_as_given() -> None:
    """A 3-channel image quantized for a convolution (a quantized stem) is not copied
    channels-last on the way in: the convolution's float16 route widens it into 4 channels,
    channels-last, from any layout (tests/kernels/triton/test_quant_tactics.py checks that
    route's values from an NCHW input)."""
    graph, _ = _graph(c=3)
    assert _conv_inputs(graph, _conv_weights(graph)) == frozenset()


def test_triton_convolution_output_follows_the_weight_layout() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    from tensorkiln.kernels.common.conv import conv_geometry
    from tensorkiln.kernels.triton import conv

    x = torch.randn(2, 16, 7, 6)  # NCHW
    w = torch.randn(24, 16, 3, 3).contiguous(memory_format=torch.channels_last)
    g = conv_geometry(tuple(x.shape), tuple(w.shape), "NOTSET", None, None, [1, 1, 1, 1], None)
    y = conv.conv_act(x, w, geom=g, config=conv.CONFIGS[-1])
    assert y.is_contiguous(memory_format=torch.channels_last) and not y.is_contiguous()
    want = torch.nn.functional.conv2d(x, w.contiguous(), padding=1)
    torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)
    y_nchw = conv.conv_act(x, w.contiguous(), geom=g, config=conv.CONFIGS[-1])
    assert y_nchw.is_contiguous()

"""tensorkiln.torch on a real GPU: fp16 modules compiled from PyTorch, device tensors in and out
without copies, CUDA graphs, the torch.compile backend and a plugin with a tactic, each checked
against eager PyTorch.

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import tensorkiln  # noqa: E402
import tensorkiln.torch as tkt  # noqa: E402

pytestmark = pytest.mark.gpu


class ConvNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(3, 32, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(32)
        self.c2 = torch.nn.Conv2d(32, 32, 3, padding=1)
        self.head = torch.nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.bn(self.c1(x)))
        h = torch.relu(self.c2(h) + h)
        return self.head(h.mean((2, 3)))


def _seed() -> None:
    torch.manual_seed(int(np.random.default_rng().integers(1 << 31)))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def test_fp16_conv_net_device_tensors_in_and_out():
    _seed()
    m = ConvNet().cuda().eval()
    with torch.no_grad():
        m.bn.running_var.uniform_(0.5, 2.0)
    m16 = copy.deepcopy(m).half()
    batch = torch.export.Dim("batch", min=1, max=32)
    x = torch.randn(8, 3, 32, 32, device="cuda", dtype=torch.half)
    fast = tkt.compile(m16, (x,), precision="fp16", dynamic_shapes=({0: batch},))
    assert isinstance(fast, tkt.CompiledModule) and fast.engine.backend == "cuda"
    for n in (1, 8, 32):
        x = torch.randn(n, 3, 32, 32, device="cuda", dtype=torch.half)
        with torch.no_grad():
            want = m(x.float())
        got = fast(x)
        assert got.is_cuda and got.dtype == torch.half  # PyTorch's own types, on the device
        assert _rel(got, want) < 5e-3


def test_first_call_under_inference_mode_then_outside_it():
    # the CUDA graph is captured on the first call; later calls outside inference mode copy
    # their inputs into the graph's, which must therefore be normal tensors
    _seed()
    m = ConvNet().cuda().eval().half()
    x = torch.randn(4, 3, 32, 32, device="cuda", dtype=torch.half)
    fast = tkt.compile(m, (x,), precision="fp16")
    with torch.inference_mode():
        first = fast(x)
    x2 = torch.randn_like(x)
    got = fast(x2)
    got += 0  # the caller may update what it gets
    with torch.no_grad():
        assert _rel(got, m(x2)) < 5e-3 and _rel(first, m(x)) < 5e-3


def test_bert_fp16_with_a_padding_mask():
    transformers = pytest.importorskip("transformers")
    _seed()
    cfg = transformers.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=256, vocab_size=1000)  # fmt: skip
    m = transformers.BertModel(cfg).cuda().eval()
    batch, seq = torch.export.Dim("batch", min=1, max=16), torch.export.Dim("seq", min=2, max=128)

    def feeds(b, s):
        mask = torch.ones(b, s, dtype=torch.int64, device="cuda")
        mask[-1, s // 2 :] = 0
        return {"input_ids": torch.randint(0, 1000, (b, s), device="cuda"), "attention_mask": mask}

    fast = tkt.compile(
        copy.deepcopy(m).half(), (), example_kwargs=feeds(4, 64), precision="fp16",
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
    )  # fmt: skip
    for b, s in ((1, 16), (16, 128)):
        f = feeds(b, s)
        got = fast(**f).last_hidden_state
        with torch.no_grad():
            want = m(**f).last_hidden_state
        valid = f["attention_mask"].bool()
        assert _rel(got[valid], want[valid]) < 5e-3


def test_torch_compile_backend_with_a_custom_op_on_the_gpu():
    @torch.library.custom_op("tk_gpu_test::double_it", mutates_args=())
    def double_it(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @double_it.register_fake
    def _(x):
        return torch.empty_like(x)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.b(torch.tanh(double_it(torch.relu(self.a(x))) + 1)).softmax(-1)

    _seed()
    torch._dynamo.reset()
    m = Net().cuda().eval()
    compiled = torch.compile(m, backend="tensorkiln", options={"min_block_size": 2})
    x = torch.randn(16, 64, device="cuda")
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-4, atol=1e-5)
    report = tkt.last_report()
    assert report.engines == 2 and "tk_gpu_test::double_it" in report.unsupported, str(report)
    torch._dynamo.reset()


def test_a_plugin_tactic_is_timed_and_checked():
    @tensorkiln.plugin("tk_gpu_test::SoftClip", attributes={"bound": 2.0})
    def p(x, *, bound):
        return x

    @p.reference
    def _(x, *, bound):
        return (np.tanh(x / np.float32(bound)) * np.float32(bound)).astype(x.dtype)

    @p.torch
    def _(x, *, bound):
        return torch.tanh(x / bound) * bound

    @p.tactic("hardtanh_approx")  # a wrong answer: the autotuner must reject it
    def _(x, *, bound):
        return x.clamp(-bound, bound)

    @p.tactic("fused")
    def _(x, *, bound):
        return torch.tanh(x * (1.0 / bound)).mul_(bound)

    from onnx import TensorProto, helper

    from tensorkiln.builder import Builder

    nodes = [helper.make_node("SoftClip", ["x"], ["y"], domain="tk_gpu_test", bound=1.5)]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 1024])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [256, 1024])],
    )  # fmt: skip
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("tk_gpu_test", 1)]
    )
    engine = Builder("cuda").build(model, progress=False)
    layer = next(x for x in engine.layers if x.get("op") == "tk_gpu_test.SoftClip")
    assert "plugin_fused" in layer.get("candidates", []), layer
    assert "plugin_hardtanh_approx" in (layer.get("rejected") or {}), layer
    x = np.random.default_rng().standard_normal((256, 1024)).astype(np.float32) * 3
    y = engine.create_execution_context().infer({"x": x})["y"]
    np.testing.assert_allclose(y, np.tanh(x / 1.5) * 1.5, rtol=1e-5, atol=1e-5)

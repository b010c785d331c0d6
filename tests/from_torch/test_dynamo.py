"""torch.compile(model, backend="tensorkiln"): blocks of supported ops become engines, the rest
(custom ops, ops the user keeps) runs in PyTorch; outputs checked against eager PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import tensorkiln.torch as tkt  # noqa: E402
from tensorkiln.errors import UnsupportedOpError  # noqa: E402
from tensorkiln.torch import dynamo  # noqa: E402


@torch.library.custom_op("tensorkiln_test::shift", mutates_args=())
def shift(x: torch.Tensor) -> torch.Tensor:
    """An op tensorkiln has never heard of."""
    return x + 0.5


@shift.register_fake
def _(x):
    return torch.empty_like(x)


class Net(torch.nn.Module):
    def __init__(self, custom: bool) -> None:
        super().__init__()
        self.custom = custom
        self.a = torch.nn.Linear(8, 16)
        self.bn = torch.nn.BatchNorm1d(16)
        self.b = torch.nn.Linear(16, 8)
        self.c = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.bn(self.a(x)))
        if self.custom:
            h = shift(h)
        return self.c(torch.tanh(self.b(h))).softmax(-1)


def _net(custom: bool) -> Net:
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    m = Net(custom)
    with torch.no_grad():
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def _check(compiled, m, sizes=(3, 5, 3)):
    with torch.no_grad():
        for n in sizes:
            x = torch.randn(n, 8)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-6)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_custom_op_runs_in_pytorch_and_the_rest_in_engines():
    m = _net(custom=True)
    _check(torch.compile(m, backend="tensorkiln", options={"backend": "cpu"}), m)
    report = tkt.last_report()
    assert report.engines == 2 and all(b.in_tensorkiln for b in report.blocks), str(report)
    assert "tensorkiln_test::shift" in report.unsupported
    assert "custom op" in report.unsupported["tensorkiln_test::shift"]


def test_a_supported_model_is_one_engine():
    m = _net(custom=False)
    _check(torch.compile(m, backend="tensorkiln", options={"backend": "reference"}), m)
    report = tkt.last_report()
    assert report.engines == 1 and not report.fallback, str(report)


def test_ops_the_user_keeps_in_pytorch_split_the_graph():
    m = _net(custom=False)
    opts = {"backend": "cpu", "torch_executed_ops": ["torch.tanh"], "min_block_size": 2}
    _check(torch.compile(m, backend="tensorkiln", options=opts), m)
    report = tkt.last_report()
    assert report.unsupported == {"torch.tanh": "torch_executed_ops"}, str(report)
    assert report.engines == 2


def test_blocks_below_the_minimum_size_stay_in_pytorch():
    m = _net(custom=False)
    opts = {"backend": "cpu", "min_block_size": 1000}
    _check(torch.compile(m, backend="tensorkiln", options=opts), m)
    report = tkt.last_report()
    assert report.engines == 0 and report.fallback
    assert all("min_block_size" in why for why in report.unsupported.values())


def test_a_block_that_fails_to_build_falls_back_with_its_reason(monkeypatch):
    def refuse(*args, **kwargs):
        raise UnsupportedOpError("no kernel for Frobnicate (node 'f')")

    monkeypatch.setattr(dynamo, "compile_module", refuse)
    m = _net(custom=False)
    _check(torch.compile(m, backend="tensorkiln", options={"backend": "cpu"}), m, sizes=(4,))
    report = tkt.last_report()
    assert report.engines == 0 and len(report.blocks) == 1
    assert report.blocks[0].reason == "UnsupportedOpError: no kernel for Frobnicate (node 'f')"


def test_an_unknown_option_is_named():
    m = _net(custom=False)
    compiled = torch.compile(m, backend="tensorkiln", options={"precison": "fp16"})
    with pytest.raises(Exception, match=r"unknown tensorkiln option\(s\) \['precison'\]"):
        compiled(torch.randn(2, 8))


def test_the_backend_is_found_by_name_and_as_a_function():
    assert "tensorkiln" in torch._dynamo.list_backends(exclude_tags=())
    m = _net(custom=True)
    _check(torch.compile(m, backend=tkt.backend, options={"backend": "cpu"}), m, sizes=(2,))


def _counting(monkeypatch) -> list:
    """Every engine the backend builds, as (block name, engine)."""
    built = []
    real = dynamo.compile_module

    def count(sub, args, **kw):
        compiled = real(sub, args, **kw)
        built.append(compiled.engine)
        return compiled

    monkeypatch.setattr(dynamo, "compile_module", count)
    return built


@pytest.mark.parametrize("custom", [False, True])
def test_bounded_dynamic_sizes_build_once_with_profiles(monkeypatch, custom):
    built = _counting(monkeypatch)
    m = _net(custom)
    compiled = torch.compile(
        m, backend="tensorkiln", options={"backend": "cpu", "min_block_size": 2}
    )
    with torch.no_grad():
        for n in (4, 7, 33, 64, 5):
            x = torch.randn(n, 8)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=64)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-6)
    assert len(built) == (2 if custom else 1), "one build per block, whatever the batch"
    for engine in built:
        (lo, _, hi), *_ = (s for s in engine.profiles[0].shapes.values())
        assert lo[0] == 2 and hi[0] == 64


def test_unbounded_dynamic_sizes_build_per_shape(monkeypatch):
    built = _counting(monkeypatch)
    m = _net(custom=False)
    compiled = torch.compile(m, backend="tensorkiln", options={"backend": "cpu"})
    with torch.no_grad():
        for n in (4, 7, 4):
            x = torch.randn(n, 8)
            torch._dynamo.mark_dynamic(x, 0)  # (no maximum: no profile to build for)
            torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-6)
    assert len(built) == 2  # sizes 4 and 7, the second 4 from the first build


class _Anchored(torch.nn.Module):
    """A plain tensor attribute (neither parameter nor buffer), as torchvision's SSD keeps its
    anchor sizes: .to(device) leaves such a tensor where it was."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.offsets = torch.randn(8)

    def forward(self, x):
        return torch.relu(self.lin(x)) * self.offsets.to(x.device) + self.offsets.sum()


def test_tensor_attributes_are_frozen_with_the_weights(monkeypatch):
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    m = _Anchored().eval()
    seen = []
    real = dynamo.compile_module

    def spy(sub, args, **kw):
        seen.append(len(args))
        return real(sub, args, **kw)

    monkeypatch.setattr(dynamo, "compile_module", spy)
    _check(torch.compile(m, backend="tensorkiln", options={"backend": "cpu"}), m)
    assert seen and set(seen) == {1}, seen  # x alone: the attribute is among its constants
    assert tkt.last_report().engines == 1

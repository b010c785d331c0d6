"""A torch.library custom op with a tensorkiln plugin of the same name: tensorkiln.torch maps the
one to the other, so the module builds as one engine; outputs checked against eager PyTorch."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import tensorkiln  # noqa: E402
import tensorkiln.torch as tkt  # noqa: E402
from tensorkiln.errors import UnsupportedOpError  # noqa: E402


@torch.library.custom_op("tk_torch_test::soft_clip", mutates_args=())
def soft_clip(x: torch.Tensor, bound: float = 3.0, squash: bool = True) -> torch.Tensor:
    return torch.tanh(x / bound) * bound if squash else x.clamp(-bound, bound)


@soft_clip.register_fake
def _(x, bound=3.0, squash=True):
    return torch.empty_like(x)


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 6)

    def forward(self, x):
        return soft_clip(self.a(x), 0.5) + soft_clip(x, squash=False)


def _net() -> Net:
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    return Net().eval()


def _register(calls: list) -> None:
    @tensorkiln.plugin("tk_torch_test::soft_clip", attributes={"bound": 3.0, "squash": 1})
    def p(x, *, bound, squash):
        return x

    @p.reference
    def _(x, *, bound, squash):
        b = np.float32(bound)
        return (np.tanh(x / b) * b if squash else np.clip(x, -b, b)).astype(x.dtype)

    @p.torch
    def _(x, *, bound, squash):
        calls.append((bound, squash))
        return torch.tanh(x / bound) * bound if squash else x.clamp(-bound, bound)


def test_without_a_plugin_the_op_is_named_with_the_remedies():
    # (a domain no test registers, so the order the tests run in does not matter)
    @torch.library.custom_op("tk_torch_test_none::twice", mutates_args=())
    def twice(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @twice.register_fake
    def _(x):
        return torch.empty_like(x)

    class Uses(torch.nn.Module):
        def forward(self, x):
            return twice(x) + 1

    with pytest.raises(UnsupportedOpError, match=r"tk_torch_test_none::twice.*tensorkiln.plugin"):
        tkt.compile(Uses(), (torch.randn(2, 6),), require_full_compilation=True, torch_ops=False)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_the_custom_op_runs_as_the_plugin(backend):
    calls: list = []
    _register(calls)
    m = _net()
    batch = torch.export.Dim("batch", min=1, max=8)
    fast = tkt.compile(m, (torch.randn(2, 6),), backend=backend, dynamic_shapes=({0: batch},))
    assert [n.op for n in fast.engine.graph.nodes].count("soft_clip") == 2
    for n in (1, 8):
        x = torch.randn(n, 6) * 3
        torch.testing.assert_close(fast(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    if backend == "cpu":  # the attributes reached the torch implementation as the op had them
        assert {(0.5, 1), (3.0, 0)} <= set(calls)


def test_torch_compile_keeps_a_plugin_op_inside_the_engine():
    torch._dynamo.reset()
    _register([])
    m = _net()
    compiled = torch.compile(m, backend="tensorkiln", options={"backend": "cpu"})
    with torch.no_grad():
        x = torch.randn(4, 6)
        torch.testing.assert_close(compiled(x), m(x), rtol=1e-5, atol=1e-5)
    report = tkt.last_report()
    assert report.engines == 1 and not report.fallback, str(report)
    torch._dynamo.reset()

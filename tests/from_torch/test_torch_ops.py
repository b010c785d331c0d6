"""Custom ops run by PyTorch inside an engine (tensorkiln/torch/torch_ops.py): which ops are
wrapped, and which names from an engine file are looked up at all."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

from tensorkiln.plugin import registered  # noqa: E402
from tensorkiln.torch import torch_ops  # noqa: E402


@torch.library.custom_op("tk_wrap_test::scale_rows", mutates_args=())
def scale_rows(x: torch.Tensor, factor: float = 2.0) -> torch.Tensor:
    return x * factor


@scale_rows.register_fake
def _(x, factor=2.0):
    return torch.empty_like(x)


@torch.library.custom_op("tk_wrap_test::fill_in_place", mutates_args=("x",))
def fill_in_place(x: torch.Tensor) -> None:
    x.fill_(1.0)


@torch.library.custom_op("tk_wrap_test::two_lists", mutates_args=())
def two_lists(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] + xs[1]


def test_names_an_engine_file_gives_are_looked_up_only_among_custom_ops():
    for name in ["aten::relu", "prims::add", "__class__::mro", "a b::c", "x::", "::y",
                 "tk_wrap_test::no_such_op"]:  # fmt: skip
        assert torch_ops.wrap_by_name(name) is False, name
        assert registered(name) is None, name
    assert torch_ops.wrap_by_name("tk_wrap_test::scale_rows") is True
    plugin = registered("tk_wrap_test::scale_rows")
    assert plugin is not None and plugin.version == "torch"


def test_ops_that_cannot_run_as_a_layer_are_not_wrapped():
    assert torch_ops.why_not(torch.ops.tk_wrap_test.fill_in_place.default) == (
        "it mutates its inputs"
    )
    assert "xs" in torch_ops.why_not(torch.ops.tk_wrap_test.two_lists.default)
    assert torch_ops.wrap([torch.ops.tk_wrap_test.fill_in_place.default]) == []
    assert registered("tk_wrap_test::fill_in_place") is None

"""Plugins: custom ops written in Python (TensorRT's plugins, without C++).

    import numpy as np
    import tensorkiln

    @tensorkiln.plugin("my_ops::ScaledTanh", version="1", attributes={"scale": 1.0})
    def scaled_tanh(x, *, scale):            # the shape rule: input descriptions in, outputs out
        return x                             # same dtype and shape as x

    @scaled_tanh.reference                   # numpy: the oracle every backend is checked against
    def _(x, *, scale):
        return (np.tanh(x) * scale).astype(x.dtype)

    @scaled_tanh.torch                       # optional: torch tensors on any device (cuda, cpu)
    def _(x, *, scale):
        return torch.tanh(x) * scale

    @scaled_tanh.tactic("triton_v1")         # optional: more candidates the autotuner times (GPU)
    def _(x, *, scale): ...

An ONNX node of domain ``my_ops`` and op ``ScaledTanh`` then imports, optimizes, builds and runs
like any other; a torch.library custom op of the same name (``my_ops::ScaledTanh``) maps to it in
tensorkiln.torch. Without a torch implementation the cuda and cpu backends run the reference on a
host copy (slow, but it runs).

The shape rule receives a :class:`TensorDesc` per input (dtype as a numpy dtype, shape with ints
for known sizes and strings for symbolic ones) and the attributes, and returns a TensorDesc or a
tuple of them. Kernels take the inputs positionally and the attributes as keywords (the declared
defaults filled in). Engines record each plugin's name and version, never its code: loading an
engine needs the same plugins registered first (import the module that registers them).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tensorkiln.errors import InputError
from tensorkiln.ir.dtypes import DType
from tensorkiln.ir.graph import TensorType
from tensorkiln.kernels.registry import register
from tensorkiln.kernels.tactics import LayerSpec, tactic
from tensorkiln.ops import define, rule

__all__ = ["Plugin", "TensorDesc", "plugin", "registered"]

_NAME = re.compile(r"^([A-Za-z_][\w.]*)::([A-Za-z_]\w*)$")
_RESERVED = {"", "ai.onnx", "ai.onnx.ml", "ai.onnx.preview.training", "com.microsoft", "tensorkiln"}


@dataclass(frozen=True)
class TensorDesc:
    """A tensor as a shape rule sees it: dtype (numpy) and shape (ints; strings for symbolic
    sizes; None for an unknown rank)."""

    dtype: np.dtype
    shape: tuple[int | str, ...] | None

    def like(self, *, dtype: Any = None, shape: Sequence[int | str] | None = None) -> TensorDesc:
        """This description with another dtype and/or shape."""
        return replace(
            self,
            dtype=self.dtype if dtype is None else np.dtype(dtype),
            shape=self.shape if shape is None else tuple(shape),
        )


class Plugin:
    """A registered custom op; its decorators add implementations."""

    def __init__(self, domain: str, op: str, version: str, attributes: dict, shape: Callable):
        self.domain, self.op, self.version = domain, op, version
        self.attributes = dict(attributes)
        self.shape_fn = shape
        self.implementations: list[str] = []

    @property
    def name(self) -> str:
        return f"{self.domain}::{self.op}"

    def __repr__(self) -> str:
        impls = ", ".join(self.implementations) or "none yet"
        return f"Plugin({self.name!r}, version={self.version!r}, implementations: {impls})"

    def reference(self, fn: Callable) -> Callable:
        """The numpy implementation (required: the reference backend runs it, and every other
        implementation is checked against it)."""
        register(self.op, domain=self.domain, backend="reference")(fn)
        if "torch" not in self.implementations:
            register(self.op, domain=self.domain, backend="cuda")(_on_host(fn))
        self.implementations.append("reference")
        return fn

    def torch(self, fn: Callable) -> Callable:
        """The implementation on torch tensors (the cuda backend's, and the cpu backend's)."""
        register(self.op, domain=self.domain, backend="cuda")(fn)
        self.implementations.append("torch")
        return fn

    def tactic(
        self, name: str, *, supports: Callable[[LayerSpec], bool] | None = None
    ) -> Callable[[Callable], Callable]:
        """A further implementation on torch tensors that the builder times against the others
        on the GPU (``supports(spec)`` says where it applies) and checks against the reference."""

        def decorator(fn: Callable) -> Callable:
            tactic(self.op, domain=self.domain, name=f"plugin_{name}", supports=supports)(fn)
            self.implementations.append(f"tactic {name}")
            return fn

        return decorator


_PLUGINS: dict[tuple[str, str], Plugin] = {}


def registered(name: str) -> Plugin | None:
    """The plugin registered as ``name`` ('domain::Op'), or None."""
    m = _NAME.fullmatch(name)
    return None if m is None else _PLUGINS.get((m.group(1), m.group(2)))


def plugin(
    name: str, *, version: str = "1", attributes: dict[str, Any] | None = None
) -> Callable[[Callable], Plugin]:
    """Register the custom op ``name`` ('domain::Op') with its shape rule (the decorated
    function) and its attributes' defaults. Registering a name again replaces it."""
    m = _NAME.fullmatch(name) if isinstance(name, str) else None
    if m is None:
        raise InputError(
            f"a plugin's name is 'domain::Op' (e.g. 'my_ops::ScaledTanh'), got {name!r}"
        )
    domain, op = m.groups()
    if domain in _RESERVED:
        raise InputError(
            f"plugin '{name}': domain '{domain}' belongs to ONNX or tensorkiln; pick your own"
        )
    if not isinstance(version, str) or not version:
        raise InputError(f"plugin '{name}': version must be a non-empty string")
    attributes = dict(attributes or {})

    def decorator(shape: Callable) -> Plugin:
        p = Plugin(domain, op, version, attributes, shape)
        rec = define(op, domain=domain, attributes=attributes, doc=f"plugin {name} v{version}")[0]
        rec.plugin_version = version
        rule(op, domain=domain)(_shape_rule(p))
        _PLUGINS[(domain, op)] = p
        return p

    return decorator


# ---------------------------------------------------------------------- adapters
def _shape_rule(p: Plugin) -> Callable:
    def infer(ctx: Any) -> list[TensorType | None]:
        descs = []
        for i in range(len(ctx.node.inputs)):
            t = ctx.type(i)
            if not isinstance(t, TensorType) or t.dtype is None:
                descs.append(None)
                continue
            shape = None if t.shape is None else tuple(d if isinstance(d, int) else str(d)
                                                       for d in t.shape)  # fmt: skip
            descs.append(TensorDesc(np.dtype(t.dtype.numpy), shape))
        attrs = {**p.attributes, **ctx.node.attrs}
        out = p.shape_fn(*descs, **attrs)
        outs = list(out) if isinstance(out, tuple | list) else [out]
        types = []
        for k, d in enumerate(outs):
            if not isinstance(d, TensorDesc):
                raise InputError(
                    f"plugin '{p.name}': its shape rule returned {type(d).__name__} for output "
                    f"{k}; return a TensorDesc (e.g. x.like(dtype=...)) or a tuple of them"
                )
            types.append(TensorType(DType.from_numpy(d.dtype), d.shape))
        return types

    return infer


def _on_host(fn: Callable) -> Callable:
    """A numpy implementation run on torch tensors through host copies."""

    def run(*args: Any, **kwargs: Any) -> Any:
        import torch  # lazy: torch (the cuda and cpu backends have it)

        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        host = [a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else a for a in args]
        out = fn(*host, **kwargs)
        outs = out if isinstance(out, tuple) else (out,)
        back = tuple(torch.from_numpy(np.ascontiguousarray(o)).to(device) for o in outs)
        return back if isinstance(out, tuple) else back[0]

    run.__signature__ = inspect.signature(fn)  # (the registry reads the keywords it names)
    return run

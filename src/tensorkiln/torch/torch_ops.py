"""Custom ops with no translation, run by PyTorch inside the engine.

A torch.library op that neither torch's ONNX exporter nor a tensorkiln plugin translates becomes
a plugin of its own name (``ns::op``, version ``torch``) whose implementations call the op: its
shape rule runs the op's fake (meta) kernel, its reference and torch implementations run the op
itself (the reference through torch CPU tensors). The module then builds as one engine with that
layer in PyTorch: fused, planned and captured in CUDA graphs with the rest, and saved like any
engine, since the engine names the op and holds none of its code. Loading such an engine needs
the op registered (import the module that defines it), as any plugin does.

Wrapped: ops of the ``default`` overload that mutate nothing, return tensors, and take tensors
and numbers, strings, or lists of them (what ONNX attributes hold).
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from tensorkiln.frontends.torch.export import ATTR_TYPES, TENSOR_TYPES
from tensorkiln.plugin import TensorDesc, plugin, registered
from tensorkiln.torch.module import TORCH_OPS as VERSION  # (the version of these plugins)

# sizes a symbolic dimension takes when the op's meta kernel is probed (two sets, to tell the
# dimensions that follow a symbol from the ones that are fixed)
_PROBES = ((1009, 1013, 1019, 1021, 1031, 1033), (2003, 2011, 2017, 2027, 2029, 2039))
_FRESH = itertools.count()  # new symbols' numbers, unique in the process


def why_not(target: Any) -> str | None:
    """Why ``target`` cannot run as a wrapped op (None: it can)."""
    if not isinstance(target, torch._ops.OpOverload):
        return "not a torch op"
    schema = target._schema
    if target._overloadname != "default":
        return f"overload '{target._overloadname}' (only 'default' is wrapped)"
    if schema.is_mutable:
        return "it mutates its inputs"
    if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
        return "it returns something other than tensors"
    for a in schema.arguments:
        if str(a.type) not in TENSOR_TYPES and str(a.type) not in ATTR_TYPES:
            return f"argument '{a.name}' of type {a.type}"
    return None


def wrap(targets: Iterable[Any]) -> list[str]:
    """Register a plugin for each op of ``targets`` that has none yet and can be wrapped;
    returns the names of the ops wrapped (already or now)."""
    names = []
    for target in targets:
        if why_not(target) is not None:
            continue
        name = f"{target.namespace}::{target._opname}"
        existing = registered(name)
        if existing is None:
            _register(target, name)
        elif existing.version != VERSION:
            continue  # (a plugin of the user's own)
        names.append(name)
    return names


def wrap_by_name(name: str) -> bool:
    """Wrap the op ``ns::op`` if torch has it registered (for loading an engine that uses it)."""
    ns, _, op = name.partition("::")
    if not (ns.isidentifier() and op.isidentifier()) or ns in ("aten", "prims"):
        return False  # (an engine file names it: only custom ops' namespaces are looked in)
    packet = getattr(getattr(torch.ops, ns, None), op, None)
    target = getattr(packet, "default", None)
    return bool(target is not None and wrap([target]))


def _register(target: torch._ops.OpOverload, name: str) -> None:
    arguments = list(target._schema.arguments)
    tensors = [a for a in arguments if str(a.type) in TENSOR_TYPES]
    attrs = [a for a in arguments if str(a.type) not in TENSOR_TYPES]
    defaults = {a.name: _attr_default(a) for a in attrs if a.has_default_value()}

    def call(*values: Any, **given: Any) -> Any:
        kwargs = {a.name: v for a, v in zip(tensors, values)}
        for a in attrs:
            if a.name in given:
                v = given[a.name]
                kwargs[a.name] = bool(v) if str(a.type) == "bool" else v
        return target(**kwargs)

    def shape(*descs: TensorDesc, **given: Any) -> Any:
        return _probe(call, descs, given)

    def reference(*values: Any, **given: Any) -> Any:
        out = call(*[torch.from_numpy(np.ascontiguousarray(v)) for v in values], **given)
        outs = out if isinstance(out, tuple) else (out,)
        results = tuple(o.detach().cpu().numpy() for o in outs)
        return results if isinstance(out, tuple) else results[0]

    params = [inspect.Parameter(a.name, inspect.Parameter.POSITIONAL_ONLY) for a in tensors]
    params += [
        inspect.Parameter(a.name, inspect.Parameter.KEYWORD_ONLY,
                          default=defaults.get(a.name, inspect.Parameter.empty))
        for a in attrs
    ]  # fmt: skip
    signature = inspect.Signature(params)
    for fn in (call, reference):  # (the kernel registry reads the keywords they take)
        fn.__signature__ = signature
    p = plugin(name, version=VERSION, attributes=defaults)(shape)
    p.reference(reference)
    p.torch(call)


def _attr_default(a: Any) -> Any:
    v = a.default_value
    return int(v) if isinstance(v, bool) else v


def _probe(call, descs: tuple, given: dict) -> Any:
    """Output descriptions from the op's meta kernel, run at two sets of sizes for the symbolic
    dimensions: a dimension equal to a symbol's size in both is that symbol, one equal in both
    is fixed, anything else a new symbol of its own."""
    symbols = sorted({d for desc in descs if desc is not None and desc.shape
                      for d in desc.shape if isinstance(d, str)})  # fmt: skip
    runs = []
    for sizes in _PROBES:
        if len(symbols) > len(sizes):
            raise ValueError(f"more than {len(sizes)} symbolic dimensions among the inputs")
        value = dict(zip(symbols, sizes))
        metas = [
            None if d is None
            else torch.empty([value.get(x, x) for x in d.shape], dtype=_torch_dtype(d.dtype),
                             device="meta")
            for d in descs
        ]  # fmt: skip
        out = call(*metas, **given)
        runs.append((value, out if isinstance(out, tuple) else (out,)))
    (v1, outs1), (v2, outs2) = runs
    by_size = {v1[s]: s for s in symbols}
    results = []
    for o1, o2 in zip(outs1, outs2):
        dims: list[int | str] = []
        for a, b in zip(o1.shape, o2.shape):
            if a == b:
                dims.append(int(a))
            elif a in by_size and v2[by_size[a]] == b:
                dims.append(by_size[a])
            else:
                dims.append(f"torch_op_{next(_FRESH)}")
        results.append(TensorDesc(np.dtype(_numpy_dtype(o1.dtype)), tuple(dims)))
    return tuple(results) if len(results) > 1 else results[0]


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def _numpy_dtype(dtype: torch.dtype) -> Any:
    return torch.zeros(0, dtype=dtype).numpy().dtype

"""CompiledModule: a torch.nn.Module that runs a tensorkiln engine, tensors in and out.

On the cuda backend the caller's device tensors go to the engine as they are and the engine's
device tensors come back (a CUDA graph per input shape by default, whose replay copies the inputs
into its buffers and its outputs out, as torch.compile's reduce-overhead does). On the reference
backend tensors pass as numpy views of the same memory where they can.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from tensorkiln.engine import Engine
from tensorkiln.engine.engine import used_plugins
from tensorkiln.errors import InputError
from tensorkiln.frontends.torch.export import flatten_inputs
from tensorkiln.kernels.cuda.convert import host_tensor, to_numpy

TORCH_OPS = "torch"  # the plugin version of custom ops run in PyTorch (torch_ops.py)


class CompiledModule(torch.nn.Module):
    """Runs ``engine`` for calls shaped like the module it was compiled from.

    ``leaves`` maps each leaf of the flattened (args, kwargs) to the engine input it feeds (None:
    a value baked into the engine, which ``constants`` holds and calls must repeat); ``in_spec``
    and ``out_spec`` are the module's input and output structures.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        in_spec: pytree.TreeSpec,
        out_spec: pytree.TreeSpec,
        leaves: Sequence[str | None],
        constants: Sequence[Any],
        name: str = "module",
        use_cuda_graph: bool | None = None,
    ) -> None:
        super().__init__()
        self.engine = engine
        self.name = name
        self.in_spec, self.out_spec = in_spec, out_spec
        self.leaves, self.constants = tuple(leaves), tuple(constants)
        self._kwarg_order = _kwarg_names(in_spec)
        self._outputs = [o.name for o in engine.outputs]
        backend = engine.runtime_backend
        # the torch device the engine's values live on; None: numpy arrays (reference backend)
        self._device = backend.device if backend.on_device else None
        graphs = backend.cuda_graphs if use_cuda_graph is None else use_cuda_graph
        self._use_cuda_graph = bool(graphs)
        self._device_type = "cpu" if self._device is None else torch.device(self._device).type
        # calls of positional tensors only, each an engine input: fed without the pytree walk
        self._positional = _positional_names(in_spec, self.leaves)
        self._local = threading.local()  # one execution context per calling thread

    def extra_repr(self) -> str:
        return f"{self.name}, engine={self.engine!r}"

    @property
    def torch_ops(self) -> list[str]:
        """The custom ops this engine runs in PyTorch (no translation of them exists)."""
        return [p["name"] for p in used_plugins(self.engine.graph) if p["version"] == TORCH_OPS]

    @property
    def context(self) -> Any:
        """This thread's execution context (each has its own activation memory)."""
        ctx = getattr(self._local, "ctx", None)
        if ctx is None:
            ctx = self.engine.create_execution_context(use_cuda_graph=self._use_cuda_graph)
            self._local.ctx = ctx
        return ctx

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        feeds = self._feeds(args, kwargs)
        results = self.context.infer(feeds)
        outs = [self._to_torch(results[n]) for n in self._outputs]
        return pytree.tree_unflatten(outs, self.out_spec)

    # ------------------------------------------------------------------ inputs
    def _feeds(self, args: tuple, kwargs: dict) -> dict[str, Any]:
        names = self._positional
        simple = names is not None and not kwargs and len(args) == len(names)
        if simple and all(isinstance(a, torch.Tensor) for a in args):
            return {n: self._from_torch(n, a) for n, a in zip(names, args)}
        if set(kwargs) == set(self._kwarg_order):
            kwargs = {k: kwargs[k] for k in self._kwarg_order}
        values, spec = flatten_inputs(args, kwargs)
        if spec != self.in_spec:
            raise InputError(
                f"{self.name} was compiled for calls shaped {_describe(self.in_spec)}, and was "
                f"called with {_describe(spec)}; compile it again for this call"
            )
        feeds = {}
        for i, (name, value) in enumerate(zip(self.leaves, values)):
            if name is None:
                self._check_constant(i, value, args, kwargs)
            elif not isinstance(value, torch.Tensor):
                raise InputError(
                    f"{self.name}: input '{name}' must be a torch.Tensor, got "
                    f"{type(value).__name__}"
                )
            else:
                feeds[name] = self._from_torch(name, value)
        return feeds

    def _check_constant(self, index: int, value: Any, args: tuple, kwargs: dict) -> None:
        want = self.constants[index]
        if isinstance(value, torch.Tensor) or (want is None and value is None):
            return  # (an input the model does not read)
        if type(value) is not type(want) or value != want:
            where = _leaf_name(args, kwargs, index)
            raise InputError(
                f"{self.name}: {where} was {want!r} when compiled and is {value!r} now; the "
                "engine has it built in: compile again for this value"
            )

    def _from_torch(self, name: str, t: torch.Tensor) -> Any:
        t = t.detach()
        want = self._device_type
        if t.device.type != want:
            where = "the GPU" if want == "cuda" else "the CPU"
            raise InputError(
                f"{self.name}: input '{name}' is on {t.device}; this engine ({self.engine.backend} "
                f"backend) runs on {where}: move the input there (x.to('{want}')), or compile "
                f"with example inputs on {t.device}"
            )
        if self._device is not None:
            return t
        return to_numpy(t)  # (a view of a contiguous tensor; bfloat16 as ml_dtypes holds it)

    def _to_torch(self, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        arr = np.asarray(value)
        return host_tensor(arr if arr.flags.writeable else arr.copy())


def _kwarg_names(in_spec: pytree.TreeSpec) -> list[str]:
    """The keyword names of an (args, kwargs) spec, in the order it holds them."""
    return list(_child(in_spec, 1).context or [])


def _positional_names(in_spec: pytree.TreeSpec, leaves: tuple) -> list[str] | None:
    """The engine inputs of a call that takes positional tensors only (no keywords, nothing
    nested, each an input), in order; None for any other call."""
    args = _child(in_spec, 0)
    if _kwarg_names(in_spec) or args.num_leaves != len(leaves) or None in leaves:
        return None
    flat = pytree.tree_flatten(tuple(range(len(leaves))))[1]
    return list(leaves) if args == flat else None


def _leaf_name(args: tuple, kwargs: dict, index: int) -> str:
    """'argument 0', "keyword 'scale'", "keyword 'cfg'['k']"... for leaf ``index`` of a call."""
    path = pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0][index][0]
    rest = pytree.keystr(path[2:])
    if getattr(path[0], "idx", 0) == 0:
        return f"argument {getattr(path[1], 'idx', '?')}{rest}"
    return f"keyword '{getattr(path[1], 'key', '?')}'{rest}"


def _child(spec: pytree.TreeSpec, index: int) -> pytree.TreeSpec:
    if hasattr(spec, "child"):  # (newer torch; children_specs is deprecated there)
        return spec.child(index)
    return spec.children_specs[index]


def _describe(spec: pytree.TreeSpec) -> str:
    args = _child(spec, 0)
    names = ", ".join(_kwarg_names(spec))
    return f"({args.num_leaves} positional leaves; keywords: {names or 'none'})"

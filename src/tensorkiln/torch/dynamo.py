"""``torch.compile(model, backend="tensorkiln")``: engines for what tensorkiln runs, PyTorch for the rest.

Dynamo hands the backend an FX graph of one traced region. The backend

1. freezes it: the module's parameters and buffers (graph inputs under dynamo's inlining of
   nn.Modules) become constants of the graph, so the builder folds and fuses them as it does an
   ONNX model's initializers (weights are read at the first call of each input signature, as
   torch.compile's freezing reads them: change them and compile again);
2. partitions it into the largest blocks of supported ops (torch.fx's capability-based
   partitioner; ops outside ATen with no ONNX translation, torch.library custom ops among them,
   and ops named in ``torch_executed_ops`` are not supported), keeping blocks of at least
   ``min_block_size`` ops;
3. builds an engine per block as tensorkiln.torch.compile builds a whole module; a block whose export or
   build fails stays in PyTorch, with the reason in the report.

The build happens at the first call. Where dynamo traced the graph's sizes as symbols with
bounds (``torch._dynamo.mark_dynamic(x, 0, min=2, max=64)``), each block's engine gets a profile
spanning them and is built once (ranges.py); otherwise an engine is built per signature of input
shapes, dtypes and numbers (at most ``max_signatures``; beyond that, calls run in PyTorch).
:func:`last_report` says what ran where.

Options (``torch.compile(..., options={...})``): ``precision`` ("fp32", "fp16", ... or a list),
``backend`` (tensorkiln's: "cuda", "cpu", "reference", "auto"), ``min_block_size`` (default 3),
``torch_executed_ops`` (op names kept in PyTorch, e.g. "aten.softmax" or "demo::op"),
``use_cuda_graph``, ``max_signatures`` (default 8).
"""

from __future__ import annotations

import copy
import logging
import operator
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase

from tensorkiln.errors import InputError
from tensorkiln.frontends.torch.export import translatable
from tensorkiln.torch.compiler import BuildOptions
from tensorkiln.torch.compiler import compile_whole as compile_module
from tensorkiln.torch.ranges import NotRanged, block_dims, sizes_from_tensors, symbol_ranges

log = logging.getLogger("tensorkiln.torch")

_OPTIONS = {
    "precision",
    "backend",
    "min_block_size",
    "torch_executed_ops",
    "use_cuda_graph",
    "max_signatures",
}


@dataclass
class Block:
    """One partition of a traced graph: its ops, and where it runs."""

    name: str
    ops: list[str]
    engine_layers: int | None = None  # the engine's layer count where it runs in tensorkiln
    reason: str | None = None  # why it runs in PyTorch

    @property
    def in_tensorkiln(self) -> bool:
        return self.engine_layers is not None


@dataclass
class Report:
    """What one compiled signature of one traced graph runs where."""

    blocks: list[Block] = field(default_factory=list)
    # ops left in PyTorch outside any block -> why
    unsupported: dict[str, str] = field(default_factory=dict)

    @property
    def engines(self) -> int:
        return sum(b.in_tensorkiln for b in self.blocks)

    @property
    def fallback(self) -> bool:
        return bool(self.unsupported) or any(not b.in_tensorkiln for b in self.blocks)

    def __str__(self) -> str:
        lines = [f"tensorkiln: {self.engines} engine(s), {len(self.blocks)} block(s)"]
        for b in self.blocks:
            where = (
                f"tensorkiln engine of {b.engine_layers} layers"
                if b.in_tensorkiln
                else f"PyTorch: {b.reason}"
            )
            lines.append(f"  {b.name}: {len(b.ops)} ops -> {where}")
        for op, why in self.unsupported.items():
            lines.append(f"  {op}: PyTorch ({why})")
        return "\n".join(lines)


_LAST: list[Report] = []


def last_report() -> Report | None:
    """The report of the latest signature compiled by the backend (None before any)."""
    return _LAST[-1] if _LAST else None


# ---------------------------------------------------------------------- the backend
def backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None, **_: Any
) -> Callable:
    """The torch.compile backend (registered as "tensorkiln")."""
    opts = _options(options)
    constants = _constant_positions(gm, example_inputs)
    frozen = _freeze(gm, example_inputs, constants)
    runtime = [i for i in range(len(example_inputs)) if i not in constants]
    try:  # sizes traced as bounded symbols: one build whose profiles span them (ranges.py)
        ranges = symbol_ranges(frozen)
        if ranges:
            removed = set(sizes_from_tensors(frozen))
            runtime = [r for k, r in enumerate(runtime) if k not in removed]
    except NotRanged as why:
        log.info("tensorkiln: building per input shape: %s", why)
        ranges = {}
    return _PerSignature(frozen, runtime, opts, ranges or None)


def _options(options: dict | None) -> dict:
    opts = dict(options or {})
    unknown = set(opts) - _OPTIONS
    if unknown:
        raise InputError(
            f"unknown tensorkiln option(s) {sorted(unknown)}; the backend takes "
            f"{', '.join(sorted(_OPTIONS))}"
        )
    opts.setdefault("precision", "fp32")
    opts.setdefault("backend", "auto")
    opts.setdefault("min_block_size", 3)
    opts.setdefault("max_signatures", 8)
    opts["torch_executed_ops"] = {_op_key(o) for o in opts.get("torch_executed_ops", ())}
    return opts


def _source_name(node: torch.fx.Node) -> str:
    source = getattr(node.meta.get("grapharg"), "source", None)
    name = getattr(source, "name", "")
    return name() if callable(name) else str(name)


def _constant_positions(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> set[int]:
    """Graph inputs that are the module's state: its parameters, buffers and plain tensor
    attributes (dynamo passes them as inputs when it inlines nn.Modules). Frozen for inference,
    as the module's weights are; a tensor attribute kept on the CPU (torchvision's SSD anchors)
    then travels with the engine instead of reaching it as a CPU input."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = set()
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if not isinstance(value, torch.Tensor):
            continue
        source = _source_name(node)
        if (
            isinstance(value, torch.nn.Parameter)
            or "._buffers[" in source
            or source.startswith("L['self']")
        ):
            out.add(i)
    return out


def _freeze(gm: torch.fx.GraphModule, example_inputs, constants: set[int]) -> torch.fx.GraphModule:
    """A copy of ``gm`` with its constant inputs as attributes (get_attr nodes) instead of
    placeholders (dynamo's own graph is left as it is: dynamo reads it after the backend)."""
    gm = torch.fx.GraphModule(gm, copy.deepcopy(gm.graph))
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i in sorted(constants):
        _as_attribute(gm, placeholders[i], f"_tk_constant_{i}", example_inputs[i].detach())
    gm.recompile()
    return gm


def _as_attribute(gm: torch.fx.GraphModule, placeholder: torch.fx.Node, name: str, value) -> None:
    """``gm``'s input ``placeholder`` replaced by ``value``, held as its buffer ``name``."""
    gm.register_buffer(name, value, persistent=False)
    with gm.graph.inserting_before(placeholder):
        attr = gm.graph.get_attr(name)
    placeholder.replace_all_uses_with(attr)
    gm.graph.erase_node(placeholder)


class _PerSignature:
    """The frozen graph, built at the first call of each input signature; or, where its
    dynamic sizes are bounded (``ranges``: symbol -> (min, max)), built once at the first call
    with profiles spanning them."""

    def __init__(
        self, frozen: torch.fx.GraphModule, runtime: list[int], opts: dict, ranges: dict | None
    ) -> None:
        self.frozen, self.runtime, self.opts, self.ranges = frozen, runtime, opts, ranges
        self.built: dict[tuple, Callable] = {}
        self.lock = threading.Lock()

    def __call__(self, *inputs: Any) -> Any:
        args = [inputs[i] for i in self.runtime]
        key = ("ranged",) if self.ranges else tuple(_signature(a) for a in args)
        run = self.built.get(key)
        if run is None:
            with self.lock:
                run = self.built.get(key) or self._build(key, args)
        return run(*args)

    def _build(self, key: tuple, args: list) -> Callable:
        if len(self.built) >= self.opts["max_signatures"]:
            log.warning(
                "tensorkiln: %d input signatures compiled already (max_signatures); this one runs "
                "in PyTorch",
                len(self.built),
            )
            self.built[key] = self.frozen
            return self.frozen
        if self.ranges:
            try:
                run, report = build_graph(self.frozen, args, self.opts, self.ranges)
            except NotRanged as why:
                log.info("tensorkiln: building per input shape: %s", why)
                self.ranges = None
                key = tuple(_signature(a) for a in args)
        if not self.ranges:
            run, report = build_graph(self.frozen, args, self.opts)
        _LAST[:] = [report]
        log.info("%s", report)
        if report.fallback:
            log.warning("tensorkiln: part of the graph runs in PyTorch:\n%s", report)
        self.built[key] = run
        return run


def _signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("t", tuple(value.shape), value.dtype, value.device.type)
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return ("s", repr(value))
    return ("v", type(value).__name__, value)


# ---------------------------------------------------------------------- partitioning
def _op_key(op: Any) -> str:
    """'aten.softmax', 'demo.twice', 'torch.relu', 'operator.add': how ops are named here."""
    if isinstance(op, str):
        return op.replace("::", ".").removesuffix(".default")
    if isinstance(op, torch._ops.OpOverload):
        return f"{op.namespace}.{op._opname}"
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name.replace("::", ".")
    module = getattr(op, "__module__", None) or ""
    return f"{module.split('.')[0]}.{getattr(op, '__name__', repr(op))}".lstrip(".")


def _custom_op(target: Any) -> str | None:
    """``ns::name`` where ``target`` is an op outside ATen that neither the ONNX exporter nor a
    tensorkiln plugin translates, else None."""
    if translatable(target):
        return None
    op = target.default if isinstance(target, torch._ops.OpOverloadPacket) else target
    return f"{op.namespace}::{op._opname}"


class _Support(OperatorSupportBase):
    def __init__(self, kept: set[str]) -> None:
        self.kept = kept
        self.reasons: dict[str, str] = {}

    def is_node_supported(self, submodules: Any, node: torch.fx.Node) -> bool:
        if node.op not in ("call_function", "call_method", "call_module"):
            return False  # (inputs and constants enter a block as its arguments)
        key = _op_key(node.target) if node.op == "call_function" else f"method.{node.target}"
        if key in self.kept:
            self.reasons[key] = "torch_executed_ops"
            return False
        custom = _custom_op(node.target) if node.op == "call_function" else None
        if custom is not None:
            self.reasons[custom] = "a custom op with no tensorkiln kernel and no ONNX translation"
            return False
        return True


def _compute_ops(nodes: Sequence[torch.fx.Node]) -> list[str]:
    """The ops of a partition that do work (not getitem, not size queries)."""
    out = []
    for n in nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        if n.op == "call_function" and n.target is operator.getitem:
            continue
        if n.op == "call_method" and n.target in ("size", "dim"):
            continue
        out.append(_op_key(n.target) if n.op == "call_function" else f"method.{n.target}")
    return out


def build_graph(
    frozen: torch.fx.GraphModule, args: Sequence[Any], opts: dict, ranges: dict | None = None
) -> tuple[torch.fx.GraphModule, Report]:
    """A copy of ``frozen`` with its supported blocks replaced by tensorkiln engines built for
    ``args`` (with profiles spanning ``ranges`` where given: raises NotRanged where a block's
    inputs cannot have them), and the report of what runs where."""
    gm = torch.fx.GraphModule(frozen, copy.deepcopy(frozen.graph))  # (shares the weights)
    support = _Support(opts["torch_executed_ops"])
    partitioner = CapabilityBasedPartitioner(gm, support, allows_single_node_partition=True)
    report = Report()
    proposed = partitioner.propose_partitions()
    kept = []
    for p in proposed:
        ops = _compute_ops(list(p.nodes))
        if len(ops) >= opts["min_block_size"]:
            kept.append(p)
        else:
            for op in ops:
                report.unsupported.setdefault(op, f"in a block of {len(ops)} ops < min_block_size")
    report.unsupported.update(support.reasons)
    if not kept:
        return gm, report
    gm = partitioner.fuse_partitions(kept, prefix="_tk_block_")
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.startswith("_tk_")]
    for node in calls:
        _inline_constants(gm, node)
    gm.recompile()
    dims: dict[str, Any] = {}  # symbol -> its Dim, shared by the blocks
    shapes = {n.target: block_dims(n, ranges, dims) for n in calls} if ranges else {}
    seen = _block_inputs(gm, {n.target for n in calls}, args)
    for node in calls:
        sub = gm.get_submodule(node.target)
        block = Block(node.target, _compute_ops([n for n in sub.graph.nodes]))
        report.blocks.append(block)
        block_args = seen.get(node.target)
        if block_args is None:
            block.reason = "not reached when run on the first call's inputs"
            continue
        try:
            built = BuildOptions(opts["precision"], opts["backend"],
                                 use_cuda_graph=opts.get("use_cuda_graph"), torch_ops=False)  # fmt: skip
            compiled = compile_module(
                sub, tuple(block_args), dynamic_shapes=shapes.get(node.target), options=built
            )
        except Exception as err:  # any failure leaves the block to PyTorch, with the reason
            block.reason = f"{type(err).__name__}: {str(err).strip().splitlines()[0][:300]}"
            continue
        block.engine_layers = compiled.engine.num_layers
        setattr(gm, node.target, compiled)
    gm.recompile()
    return gm, report


def _inline_constants(gm: torch.fx.GraphModule, call: torch.fx.Node) -> None:
    """The block's inputs that are the graph's constants become the block's own attributes."""
    sub = gm.get_submodule(call.target)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    kept = []
    for i, (arg, ph) in enumerate(zip(call.args, placeholders)):
        if isinstance(arg, torch.fx.Node) and arg.op == "get_attr":
            _as_attribute(sub, ph, f"_tk_constant_{i}", operator.attrgetter(arg.target)(gm))
        else:
            kept.append(arg)
    call.args = tuple(kept)
    sub.recompile()


class _Recorder(torch.fx.Interpreter):
    """Runs the graph in PyTorch once, keeping each block's inputs."""

    def __init__(self, gm: torch.fx.GraphModule, names: set[str]) -> None:
        super().__init__(gm)
        self.names, self.seen = names, {}

    def call_module(self, target, args, kwargs):
        if target in self.names:
            self.seen[target] = args
        return super().call_module(target, args, kwargs)


def _block_inputs(gm: torch.fx.GraphModule, names: set[str], args: Sequence[Any]) -> dict:
    recorder = _Recorder(gm, names)
    with torch.no_grad():
        recorder.run(*args)
    return recorder.seen

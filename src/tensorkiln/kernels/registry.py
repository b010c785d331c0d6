"""The kernel registry.

Kernels are registered with a decorator into a plain dict keyed by ``(backend, domain, op)``; each key
holds entries sorted by the opset version they apply from. :func:`lookup` picks the newest entry whose
``since`` is not above the model's opset for that domain.

A kernel takes the node's inputs positionally (``None`` for an omitted optional input) and its
attributes as keywords, resolved: :func:`node_kwargs` fills in the defaults the op's record gives at
the model's opset (ONNX's schema for that opset) for every keyword the kernel names, once per node
at plan time, so one kernel serves every opset whose attributes differ only in their defaults.
Keyword-only parameters whose name starts with ``_`` are special and are filled in when the
kernel's signature names them:

* ``_n_outputs``: how many outputs the node asks for (Split, MaxPool's indices, Dropout's mask, ...).
* ``_ctx``: the executor, for kernels that run subgraphs (If, Loop, Scan, SequenceMap).
* ``_opset``: the model's opset for the op's domain, for the one kernel of an op whose meaning
  changed between opsets (Softmax's axis, Resize's defaults, ...): no per-opset copies.

A kernel returns one value, or a tuple of values for several outputs. Values are numpy arrays
(strings as object arrays), lists of arrays for sequences, and ``None`` for an empty optional.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tensorkiln.errors import TensorkilnError, UnsupportedOpError
from tensorkiln.ops import DEFAULT_DOMAIN, attribute_defaults, normalize_domain

__all__ = [
    "DEFAULT_DOMAIN",
    "KernelEntry",
    "as_outputs",
    "has_kernel",
    "invoke",
    "lookup",
    "node_kwargs",
    "normalize_domain",
    "register",
    "registered_ops",
]


@dataclass(frozen=True, slots=True)
class KernelEntry:
    op: str
    domain: str
    since: int
    backend: str
    fn: Callable
    wants_n_outputs: bool
    wants_ctx: bool
    wants_opset: bool = False
    opset: int = 0  # the model's opset this entry was looked up for (set by lookup)


_REGISTRY: dict[tuple[str, str, str], list[KernelEntry]] = {}


def register(
    ops: str | Iterable[str],
    *,
    domain: str = DEFAULT_DOMAIN,
    since: int = 1,
    backend: str = "reference",
) -> Callable[[Callable], Callable]:
    """Register ``fn`` as the kernel of ``ops`` from opset ``since`` on (until a newer entry)."""
    names = [ops] if isinstance(ops, str) else list(ops)
    domain = normalize_domain(domain)

    def decorator(fn: Callable) -> Callable:
        params = inspect.signature(fn).parameters
        for op in names:
            entry = KernelEntry(
                op=op,
                domain=domain,
                since=since,
                backend=backend,
                fn=fn,
                wants_n_outputs="_n_outputs" in params,
                wants_ctx="_ctx" in params,
                wants_opset="_opset" in params,
            )
            entries = _REGISTRY.setdefault((backend, domain, op), [])
            entries[:] = [e for e in entries if e.since != since]
            entries.append(entry)
            entries.sort(key=lambda e: e.since)
        return fn

    return decorator


def invoke(
    entry: KernelEntry,
    args: list[Any],
    attrs: dict[str, Any],
    n_outputs: int,
    ctx: Any = None,
) -> list[Any]:
    """Call a kernel by the convention above; returns its outputs as a list, which may be longer
    than ``n_outputs`` (a kernel can compute outputs the node does not declare).

    Trailing omitted inputs (None) are dropped so the kernel's defaults apply; the attributes are
    resolved by :func:`node_kwargs`, and ``_ctx`` is passed when the kernel asks for it.
    Exceptions propagate.
    """
    args = list(args)
    while args and args[-1] is None:
        args.pop()
    kwargs = node_kwargs(entry, attrs, n_outputs)
    if entry.wants_ctx:
        kwargs["_ctx"] = ctx
    return as_outputs(entry.fn(*args, **kwargs), n_outputs)


def node_kwargs(entry: KernelEntry, attrs: dict[str, Any], n_outputs: int) -> dict[str, Any]:
    """The keywords ``entry``'s kernel is called with for a node with ``attrs`` and
    ``n_outputs`` outputs: the op's attribute defaults at the entry's opset for the keywords the
    kernel names, the node's attributes over them, then ``_n_outputs`` and ``_opset`` where the
    kernel asks for them (``_ctx`` is the caller's, per run)."""
    try:
        defaults = _defaults_for(entry.fn, entry.op, entry.domain, entry.opset)
    except TypeError:  # an unhashable callable (a tactic object): resolve without the cache
        defaults = _defaults_for.__wrapped__(entry.fn, entry.op, entry.domain, entry.opset)
    kwargs = {**defaults, **attrs}
    if entry.wants_n_outputs:
        kwargs["_n_outputs"] = n_outputs
    if entry.wants_opset:
        kwargs["_opset"] = entry.opset
    return kwargs


@functools.lru_cache(maxsize=8192)
def _defaults_for(fn: Callable, op: str, domain: str, opset: int) -> dict[str, Any]:
    # Only the keywords the kernel names: a kernel leaves out the attributes it does not read
    # (an old opset's `consumed_inputs`, ...), and a **kwargs kernel reads its own. (A cached dict
    # is shared: node_kwargs copies it.)
    names = _keyword_names(fn)
    if not names:
        return {}
    defaults = attribute_defaults(op, domain, opset)
    return {k: v for k, v in defaults.items() if k in names}


def _keyword_names(fn: Callable) -> frozenset[str]:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: its own defaults apply
        return frozenset()
    kinds = (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return frozenset(p.name for p in params if p.kind in kinds and not p.name.startswith("_"))


def as_outputs(result: Any, n_outputs: int) -> list[Any]:
    """A kernel's return value as the list of its outputs (see :func:`invoke`)."""
    if isinstance(result, tuple):
        # Several outputs, whatever the node declares: an LSTM that names only Y still gets
        # (Y, Y_h, Y_c) from its kernel; callers bind the ones the node declares.
        return list(result)
    if n_outputs == 1 or not isinstance(result, list):
        return [result]  # (a single output may itself be a list: a sequence)
    return result


# backends that run another backend's kernels: the cpu backend runs the cuda backend's torch
# kernels on CPU tensors (oneDNN convolutions and GEMMs), so it has no registry entries of its own
KERNELS_OF = {"cpu": "cuda"}

# the kernel trees (packages under tensorkiln/kernels) by registry key; importing one registers
# its kernels. True: the tree needs PyTorch (an optional dependency), so it is imported when a
# backend that runs it is first asked for, not before.
_TREES = {"reference": False, "cuda": True}
_LOADED: set[str] = set()


def _ensure_loaded(backend: str) -> None:
    tree = KERNELS_OF.get(backend, backend)
    if tree in _LOADED or tree not in _TREES:
        return
    if _TREES[tree]:
        try:
            import torch  # noqa: F401  (lazy: torch is optional)
        except ImportError:
            raise TensorkilnError(
                f"the {backend} backend needs PyTorch, and this Python has none; install the "
                "CPU build with `pip install torch --index-url "
                "https://download.pytorch.org/whl/cpu`, or use the reference backend"
            ) from None
    # lazy: a tree imports its kernels' optional dependencies (torch, triton)
    importlib.import_module(f"tensorkiln.kernels.{tree}")
    _LOADED.add(tree)


def host_ops(backend: str = "reference") -> dict[tuple[str, str], str]:
    """(domain, op) -> why, for the ops whose kernels on ``backend`` run on the host (a tree's
    ``host.HOST_OPS``; empty where it has none)."""
    _ensure_loaded(backend)
    tree = KERNELS_OF.get(backend, backend)
    try:  # lazy: the tree's own modules, loaded above
        module = importlib.import_module(f"tensorkiln.kernels.{tree}.host")
    except ModuleNotFoundError:
        return {}
    return dict(getattr(module, "HOST_OPS", {}))


def has_kernel(op: str, domain: str = "", backend: str = "reference") -> bool:
    _ensure_loaded(backend)
    backend = KERNELS_OF.get(backend, backend)
    return (backend, normalize_domain(domain), op) in _REGISTRY


def registered_ops(backend: str = "reference", domain: str | None = None) -> list[tuple[str, str]]:
    """Sorted (domain, op) pairs that have a kernel on ``backend``."""
    _ensure_loaded(backend)
    backend = KERNELS_OF.get(backend, backend)
    return sorted(
        (d, op) for (b, d, op) in _REGISTRY if b == backend and (domain is None or d == domain)
    )


def lookup(
    op: str, domain: str, opset: int, backend: str = "reference", node: str | None = None
) -> KernelEntry:
    """The kernel for ``op`` at ``opset``; raises UnsupportedOpError naming what exists."""
    _ensure_loaded(backend)
    shown_backend = backend
    backend = KERNELS_OF.get(backend, backend)
    domain = normalize_domain(domain)
    entries = _REGISTRY.get((backend, domain, op))
    best = None
    for e in entries or ():
        if e.since <= opset:
            best = e
    if best is not None:
        return _bound(best, opset)
    where = f"node '{node}' uses " if node else ""
    shown = domain or "ai.onnx"
    if not entries:
        known = [o for (b, d, o) in _REGISTRY if b == backend and d == domain]
        hint = difflib.get_close_matches(op, known, n=3)
        msg = (
            f"{where}operator '{op}' of domain '{shown}' (opset {opset}), which the "
            f"'{shown_backend}' backend does not support."
        )
        if hint:
            msg += f" Did you mean: {', '.join(hint)}?"
        domains = sorted({d or "ai.onnx" for (b, d, _) in _REGISTRY if b == backend})
        if domain not in {d for (b, d, _) in _REGISTRY if b == backend}:
            msg += f" Supported domains: {', '.join(domains)}."
        else:
            msg += f" {len(known)} operators of '{shown}' are supported; see `tensorkiln ops`."
        raise UnsupportedOpError(msg)
    versions = ", ".join(str(e.since) for e in entries)
    raise UnsupportedOpError(
        f"{where}'{op}' of domain '{shown}' at opset {opset}; the '{shown_backend}' backend "
        f"implements it from opset(s) {versions}. Convert the model to a newer opset "
        "(onnx.version_converter) and try again."
    )


# (registered entry's id, opset) -> (that entry, it bound to the opset); the entry is held, so
# its id is not reused while the pair is here
_BOUND: dict[tuple[int, int], tuple[KernelEntry, KernelEntry]] = {}


def _bound(entry: KernelEntry, opset: int) -> KernelEntry:
    """``entry`` with ``opset`` set, made once per pair (lookup runs for every node of every
    graph planned, folded or tuned)."""
    hit = _BOUND.get((id(entry), opset))
    if hit is not None and hit[0] is entry:
        return hit[1]
    bound = dataclasses.replace(entry, opset=opset)
    _BOUND[(id(entry), opset)] = (entry, bound)
    return bound

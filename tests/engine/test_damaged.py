"""A corpus of damaged engines: every one must be refused with EngineFormatError or
EngineCompatibilityError, by Engine.load and Engine.deserialize alike; never another exception,
never a crash, never an engine that loads.

Variants are drawn fresh on each run (positions, bits, lengths); the counts per kind are printed.
Edits of the plan or the tensor table are written back with the container's checksums recomputed
(tests/engine/container.py), so only the semantic validators can catch them; swapped tensor bytes
get a fresh container checksum but stale per-tensor checksums, which must catch them.
"""

from __future__ import annotations

import collections
import json
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.errors import EngineCompatibilityError, EngineFormatError, TensorkilnError
from tests.cli.helpers import CLI, FAST, assert_one_line_error
from tests.engine import container as C
from tests.engine import models as M

REFUSALS = (EngineFormatError, EngineCompatibilityError)
PLAN_KEYS = {
    "format_version": int,
    "tensorkiln_version": str,
    "backend": str,
    "target": dict,
    "io": dict,
    "profiles": list,
    "layers": list,
    "memory": dict,
    "source": dict,
    "build": dict,
    "graph": dict,
    "tensors": dict,
}
WRONG = {int: "1", str: 1, dict: [], list: {}}
RAW_RETYPE = {
    "FLOAT8E4M3FN": "FLOAT8E5M2",
    "FLOAT8E5M2": "FLOAT8E4M3FNUZ",
    "BFLOAT16": "FLOAT16",  # bfloat16 is stored as bytes; float16 is native, so this also differs
    "INT4": "UINT4",
    "UINT4": "INT4",
}


def _square_mlp() -> onnx.ModelProto:
    """Two layers with equal-shaped weights (so their bytes can be swapped)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    w = {
        k: numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), k)
        for k, s in (("w1", (16, 16)), ("w2", (16, 16)), ("b1", (16,)), ("b2", (16,)))
    }
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["h1"], name="add1"),
        helper.make_node("Relu", ["h1"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["m"], name="mm2"),
        helper.make_node("Add", ["m", "b2"], ["y"], name="add2"),
    ]
    graph = helper.make_graph(
        nodes,
        "square_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 16])],
        initializer=list(w.values()),
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _build(model: onnx.ModelProto, embed: bool, profile: tuple | None = None) -> bytes:
    config = BuilderConfig(embed_source=embed)
    if profile:
        name, rest = profile
        config.add_optimization_profile(
            OptimizationProfile().set_shape(name, (1, *rest), (4, *rest), (16, *rest))
        )
    return Builder().build(model, config).serialize()


@pytest.fixture(scope="module")
def engines() -> dict[str, bytes]:
    return {
        "square_mlp": _build(_square_mlp(), embed=False, profile=("x", (16,))),
        "cnn+source": _build(M.cnn(), embed=True, profile=("x", (3, 12, 12))),
        "control_flow+source": _build(M.control_flow(), embed=True),
        "typed_constants": _build(M.typed_constants(), embed=False),
        "float8_initializer": _build(M.float8_initializer(), embed=False),
    }


# --------------------------------------------------------------------------- variants
Variant = tuple[str, bytes]


def truncations(data: bytes, rng: np.random.Generator) -> Iterator[Variant]:
    st = C.payload_layout(data)["st_header"]
    cuts = {0, 1, 7, 8, 12, 16, 23, 24, 55, len(data) - 1}
    cuts |= {int(x) for x in rng.integers(0, C.HEADER.size, 4)}  # inside the header
    cuts |= {int(x) for x in rng.integers(st[0], st[0] + 8, 2)}  # inside the length prefix
    cuts |= {int(x) for x in rng.integers(st[0] + 8, st[1], 4)}  # inside the safetensors header
    cuts |= {int(x) for x in rng.integers(st[1], len(data), 6)}  # inside the weights
    for cut in sorted(cuts):
        yield "truncated", data[:cut]
    # Truncated payloads in a container resealed to match: the payload parser must catch them.
    for cut in rng.integers(C.HEADER.size + 1, len(data) - 1, 6):
        yield "truncated+resealed", C.reseal(data[: int(cut)])


def _flip(data: bytes, positions: np.ndarray, rng: np.random.Generator) -> bytes:
    out = bytearray(data)
    for p in positions:
        out[int(p)] ^= 1 << int(rng.integers(0, 8))
    return bytes(out)


def bit_flips(data: bytes, rng: np.random.Generator) -> Iterator[Variant]:
    lay = C.payload_layout(data)
    plan = C.plan_range(data)
    regions = {"header": lay["header"], "plan": plan, "weights": lay["weights"]}
    regions["file"] = (0, len(data))
    for name, (lo, hi) in regions.items():
        for _ in range(4):
            yield f"bit flip ({name})", _flip(data, rng.integers(lo, hi, 1), rng)
        for _ in range(2):
            yield (
                f"bit flips x2..8 ({name})",
                # distinct bytes: flipping one bit twice would give back the original
                _flip(
                    data, rng.choice(np.arange(lo, hi), int(rng.integers(2, 9)), replace=False), rng
                ),
            )
    # Weight bytes flipped and the container resealed: the per-tensor sha256 must catch it.
    lo, hi = lay["weights"]
    for _ in range(4):
        yield "bit flip (weights)+resealed", C.reseal(_flip(data, rng.integers(lo, hi, 1), rng))


def swaps(data: bytes, rng: np.random.Generator) -> Iterator[Variant]:
    c = C.unpack(data)
    keys = list(c.tensors)
    pairs = [
        (a, b)
        for i, a in enumerate(keys)
        for b in keys[i + 1 :]
        if c.tensors[a][:2] == c.tensors[b][:2] and c.tensors[a][2] != c.tensors[b][2]
    ]
    for a, b in pairs:
        d = c.copy()
        (ta, tb) = d.tensors[a], d.tensors[b]
        d.tensors[a], d.tensors[b] = (ta[0], ta[1], tb[2]), (tb[0], tb[1], ta[2])
        yield "swapped tensors", C.pack(d)
    # Bytes swapped between two places of the weights (any tensors), container resealed.
    lo, hi = C.payload_layout(data)["weights"]
    for _ in range(5):
        n = int(rng.integers(1, 9))
        i, j = sorted(int(x) for x in rng.choice(np.arange(lo, hi - n), 2, replace=False))
        out = bytearray(data)
        out[i : i + n], out[j : j + n] = data[j : j + n], data[i : i + n]
        if bytes(out) != data:
            yield "swapped bytes+resealed", C.reseal(bytes(out))


def _graph_edits(g: dict) -> Iterator[tuple[str, Callable[[dict], None]]]:
    """Edits of a graph dict (the plan's graph or a subgraph), each applied to a fresh copy."""
    first_node = next(
        i for i, n in enumerate(g["nodes"]) if n["inputs"] and n["inputs"][0] is not None
    )
    ids = [v["id"] for v in g["values"]]
    yield "dangling node input", lambda g: g["nodes"][first_node]["inputs"].__setitem__(0, 99999)
    yield "negative node input", lambda g: g["nodes"][first_node]["inputs"].__setitem__(0, -1)
    yield "node input as string", lambda g: g["nodes"][first_node]["inputs"].__setitem__(0, "0")
    yield "node input as bool", lambda g: g["nodes"][first_node]["inputs"].__setitem__(0, True)
    yield "dangling node output", lambda g: g["nodes"][-1]["outputs"].__setitem__(0, 99999)
    yield "dangling graph output", lambda g: g["outputs"].__setitem__(0, max(ids) + 1)
    yield "duplicated value id", lambda g: g["values"][-1].__setitem__("id", g["values"][0]["id"])
    yield "value id as float", lambda g: g["values"][0].__setitem__("id", 0.5)
    yield (
        "node output defines an input",
        lambda g: g["nodes"][-1]["outputs"].__setitem__(0, g["nodes"][first_node]["inputs"][0]),
    )
    yield "unknown op", lambda g: g["nodes"][-1].__setitem__("op", "NoSuchOp")
    yield "unknown domain", lambda g: g["nodes"][0].__setitem__("domain", "com.nobody")
    yield "op not a string", lambda g: g["nodes"][0].__setitem__("op", 5)
    yield "node without attrs", lambda g: g["nodes"][0].pop("attrs")
    yield "attrs as a list", lambda g: g["nodes"][0].__setitem__("attrs", [])
    yield (
        "unknown attribute kind",
        lambda g: g["nodes"][0]["attrs"].__setitem__("evil", {"pickle": "gASVAAAAAAAAAAB9lC4="}),
    )
    yield "attribute int as string", lambda g: g["nodes"][0]["attrs"].__setitem__("k", {"int": "1"})
    yield (
        "attribute with two kinds",
        lambda g: g["nodes"][0]["attrs"].__setitem__("k", {"int": 1, "str": "x"}),
    )
    yield (
        "attribute array missing",
        lambda g: g["nodes"][0]["attrs"].__setitem__("k", {"array": {"tensor": "no/such/tensor"}}),
    )
    yield "nodes reversed", lambda g: g["nodes"].reverse()
    yield "unknown dtype", lambda g: g["values"][0]["type"].__setitem__("tensor", "FLOAT128")
    yield "negative dim", lambda g: g["values"][0]["type"].__setitem__("shape", [-1])
    yield "float dim", lambda g: g["values"][0]["type"].__setitem__("shape", [1.5])
    yield "shape as string", lambda g: g["values"][0]["type"].__setitem__("shape", "12")
    yield "unknown type kind", lambda g: g["values"][0].__setitem__("type", {"map": 1})
    yield "values not a list", lambda g: g.__setitem__("values", {})
    yield "graph name not a string", lambda g: g.__setitem__("name", 3)
    consts = [v for v in g["values"] if "const" in v and "tensor" in v["const"]]
    if consts:
        name = consts[0]["name"]

        def const_shape(g: dict) -> None:
            v = next(v for v in g["values"] if v["name"] == name)
            v["type"]["shape"] = [*v["type"]["shape"], 1]

        def const_dtype(g: dict) -> None:
            v = next(v for v in g["values"] if v["name"] == name)
            v["type"]["tensor"] = "DOUBLE" if v["type"]["tensor"] != "DOUBLE" else "FLOAT"

        yield "constant shape differs from type", const_shape
        yield "constant dtype differs from type", const_dtype
        yield "initializer without data", lambda g: g["initializers"].__setitem__(0, g["inputs"][0])
        yield "initializer id dangling", lambda g: g["initializers"].__setitem__(0, 99999)


def _subgraph(plan: dict) -> dict | None:
    for n in plan["graph"]["nodes"]:
        for a in n["attrs"].values():
            if "graph" in a:
                return a["graph"]
    return None


def plan_edits(c: C.Container) -> Iterator[tuple[str, Callable[[C.Container], None]]]:
    """Named edits of a container; checksums are recomputed when it is packed."""
    yield "header: version 2", lambda c: setattr(c, "version", 2)
    yield "header: version 0", lambda c: setattr(c, "version", 0)
    yield "header: reserved field set", lambda c: setattr(c, "reserved", 1)
    yield "plan: format_version 2", lambda c: c.plan.__setitem__("format_version", 2)
    yield (
        "plan: tensorkiln_version 9.9.9",
        lambda c: c.plan.__setitem__("tensorkiln_version", "9.9.9"),
    )
    yield (
        "plan: tensorkiln_version 0.0.1",
        lambda c: c.plan.__setitem__("tensorkiln_version", "0.0.1"),
    )
    yield "target: backend 'tpu'", lambda c: c.plan.__setitem__("backend", "tpu")
    yield "target: backend 'Reference'", lambda c: c.plan.__setitem__("backend", "Reference")

    def cuda(c: C.Container) -> None:
        c.plan["backend"] = "cuda"
        c.plan["target"] = {"device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}

    yield "target: backend cuda for an H100", cuda
    yield "target: backend cuda, no target keys", lambda c: c.plan.update(backend="cuda", target={})
    for key, kind in PLAN_KEYS.items():
        yield f"plan: key '{key}' removed", lambda c, key=key: c.plan.pop(key)
        yield (
            f"plan: key '{key}' of wrong type",
            lambda c, key=key, kind=kind: c.plan.__setitem__(key, WRONG[kind]),
        )
        yield f"plan: key '{key}' null", lambda c, key=key: c.plan.__setitem__(key, None)
    yield "plan: a list", lambda c: setattr(c, "plan", [c.plan])
    yield "plan: not JSON", lambda c: setattr(c, "plan_text", json.dumps(c.plan)[:-1])
    yield "plan: deeply nested", lambda c: setattr(c, "plan_text", "[" * 100_000 + "]" * 100_000)
    yield "plan: metadata removed", lambda c: setattr(c, "with_plan", False)

    # io, layers, profiles
    io = c.plan["io"]
    yield (
        "io/layers/profiles: io input renamed",
        lambda c: c.plan["io"]["inputs"][0].__setitem__("name", "other"),
    )
    yield "io/layers/profiles: io output dropped", lambda c: c.plan["io"]["outputs"].pop()
    yield (
        "io/layers/profiles: io output added",
        lambda c: c.plan["io"]["outputs"].append(dict(io["outputs"][0])),
    )
    yield "io/layers/profiles: io outputs reordered", lambda c: c.plan["io"]["outputs"].reverse()
    yield (
        "io/layers/profiles: io input dtype",
        lambda c: c.plan["io"]["inputs"][0].__setitem__("dtype", "INT8"),
    )
    yield (
        "io/layers/profiles: io inputs as strings",
        lambda c: c.plan["io"].__setitem__("inputs", [d["name"] for d in io["inputs"]]),
    )
    yield "io/layers/profiles: layer dropped", lambda c: c.plan["layers"].pop()
    yield (
        "io/layers/profiles: layer added",
        lambda c: c.plan["layers"].append(dict(c.plan["layers"][0])),
    )
    yield (
        "io/layers/profiles: profile for an unknown input",
        lambda c: c.plan["profiles"].append({"ghost": {"min": [1], "opt": [1], "max": [1]}}),
    )
    yield (
        "io/layers/profiles: profile min > max",
        lambda c: c.plan["profiles"].append(
            {io["inputs"][0]["name"]: {"min": [5], "opt": [4], "max": [3]}}
        ),
    )
    yield "io/layers/profiles: profile not an object", lambda c: c.plan["profiles"].append([1, 2])
    yield (
        "io/layers/profiles: memory buffer past the peak",
        lambda c: c.plan["memory"]["buffers"][0].__setitem__(2, c.plan["memory"]["peak_bytes"] + 1),
    )
    yield (
        "io/layers/profiles: memory buffer truncated",
        lambda c: c.plan["memory"]["buffers"][0].pop(),
    )
    yield (
        "io/layers/profiles: memory peak negative",
        lambda c: c.plan["memory"].update(peak_bytes=-1),
    )
    yield (
        "io/layers/profiles: memory buffers an object",
        lambda c: c.plan["memory"].update(buffers={}),
    )
    yield (
        "io/layers/profiles: profile dims not numbers",
        lambda c: c.plan["profiles"].append(
            {io["inputs"][0]["name"]: {"min": ["a"], "opt": ["b"], "max": ["c"]}}
        ),
    )
    yield "graph: opsets removed", lambda c: c.plan["graph"].pop("opsets")
    yield "graph: opset version a string", lambda c: c.plan["graph"]["opsets"].__setitem__("", "21")
    yield "graph: opset version 0", lambda c: c.plan["graph"]["opsets"].__setitem__("", 0)

    for name, edit in hostile_values(c):
        yield f"hostile value: {name}", edit
    for name, edit in memory_edits(c):
        yield f"memory plan: {name}", edit
    for name, edit in description_edits(c):
        yield f"description: {name}", edit
    for name, edit in _graph_edits(c.plan["graph"]):
        yield f"graph: {name}", lambda c, edit=edit: edit(c.plan["graph"])
    if _subgraph(c.plan) is not None:
        for name, edit in _graph_edits(_subgraph(c.plan)):
            yield f"subgraph: {name}", lambda c, edit=edit: edit(_subgraph(c.plan))

    # the tensor table against the stored tensors
    weights = [k for k in c.tensors if not k.startswith("source/")]
    key = max(weights, key=lambda k: len(c.tensors[k][2]))
    table = lambda c: c.plan["tensors"]  # noqa: E731
    yield (
        "table: shape edited",
        lambda c: table(c)[key].__setitem__("shape", [*table(c)[key]["shape"], 1]),
    )
    yield (
        "table: shape reversed",
        lambda c: table(c)[key].__setitem__("shape", [*reversed(table(c)[key]["shape"]), 2]),
    )
    yield "table: shape a string", lambda c: table(c)[key].__setitem__("shape", "16")
    for dtype in ("INT32", "UINT8", "FLOAT16", "DOUBLE", "STRING", "NOPE", 1):
        yield (
            f"table: dtype -> {dtype}",
            lambda c, dtype=dtype: table(c)[key].__setitem__("dtype", dtype),
        )
    # Types stored as raw bytes are typed by the table alone: retype each to another of its width.
    for k, info in c.plan["tensors"].items():
        other = RAW_RETYPE.get(info["dtype"])
        if other:
            yield (
                f"table: {info['dtype']} -> {other} ({k})",
                lambda c, k=k, other=other: table(c)[k].__setitem__("dtype", other),
            )
    yield "table: sha256 edited", lambda c: table(c)[key].__setitem__("sha256", "0" * 64)
    yield "table: entry missing", lambda c: table(c).pop(key)
    yield "table: entry not an object", lambda c: table(c).__setitem__(key, [1])
    yield "table: extra entry", lambda c: table(c).__setitem__("ghost", dict(table(c)[key]))

    def tensor_missing(c: C.Container) -> None:
        del c.tensors[key]
        del c.plan["tensors"][key]

    def extra_tensor(c: C.Container) -> None:
        raw = b"\x00" * 16
        c.tensors["extra/unused"] = ("U8", [16], raw)
        c.plan["tensors"]["extra/unused"] = {
            "dtype": "UINT8",
            "shape": [16],
            "sha256": C.digest(raw, "UINT8", [16]),
        }

    def stored_dtype(c: C.Container) -> None:
        dt, shape, raw = c.tensors[key]
        c.tensors[key] = ("I32" if dt == "F32" else "F32", shape, raw)

    yield "table: tensor missing (consistent table)", tensor_missing
    yield "table: extra unreferenced tensor", extra_tensor
    yield "table: stored dtype differs from table", stored_dtype

    # embedded source model
    if "source/model.onnx" in c.tensors:

        def source_removed(c: C.Container) -> None:
            del c.tensors["source/model.onnx"]
            del c.plan["tensors"]["source/model.onnx"]

        def source_replaced(c: C.Container) -> None:
            raw = M.mlp().SerializeToString()
            c.tensors["source/model.onnx"] = ("U8", [len(raw)], raw)
            c.plan["tensors"]["source/model.onnx"] = {
                "dtype": "UINT8",
                "shape": [len(raw)],
                "sha256": C.digest(raw, "UINT8", [len(raw)]),
            }

        yield "source: embedded model removed", source_removed
        yield "source: embedded model replaced", source_replaced
        yield "source: says not embedded", lambda c: c.plan["source"].__setitem__("embedded", False)


# Where the plan wants a count (a dim, a size, a step), what a stranger can write instead.
BAD_COUNTS = {
    "Infinity": math.inf,
    "-Infinity": -math.inf,
    "NaN": math.nan,
    "2**64": 2**64,
    "-1": -1,
    "true": True,
    "1.5": 1.5,
    "a list": [1],
}


def _first_shaped_tensor(c: C.Container) -> str:
    return next(k for k, v in c.plan["tensors"].items() if v["shape"])


def hostile_values(c: C.Container) -> Iterator[tuple[str, Callable[[C.Container], None]]]:
    """Fields of the wrong type or range, one per section of the plan (the schema's job)."""
    plan = c.plan
    x = plan["io"]["inputs"][0]["name"]
    key = _first_shaped_tensor(c)
    for label, bad in BAD_COUNTS.items():
        yield (
            f"table shape {label}",
            lambda c, bad=bad: c.plan["tensors"][key]["shape"].__setitem__(0, bad),
        )
        if plan["profiles"] and x in plan["profiles"][0]:
            for end in ("min", "max"):
                yield (
                    f"profile {end} {label}",
                    lambda c, bad=bad, end=end: c.plan["profiles"][0][x][end].__setitem__(0, bad),
                )
        yield (
            f"io shape {label}",
            lambda c, bad=bad: c.plan["io"]["inputs"][0]["shape"].__setitem__(-1, bad),
        )
        yield (
            f"graph value dim {label}",
            lambda c, bad=bad: c.plan["graph"]["values"][0]["type"]["shape"].__setitem__(-1, bad),
        )
        if plan["memory"].get("buffers"):
            yield (
                f"memory buffer size {label}",
                lambda c, bad=bad: c.plan["memory"]["buffers"][0].__setitem__(2, bad),
            )
            yield f"memory peak {label}", lambda c, bad=bad: c.plan["memory"].update(peak_bytes=bad)
    layer = lambda c: c.plan["layers"][0]  # noqa: E731
    yield "layer name a list", lambda c: layer(c).__setitem__("name", ["fc1"])
    yield "layer op a list", lambda c: layer(c).__setitem__("op", ["Gemm"])
    yield "layer tactic a list", lambda c: layer(c).__setitem__("tactic", ["default"])
    yield "layer tactic_eager an object", lambda c: layer(c).__setitem__("tactic_eager", {})
    yield (
        "layer timings Infinity",
        lambda c: layer(c).__setitem__("timings_ms", {"default": math.inf}),
    )
    yield "layer rejected a list", lambda c: layer(c).__setitem__("rejected", ["x"])
    yield "layer fallback a number", lambda c: layer(c).__setitem__("fallback", 5)
    yield "build notes a string", lambda c: c.plan["build"].__setitem__("notes", "kept fp32")
    yield "layer a string", lambda c: c.plan["layers"].__setitem__(0, "fc1")
    yield "io name a list", lambda c: c.plan["io"]["inputs"][0].__setitem__("name", [x])
    yield "io dtype unknown", lambda c: c.plan["io"]["inputs"][0].__setitem__("dtype", "FLOAT128")
    yield "io entry a string", lambda c: c.plan["io"]["outputs"].__setitem__(0, "y")
    yield "source name a list", lambda c: c.plan["source"].__setitem__("name", ["m.onnx"])
    yield "source embedded a string", lambda c: c.plan["source"].__setitem__("embedded", "yes")
    yield "build precision a list", lambda c: c.plan["build"].__setitem__("precision", ["fp32"])
    yield (
        "build config precisions a string",
        lambda c: c.plan["build"].setdefault("config", {}).__setitem__("precisions", "fp32"),
    )
    yield (
        "build optimization level Infinity",
        lambda c: (
            c.plan["build"].setdefault("config", {}).__setitem__("optimization_level", math.inf)
        ),
    )
    yield (
        "build phase time NaN",
        lambda c: c.plan["build"]["phases_s"].__setitem__("parse", math.nan),
    )
    yield "target value an object", lambda c: c.plan["target"].__setitem__("device", {"a": 1})
    yield "table sha256 a list", lambda c: c.plan["tensors"][key].__setitem__("sha256", ["0"])
    yield "profile range a list", lambda c: c.plan["profiles"].append({x: [[1], [1], [1]]})


def memory_edits(c: C.Container) -> Iterator[tuple[str, Callable[[C.Container], None]]]:
    """Memory plans that are consistent in themselves but not the graph's: contexts reserve
    device memory from the plan, so it must be exactly what the graph needs."""
    if not c.plan["memory"].get("buffers"):
        return

    def grow(c: C.Container, size: int) -> None:
        m = c.plan["memory"]
        b = m["buffers"][0]
        m["naive_bytes"] += size - b[2]
        b[2] = size
        m["peak_bytes"] = max(m["peak_bytes"], b[1] + size)

    yield "a buffer of 40 GiB", lambda c: grow(c, 40 << 30)
    yield "a buffer of 2**62 bytes", lambda c: grow(c, 2**62)
    yield "a buffer of 256 bytes more", lambda c: grow(c, c.plan["memory"]["buffers"][0][2] + 256)
    yield "peak of 40 GiB", lambda c: c.plan["memory"].update(peak_bytes=40 << 30)
    yield "naive bytes edited", lambda c: c.plan["memory"].update(naive_bytes=1)
    yield (
        "buffer named after an input",
        lambda c: c.plan["memory"]["buffers"][0].__setitem__(0, c.plan["io"]["inputs"][0]["name"]),
    )
    yield "buffer lives longer", lambda c: c.plan["memory"]["buffers"][0].__setitem__(4, 10**6)
    yield "buffer moved", lambda c: c.plan["memory"]["buffers"][0].__setitem__(1, 1 << 20)
    yield "buffer dropped", lambda c: c.plan["memory"]["buffers"].pop()
    yield (
        "buffer duplicated",
        lambda c: c.plan["memory"]["buffers"].append(list(c.plan["memory"]["buffers"][0])),
    )
    yield "alignment 1", lambda c: c.plan["memory"].update(alignment=1)
    yield "dynamic value added", lambda c: c.plan["memory"]["dynamic"].append("ghost")
    yield "extra key", lambda c: c.plan["memory"].update(reserve_bytes=40 << 30)


def description_edits(c: C.Container) -> Iterator[tuple[str, Callable[[C.Container], None]]]:
    """Well-typed descriptions (io, layers) that disagree with the graph: inspect shows them."""
    layer = lambda c: c.plan["layers"][0]  # noqa: E731
    x = lambda c: c.plan["io"]["inputs"][0]  # noqa: E731
    yield "layer renamed", lambda c: layer(c).__setitem__("name", "other")
    yield "layer op changed", lambda c: layer(c).__setitem__("op", "Conv")
    yield "layer outputs changed", lambda c: layer(c).__setitem__("outputs", ["ghost"])
    yield "layer inputs dropped", lambda c: layer(c).__setitem__("inputs", [])
    yield "io shape: a dim grown", lambda c: x(c)["shape"].__setitem__(-1, x(c)["shape"][-1] + 1)
    yield "io shape: a dim renamed", lambda c: x(c)["shape"].__setitem__(0, "batch")
    yield "io shape: unknown", lambda c: x(c).__setitem__("shape", None)


def edited(data: bytes) -> Iterator[Variant]:
    base = C.unpack(data)
    unchanged = C.pack(base)
    for name, edit in plan_edits(base):
        c = base.copy()
        edit(c)
        blob = C.pack(c)
        if blob != unchanged:  # some edits do nothing to some engines (one output, one node)
            yield f"edit: {name}", blob


def foreign(data: bytes, rng: np.random.Generator) -> Iterator[Variant]:
    """Things that are not engines at all, or not in the right places."""
    for n in (0, 10, 56, 57, 1000, 5000):
        yield "random bytes", rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    yield "random bytes after a good header start", data[:16] + rng.bytes(200)
    yield "random payload in a sealed container", C.wrap(rng.bytes(int(rng.integers(1, 4000))))
    onnx_bytes = M.mlp().SerializeToString()
    yield "ONNX file", onnx_bytes
    yield "ONNX file in a sealed container", C.wrap(onnx_bytes)
    yield "huge payload length", C.HEADER.pack(C.MAGIC, 1, 0, 2**63, b"\0" * 32) + data[56:]
    yield "empty safetensors", C.wrap(C.pack_payload(C.Container(1, 0, {}, {})))
    yield (
        "plan only, no weights",
        C.wrap(C.pack_payload(C.Container(1, 0, C.unpack(data).plan, {}))),
    )


def corpus(engines: dict[str, bytes], rng: np.random.Generator) -> Iterator[tuple[str, str, bytes]]:
    for label, data in engines.items():
        for gen in (truncations, bit_flips, swaps, foreign):
            for kind, blob in gen(data, rng):
                yield label, kind, blob
        for kind, blob in edited(data):
            yield label, kind, blob


# --------------------------------------------------------------------------- tests
def _outcome(load: Callable[[], Engine]) -> str | None:
    """None when refused properly; otherwise what happened instead."""
    try:
        engine = load()
    except REFUSALS as exc:
        assert isinstance(exc, TensorkilnError)
        assert str(exc), "an empty error message"
        return None
    except Exception as exc:  # the point of the test: report, do not crash
        return f"{type(exc).__name__}: {exc}"[:300]
    return f"loaded: {engine!r}"


def test_repacked_engines_still_load(engines: dict[str, bytes]) -> None:
    # The corpus helpers must not damage anything on their own.
    for label, data in engines.items():
        assert Engine.deserialize(C.pack(C.unpack(data))).num_layers > 0, label
        assert Engine.deserialize(C.reseal(data)).num_layers > 0, label


def test_damaged_corpus_is_refused(engines: dict[str, bytes], tmp_path: Path) -> None:
    t0 = time.perf_counter()
    rng = np.random.default_rng()
    counts: collections.Counter[str] = collections.Counter()
    failures = []
    path = tmp_path / "damaged.engine"
    for label, kind, blob in corpus(engines, rng):
        counts[":".join(kind.split(":")[:2]) if kind.startswith("edit") else kind] += 1
        path.write_bytes(blob)
        loaders = {
            "deserialize": lambda b=blob: Engine.deserialize(b),
            "load": lambda: Engine.load(path),
        }
        for how, load in loaders.items():
            problem = _outcome(load)
            if problem:
                failures.append(f"{label} / {kind} / {how}: {problem}")
    total = sum(counts.values())
    print(f"\n{total} damaged variants in {time.perf_counter() - t0:.1f} s:")
    for kind, n in sorted(counts.items()):
        print(f"  {n:4d}  {kind}")
    assert total >= 200
    assert not failures, f"{len(failures)} variants were not refused:\n" + "\n".join(failures)


# What a refusal of a hostile plan says: which field is damaged, or what disagrees with the graph.
EXPLAINED = (
    "damaged at",
    "memory plan does not match",
    "but its node has",
    "in the plan but the graph has",
)


def test_hostile_plans_are_one_line_errors_everywhere(
    engines: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # Each hostile field through the library and through the commands that read engines: a
    # one-line error naming the problem and exit code 1, never a traceback.
    cli = CLI(capsys)
    base = C.unpack(engines["square_mlp"])
    path = tmp_path / "hostile.engine"
    cases = [*hostile_values(base), *memory_edits(base), *description_edits(base)]
    problems = []
    for name, edit in cases:
        c = base.copy()
        edit(c)
        path.write_bytes(C.pack(c))
        try:
            Engine.load(path)
            problems.append(f"{name}: Engine.load accepted it")
        except EngineFormatError as exc:
            if not any(words in str(exc) for words in EXPLAINED):
                problems.append(f"{name}: Engine.load said {exc}")
        except Exception as exc:  # the point of the test: report, do not crash
            problems.append(f"{name}: Engine.load raised {type(exc).__name__}: {exc}")
        for command in (["inspect", path], ["inspect", path, "--json"], ["run", path, *FAST]):
            rc, _, err = cli(*command)
            try:
                assert_one_line_error(rc, err)
            except AssertionError:
                problems.append(f"{name}: {command[0]} gave rc {rc}: {err[-300:]}")
    assert len(cases) >= 60
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


def test_hostile_plans_are_one_line_errors_in_build_from_engine(
    engines: dict[str, bytes], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    # A rebuild reads the old plan's profiles and build settings without loading the engine.
    cli = CLI(capsys)
    base = C.unpack(engines["cnn+source"])
    path, out = tmp_path / "hostile.engine", tmp_path / "rebuilt.engine"
    problems = []
    # (the graph is not read: the rebuild starts from the embedded model)
    for name, edit in [(n, e) for n, e in hostile_values(base) if not n.startswith("graph")]:
        c = base.copy()
        edit(c)
        path.write_bytes(C.pack(c))
        rc, _, err = cli("build", "--from-engine", path, "-o", out)
        try:
            assert_one_line_error(rc, err)
            assert "damaged" in err and not out.exists()
        except AssertionError:
            problems.append(f"{name}: rc {rc}: {err[-300:]}")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda p: p["layers"][0].__setitem__("name", ["fc1"]),
            "plan.layers[0].name: expected a string, found a list",
        ),
        (
            lambda p: p["profiles"][0]["x"]["max"].__setitem__(0, math.inf),
            "plan.profiles[0]['x'].max[0]: expected an integer, found the number inf",
        ),
        (
            lambda p: p["tensors"]["const/w1"]["shape"].__setitem__(0, 2**64),
            "plan.tensors['const/w1'].shape[0]: 18446744073709551616 is outside 0..",
        ),
        (
            lambda p: p["memory"]["buffers"][0].__setitem__(2, True),
            "plan.memory.buffers[0][2]: expected an integer, found a boolean",
        ),
        (
            lambda p: p["build"]["phases_s"].__setitem__("parse", math.nan),
            "plan.build.phases_s['parse']: expected a finite number, found the number nan",
        ),
        (
            lambda p: p["io"]["inputs"][0].__setitem__("dtype", "FLOAT\x1b[2J"),
            "plan.io.inputs[0].dtype: 'FLOAT\\x1b[2J' is not one of the known names",
        ),
    ],
    ids=["layer name", "profile max", "table shape", "buffer size", "phase time", "io dtype"],
)
def test_schema_errors_name_the_field(engines: dict[str, bytes], edit, message: str) -> None:
    c = C.unpack(engines["square_mlp"])
    edit(c.plan)
    with pytest.raises(EngineFormatError) as exc:
        Engine.deserialize(C.pack(c))
    assert message in str(exc.value) and "rebuild" in str(exc.value), str(exc.value)
    assert "\x1b" not in str(exc.value)


def test_missing_file_and_folder_are_refused(tmp_path: Path) -> None:
    with pytest.raises(EngineFormatError, match="does not exist"):
        Engine.load(tmp_path / "nope.engine")
    with pytest.raises(EngineFormatError):
        Engine.load(tmp_path)


def test_onnx_file_gets_a_hint(tmp_path: Path) -> None:
    with pytest.raises(EngineFormatError, match="looks like an ONNX model"):
        Engine.deserialize(M.mlp().SerializeToString())


def test_compatibility_errors_say_how_to_rebuild(engines: dict[str, bytes]) -> None:
    for label, data in engines.items():
        c = C.unpack(data)
        c.plan["tensorkiln_version"] = "9.9.9"
        with pytest.raises(EngineCompatibilityError) as exc:
            Engine.deserialize(C.pack(c))
        text = str(exc.value)
        assert "9.9.9" in text and "tensorkiln build" in text
        if "+source" in label:
            assert "--from-engine" in text, text
        else:
            assert "--from-engine" not in text and "model.onnx" in text, text


def test_cuda_engine_names_its_device(engines: dict[str, bytes]) -> None:
    c = C.unpack(engines["square_mlp"])
    c.plan["backend"] = "cuda"
    c.plan["target"] = {"device": "NVIDIA H100 80GB HBM3", "compute_capability": "9.0"}
    with pytest.raises(EngineCompatibilityError, match=r"H100.*9\.0"):
        Engine.deserialize(C.pack(c))


def test_version_mismatch_in_header(engines: dict[str, bytes]) -> None:
    c = C.unpack(engines["square_mlp"])
    c.version = 2
    with pytest.raises(EngineCompatibilityError, match=r"format version 2.*reads version 1"):
        Engine.deserialize(C.pack(c))

"""Imports point down the pipeline, never up (DESIGN.md); no function-level import hides a cycle.

The layers, from the top (a module may import its own layer and any layer below it):

    cli, serve, onnx_backend, plugin, torch, the package facade (tensorkiln/__init__, __main__)
    builder
    passes, precision, tactics          (one layer: siblings may import each other)
    engine
    runtime
    backends
    frontends                           (ONNX -> IR: op facts, and the reference kernels to fold)
    kernels
    ops
    ir
    errors, version

frontends sits below the runtime (the runtime's Runner imports a model) and above the kernels
(the importer folds constants with the reference kernels, and expands a model-local function
only where no kernel implements its op).

A function-level import of a tensorkiln module is allowed only where it says why, on its line (or
the line above) as ``# lazy: <reason>``, the reason naming an optional dependency the imported
module pulls in (torch, triton) or CLI start time. Anything else (a cycle hidden in a function)
fails, with the file, the line and both layers.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from onnx import TensorProto, helper

import tensorkiln
from tensorkiln.builder import Builder

SRC = Path(tensorkiln.__file__).resolve().parent
PACKAGE = "tensorkiln"

# top-level package (or module) -> rank; higher ranks sit higher in the pipeline
LAYERS: dict[str, int] = {
    "errors": 0,
    "version": 0,
    "ir": 1,
    "ops": 2,
    "kernels": 3,
    "frontends": 4,
    "backends": 5,
    "runtime": 6,
    "engine": 7,
    "passes": 8,
    "precision": 8,
    "tactics": 8,
    "builder": 9,
    "cli": 10,
    "serve": 10,
    "onnx_backend": 10,
    "plugin": 10,  # tensorkiln.plugin: custom ops registered into ops, kernels and tactics
    "torch": 10,  # tensorkiln.torch: PyTorch modules in and out (it builds engines)
    "__init__": 10,  # the package facade: tensorkiln.run_onnx, tensorkiln.Runner, ...
    "__main__": 10,
}

LAZY = re.compile(r"#\s*lazy:\s*(.+)$")
LAZY_REASONS = ("torch", "triton", "cli start time")

# Imports the redesign left to remove: none. Nothing may be added here.
PENDING_UPWARD: set[tuple[str, str]] = set()
PENDING_FUNCTION_LEVEL: set[tuple[str, str]] = set()


@dataclass(frozen=True)
class Found:
    path: Path
    line: int
    module: str  # the importing module
    target: str  # the imported module
    in_function: bool
    marker: str | None  # the `# lazy:` reason, if any

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def _module_name(path: Path, root: Path = SRC.parent) -> tuple[str, bool]:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts = parts[:-1]
    return ".".join(parts), is_package


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = _absolute(node, module, is_package)
    # `from tensorkiln import backends` imports the submodule tensorkiln.backends
    if base == PACKAGE:
        return [f"{PACKAGE}.{a.name}" for a in node.names]
    return [base]


def _marker(lines: list[str], lineno: int) -> str | None:
    for text in (lines[lineno - 1], lines[lineno - 2] if lineno >= 2 else ""):
        m = LAZY.search(text)
        if m:
            return m.group(1).strip()
    return None


def _imports(path: Path, root: Path = SRC.parent) -> list[Found]:
    """Every import of a tensorkiln module in ``path`` (a file of the package under ``root``)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    module, is_package = _module_name(path, root)
    tree = ast.parse(text, filename=str(path))
    nested: set[int] = set()
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
            nested.update(id(n) for n in ast.walk(fn) if n is not fn)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Import | ast.ImportFrom):
            continue
        for target in _targets(node, module, is_package):
            if target == PACKAGE or target.startswith(PACKAGE + "."):
                inner = id(node) in nested
                mark = _marker(lines, node.lineno) if inner else None
                where = path.relative_to(root)
                found.append(Found(where, node.lineno, module, target, inner, mark))
    return found


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _all_imports() -> list[Found]:
    return [f for path in sorted(SRC.rglob("*.py")) for f in _imports(path)]


def test_every_package_has_a_layer() -> None:
    unknown = sorted({_layer(_module_name(p)[0]) for p in SRC.rglob("*.py")} - set(LAYERS))
    assert not unknown, f"give these a layer in tests/test_layers.py and DESIGN.md: {unknown}"


def _upward(found: list[Found]) -> list[str]:
    """One message per import of a higher layer."""
    bad = []
    for f in found:
        src, dst = _layer(f.module), _layer(f.target)
        if LAYERS[dst] > LAYERS[src] and (src, dst) not in PENDING_UPWARD:
            bad.append(
                f"{f.where()}: {f.module} ({src}) imports {f.target} ({dst}), a higher layer"
            )
    return bad


def _unexplained(found: list[Found]) -> list[str]:
    """One message per function-level import without an allowed ``# lazy:`` reason."""
    bad = []
    for f in found:
        if not f.in_function or (f.module, f.target) in PENDING_FUNCTION_LEVEL:
            continue
        if (_layer(f.module), _layer(f.target)) in PENDING_UPWARD:
            continue
        reason = (f.marker or "").lower()
        if not reason.startswith(LAZY_REASONS):
            why = f"marked '{f.marker}'" if f.marker else "not marked"
            bad.append(
                f"{f.where()}: {f.module} ({_layer(f.module)}) imports {f.target} "
                f"({_layer(f.target)}) inside a function, {why}; import it at the top, or mark "
                "it `# lazy: torch|triton|CLI start time` where that is the reason"
            )
    return bad


def test_imports_point_down() -> None:
    bad = _upward(_all_imports())
    assert not bad, "imports that run up the pipeline:\n" + "\n".join(bad)


def test_function_level_imports_say_why() -> None:
    bad = _unexplained(_all_imports())
    assert not bad, "function-level imports without a reason:\n" + "\n".join(bad)


def test_the_check_finds_and_names_violations(tmp_path: Path) -> None:
    """On a probe module: module-level, relative, function-level and marked imports are found,
    and an upward or unexplained one is reported with its file, line and both layers."""
    found = {(f.target, f.in_function) for f in _imports(SRC / "runtime" / "context.py")}
    assert ("tensorkiln.runtime.executor", False) in found
    probe = tmp_path / PACKAGE / "runtime" / "probe.py"
    probe.parent.mkdir(parents=True)
    probe.write_text(
        "from . import executor\n"
        "def f():\n"
        "    from tensorkiln.builder import Builder\n"
        "    # lazy: torch (the cuda tree imports it)\n"
        "    import tensorkiln.kernels.cuda\n"
        "    import tensorkiln.ir  # lazy: it was slow once\n",
        encoding="utf-8",
    )
    found = _imports(probe, tmp_path)
    assert {(f.target, f.in_function, f.marker) for f in found} == {
        ("tensorkiln.runtime", False, None),
        ("tensorkiln.builder", True, None),
        ("tensorkiln.kernels.cuda", True, "torch (the cuda tree imports it)"),
        ("tensorkiln.ir", True, "it was slow once"),
    }
    where = f"{Path(PACKAGE) / 'runtime' / 'probe.py'}"
    assert _upward(found) == [
        f"{where}:3: tensorkiln.runtime.probe (runtime) imports tensorkiln.builder (builder), "
        "a higher layer"
    ]
    unexplained = _unexplained(found)
    assert [m.split(": ", 1)[0] for m in unexplained] == [f"{where}:3", f"{where}:6"]
    assert "(runtime) imports tensorkiln.ir (ir) inside a function, marked" in unexplained[1]


def test_loading_and_running_an_engine_imports_nothing_above_the_engine(tmp_path: Path) -> None:
    """The runtime side (engine, runtime, backends) stands alone: no builder, autotuner, optimizer
    or precision code, and no torch for a reference engine."""
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "relu",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "relu.engine"
    Builder("reference").build(model.SerializeToString(), progress=False).save(path)
    script = (
        "import sys, numpy as np\n"
        "from tensorkiln.engine import Engine\n"
        f"engine = Engine.load({str(path)!r})\n"
        "x = np.random.default_rng().standard_normal((2, 3)).astype(np.float32)\n"
        "with engine.create_execution_context() as ctx:\n"
        "    assert np.array_equal(ctx.infer({'x': x})['y'], np.maximum(x, 0))\n"
        "above = ('builder', 'tactics', 'passes', 'precision', 'cli')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[:2][-1] in above\n"
        "             and m.startswith('tensorkiln.')), 'torch' in sys.modules)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC.parent)}
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]", "False"]

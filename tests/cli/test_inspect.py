"""`tensorkiln inspect`: layers, IO with profile ranges, memory, target and source of an engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.cli.helpers import assert_one_line_error
from tests.cli.test_build import _as_if_from_elsewhere
from tests.engine import container as C


@pytest.fixture
def engine(cli, mlp, tmp_path):
    path = tmp_path / "mlp.engine"
    # level 0 keeps the model's own layers, which the assertions below name
    rc, _, err = cli("build", mlp, "-o", path, "--embed-source", "--opt-level", "0",
                     "--backend", "reference",  # (the layer names checked below are its kernels)
                     "--min-shapes", "x:1x4", "--opt-shapes", "x:2x4", "--max-shapes", "x:8x4")  # fmt: skip
    assert rc == 0, err
    return path


def test_inspect_engine_text(cli, engine):
    rc, out, err = cli("inspect", engine)
    assert rc == 0, err
    lines = out.splitlines()
    for name, op, impl in (("fc1", "MatMul", "reference:math.matmul"), ("act1", "Relu", "relu")):
        assert any(
            line.split()[:2] == [name, op] and impl in line and "f32" in line
            for line in lines
            if line.strip()
        )
    assert any(
        line.split()[:5] == ["input", "x", "FLOAT", "[N,", "4]"]
        and "min [1, 4] opt [2, 4] max [8, 4]" in line
        for line in lines
    )
    assert any(line.split()[:3] == ["output", "y", "FLOAT"] for line in lines)
    assert "layers (4)" in out and "planned peak" in out and "naive" in out
    assert "backend reference" in out and "device cpu" in out and "tensorkiln 0.1.0" in out
    assert (
        "source: mlp.onnx" in out and "embedded: yes" in out and "loads on this machine: yes" in out
    )


def test_inspect_engine_json(cli, engine):
    info = cli.json("inspect", engine, "--json")
    assert [x["name"] for x in info["layers"]] == ["fc1", "bias1", "act1", "fc2"]
    keys = {"name", "op", "impl", "precision", "compute_precision", "format"}
    assert all(set(x) == keys for x in info["layers"])
    # the reference backend computes every layer in float32, laid out as the model's tensors
    assert {(x["compute_precision"], x["format"]) for x in info["layers"]} == {("fp32", "linear")}
    (x,) = info["inputs"]
    assert x["shape"] == ["N", 4] and x["dynamic_axes"] == [0]
    assert x["profiles"] == [{"min": [1, 4], "opt": [2, 4], "max": [8, 4]}]
    assert info["outputs"][0]["name"] == "y"
    assert info["memory"]["peak_bytes"] <= info["memory"]["naive_bytes"]
    assert info["source"]["embedded"] is True and len(info["source"]["sha256"]) == 64
    assert info["target"]["device"] == "cpu" and info["loadable_here"] is True
    assert info["weights"]["tensors"] == 3


def test_inspect_engine_from_elsewhere_says_it_does_not_load(cli, engine, tmp_path):
    foreign = _as_if_from_elsewhere(engine, tmp_path / "foreign.engine")
    rc, out, err = cli("inspect", foreign)
    assert rc == 0, err
    assert "loads on this machine: no" in out and "NVIDIA H100" in out
    assert cli.json("inspect", foreign, "--json")["loadable_here"] is False


def test_inspect_onnx_prints_the_ir(cli, mlp):
    rc, out, _ = cli("inspect", mlp)
    assert rc == 0 and "%y: f32[N,3] = MatMul(%h2, %w2)" in out
    info = cli.json("inspect", mlp, "--json")
    assert [n["op"] for n in info["nodes"]] == ["MatMul", "Add", "Relu", "MatMul"]
    assert info["inputs"] == [{"name": "x", "dtype": "FLOAT", "shape": ["N", 4]}]


def test_inspect_damaged_engine(cli, engine):
    data = bytearray(engine.read_bytes())
    data[-5] ^= 0xFF
    engine.write_bytes(bytes(data))
    rc, _, err = cli("inspect", engine)
    assert_one_line_error(rc, err)
    assert "corrupted" in err


# Strings an engine (or a model) can carry that a terminal would obey: colours, clearing the
# screen, blinking, a window-title escape ended by BEL, a cursor report request, a bidi override.
ESCAPES = ("\x1b[31m", "\x1b[2J", "\x1b[5m", "\x1b]0;pwned\x07", "\x1b[6n", "\x1b[7m", "\u202e")
MARKUP = ("[bold]", "[red]layer[/red]", "[blink]")  # rich markup must show as typed


def _hostile_model(path: Path) -> tuple[Path, str]:
    """x -> MatMul -> Relu -> y with names full of escapes and markup (ONNX allows any string)."""
    x, y, h, w = "x\x1b[31m[bold]in", "y\x07\x1b]0;pwned\x07", "h\u202e", "w\x1b[2J"
    weight = np.random.default_rng().standard_normal((4, 3)).astype(np.float32)
    nodes = [
        helper.make_node("MatMul", [x, w], [h], name="fc\x1b[2J[red]layer[/red]"),
        helper.make_node("Relu", [h], [y], name="act\x1b[5m"),
    ]
    graph = helper.make_graph(
        nodes,
        "g\x1b[6n",
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N\x1b[7m", 4])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["N\x1b[7m", 3])],
        initializer=[numpy_helper.from_array(weight, w)],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path, x


@pytest.fixture
def hostile(cli, tmp_path):
    """An engine whose every printed string carries escapes: names from its model, and the
    layers' op, kernel, tactic, timings and rejections, the target, source, build record and
    version edited into the plan (checksums recomputed). Its version makes it an engine from
    elsewhere, which inspect describes without the content checks that loading runs."""
    model, x = _hostile_model(tmp_path / "hostile.onnx")
    path = tmp_path / "hostile.engine"
    rc, _, err = cli("build", model, "-o", path, "--opt-level", "0", "--min-shapes", f"{x}:1x4",
                     "--opt-shapes", f"{x}:2x4", "--max-shapes", f"{x}:8x4")  # fmt: skip
    assert rc == 0, err
    c = C.unpack(path.read_bytes())
    c.plan["layers"][0].update(
        op="MatMul\x1b[5m[blink]",
        impl="reference:math.matmul\x1b[7m",
        tactic="t\x1b]0;pwned\x07",
        timings_ms={"t\x1b]0;pwned\x07": 0.5, "other\x1b[31m[bold]": 0.7},
        rejected={"bad\x1b[2J": "why\x1b[5m"},
    )
    c.plan["target"]["machine"] = "x86\x1b[6n[bold]"
    c.plan["source"]["name"] = "model\x1b[2J[blink].onnx"
    c.plan["build"]["config"]["precisions"] = ["fp32\x1b[31m"]
    c.plan["tensorkiln_version"] = "0.0.9\x1b[5m[blink]"
    path.write_bytes(C.pack(c))
    return path


def _assert_shown_not_obeyed(out: str) -> None:
    for seq in ESCAPES:
        assert seq not in out, f"{seq!r} reached the terminal"
    assert "\x07" not in out
    assert "\\x1b[31m" in out and "\\x1b]0;pwned\\x07" in out
    for tag in MARKUP:
        assert tag in out, f"{tag} was not shown as typed"
    for name in ("fc\\x1b[2J[red]layer[/red]", "act\\x1b[5m", "t\\x1b]0;pwned\\x07"):
        assert name in out


def test_inspect_escapes_what_an_engine_names(cli, hostile):
    rc, out, err = cli("inspect", hostile)
    assert rc == 0, err
    _assert_shown_not_obeyed(out)
    assert "model\\x1b[2J[blink].onnx" in out and "x86\\x1b[6n[bold]" in out
    assert "loads on this machine: no" in out and "tensorkiln 0.0.9\\x1b[5m[blink]" in out


def test_inspect_escapes_in_rich_tables(cli, hostile, monkeypatch):
    # In a terminal the tables go through rich, which would read '[bold]' as markup.
    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("COLUMNS", "400")  # no wrapping, no cells cut short
    rc, out, err = cli("inspect", hostile)
    assert rc == 0, err
    _assert_shown_not_obeyed(out)


def test_inspect_json_escapes_control_characters(cli, hostile):
    rc, out, err = cli("inspect", hostile, "--json")
    assert rc == 0, err
    assert not any(ord(ch) < 0x20 and ch not in "\n " for ch in out)
    info = json.loads(out)  # the names themselves survive, escaped by JSON
    assert info["layers"][0]["tactic"] == "t\x1b]0;pwned\x07"
    assert info["inputs"][0]["name"] == "x\x1b[31m[bold]in"


def test_inspect_onnx_escapes_names(cli, tmp_path):
    model, _ = _hostile_model(tmp_path / "hostile.onnx")
    rc, out, err = cli("inspect", model)
    assert rc == 0, err
    for seq in ESCAPES:
        assert seq not in out
    assert "# fc\\x1b[2J[red]layer[/red]" in out and "%h\\u202e" in out

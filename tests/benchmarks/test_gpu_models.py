"""benchmarks/gpu_models.py end to end on torch CPU tensors with tiny models (--device cpu --tiny),
in a subprocess as the GPU machine runs it: every row is measured and checked for agreement, the
per-model files merge into the same table, and a second call adds peers to the first's rows."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_models.py"
ROWS = {"resnet50": [4, 1], "bert": [4, 1], "vit": [4, 1], "gpt2": [4, 1], "bert_large": [4]}


def _script_peers() -> tuple[str, ...]:
    """benchmarks/gpu_models.py's PEERS, read from its source (importing it runs its setup)."""
    tree = ast.parse(SCRIPT.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["PEERS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("benchmarks/gpu_models.py has no PEERS")


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


# every peer but the 8-bit ones, whose Triton kernels run through the interpreter here at two
# minutes for the five models: test_int8_and_fp8_rows runs them where they are checked
SMOKE_PEERS = ",".join(p for p in _script_peers() if p not in ("tensorkiln-int8", "tensorkiln-fp8"))


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gpu_models")
    # (under two minutes on two cores; the limit only catches a hang)
    r = _run(
        "--device", "cpu", "--tiny", "--out", str(out), "--inductor-cache", str(out / "ic"),
        "--peers", SMOKE_PEERS, timeout=480,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return out


def test_int8_and_fp8_rows(tmp_path: Path) -> None:
    """The calibrated INT8 and FP8 engines beside the fp16 one, a conv net and a transformer:
    measured, and as far from PyTorch fp32 as 8 bits put them (further than fp16, not lost)."""
    r = _run(
        "--device", "cpu", "--tiny", "--out", str(tmp_path), "--models", "resnet50,bert",
        "--batch", "1", "--peers", "tensorkiln,tensorkiln-int8,tensorkiln-fp8,eager",
        "--inductor-cache", str(tmp_path / "ic"), "--quantize-all", "--tactic-sources",
        "triton,cudnn", "--tactic-exclude", "cutlass_fp8_*vd", "--tactic-timeout", "200", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("resnet50", "bert"):
        (row,) = json.loads((tmp_path / f"{name}.json").read_text())["rows"]
        fp16 = row["peers"]["tensorkiln"]["err"]
        for peer in ("tensorkiln-int8", "tensorkiln-fp8"):
            cell = row["peers"][peer]
            assert "failed" not in cell and cell["value"] > 0, (name, peer, cell)
            assert fp16 < cell["err"] < 0.1, (name, peer, cell["err"], fp16)
    md = (tmp_path / "results.md").read_text()
    assert "INT8" in md and "FP8" in md


def _reference_fp16_error(name: str, batch: int) -> float:
    """PyTorch fp16 eager against fp32 eager on the script's inputs, computed here."""
    from benchmarks import _common

    model = _common.make_model(name, tiny=True)
    seq = 16
    feeds = _common.padded_token_feeds(batch, seq, 30522, seq // 8, seed=batch)
    args = [torch.from_numpy(v) for v in feeds.values()]
    with torch.inference_mode():
        want = model(*args).double()
        got = model.half()(*args).double()
    return float(torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want))


def test_every_row_measured_and_checked(smoke: Path) -> None:
    for name, batches in ROWS.items():
        data = json.loads((smoke / f"{name}.json").read_text())
        assert "failed" not in data, data.get("failed")
        assert [r["batch"] for r in data["rows"]] == batches
        for row in data["rows"]:
            tk, eager = row["peers"]["tensorkiln"], row["peers"]["eager"]
            # agreement with PyTorch fp32 was measured: fp16 rounding, not zero and not large
            assert 1e-6 < tk["err"] < 1e-2 and 1e-6 < row["eager_fp16_err"] < 1e-2, row
            assert row["flag"] is None
            assert tk["value"] > 0 and eager["value"] > 0 and row["best_peer"] == "eager"
            assert tk["build_s"] > 0 and tk["planned_bytes"] > 0
            assert row["flops"] > 0 and row["pct_peak"] > 0
            for peer in ("compile", "max-autotune", "reduce-overhead"):
                assert row["peers"][peer]["skipped"]
            expected = tk["value"] / eager["value"]
            assert row["ratio"] == pytest.approx(expected if row["batch"] > 1 else 1 / expected)
    md = (smoke / "results.md").read_text()
    for name, batches in ROWS.items():
        for b in batches:
            unit = "ms" if b == 1 else ("img/s" if name in ("resnet50", "vit") else "seq/s")
            assert f"| {name} | {b} ({unit}) |" in md
    assert "tensorkiln ms / best peer ms" in md and "GEMM peak measured" in md


def test_eager_error_matches_an_independent_computation(smoke: Path, monkeypatch) -> None:
    for p in (ROOT / "src", ROOT):
        monkeypatch.syspath_prepend(str(p))
    rows = json.loads((smoke / "bert.json").read_text())["rows"]
    row = next(r for r in rows if r["batch"] == 1)
    assert row["eager_fp16_err"] == pytest.approx(_reference_fp16_error("bert", 1), rel=1e-3)


def test_merge_round_trip_and_a_second_call(smoke: Path, tmp_path: Path) -> None:
    for name in ROWS:
        shutil.copy(smoke / f"{name}.json", tmp_path / f"{name}.json")
    r = _run("--merge", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "results.md").read_text() == (smoke / "results.md").read_text()
    merged = json.loads((tmp_path / "results.json").read_text())
    assert [m["model"] for m in merged["models"]] == list(ROWS)
    assert r.stdout.strip() == (smoke / "results.md").read_text().strip()
    # a second call, tensorkiln alone at batch 1 from a static export, with its layer profile:
    # the first call's eager cell and its batch-4 row stay
    before = json.loads((tmp_path / "gpt2.json").read_text())["rows"]
    r = _run("--device", "cpu", "--tiny", "--out", str(tmp_path), "--models", "gpt2",
             "--batch", "1", "--peers", "tensorkiln", "--static-export", "--layers", "3")  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    after = json.loads((tmp_path / "gpt2.json").read_text())["rows"]
    assert [x["batch"] for x in after] == [4, 1] and after[0] == before[0]
    assert after[1]["peers"]["eager"] == before[1]["peers"]["eager"]
    assert after[1]["export"] == "static" and before[1]["export"] == "dynamic batch"
    assert 1e-6 < after[1]["peers"]["tensorkiln"]["err"] < 1e-2
    assert np.isclose(after[1]["eager_fp16_err"], before[1]["eager_fp16_err"])
    assert after[1]["ratio"] == pytest.approx(
        after[1]["peers"]["eager"]["value"] / after[1]["peers"]["tensorkiln"]["value"]
    )
    assert "gpt2 batch 1: exported at this batch" in (tmp_path / "results.md").read_text()
    layers = after[1]["peers"]["tensorkiln"]["layers"]
    assert len(layers["top"]) == 3 and layers["ms_per_run"] >= sum(x["ms"] for x in layers["top"])
    assert all(x["ms"] > 0 and x["op"] and x["tactic"] for x in layers["top"])
    assert layers["top"][0]["ms"] >= layers["top"][-1]["ms"]
    # what each ran (torch ops on the CPU), attributed by the marker after each layer: a MatMul
    # or Gemm layer ran a matrix product, and no layer's ops are another's
    ran = {x["name"]: x["kernels"] for x in layers["top"]}
    assert all(kernels and all(ms >= 0 and n >= 1 for _, ms, n in kernels)
               for kernels in ran.values()), ran  # fmt: skip
    products = [x for x in layers["top"] if x["op"].rpartition(".")[2] in ("MatMul", "Gemm",
                                                                          "GemmAct")]  # fmt: skip
    for x in products:
        assert any(("mm" in k or "matmul" in k or "linear" in k) for k, _, _ in x["kernels"]), x
    assert isinstance(layers["copies"], dict)
    md = (tmp_path / "results.md").read_text()
    assert "## Slowest layers" in md and layers["top"][0]["name"] in md


@pytest.mark.parametrize(
    "args, message",
    [
        (["--models", "resnet51"], "--models: unknown resnet51"),
        (["--peers", "eager,jit"], "--peers: unknown jit"),
        (["--merge", "/nonexistent/folder"], "is not a folder"),
    ],
)
def test_user_errors(args: list[str], message: str) -> None:
    r = _run(*args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_merge_of_an_empty_folder(tmp_path: Path) -> None:
    r = _run("--merge", str(tmp_path))
    assert r.returncode == 2 and "no <model>.json files" in r.stderr and "Traceback" not in r.stderr


def test_a_failed_model_keeps_its_measured_rows(smoke: Path, tmp_path: Path, monkeypatch) -> None:
    """A model that fails after a row was written keeps the row, and the table shows both."""
    for p in (ROOT / "src", ROOT):
        monkeypatch.syspath_prepend(str(p))
    from benchmarks import _gpu_table

    spec = importlib.util.spec_from_file_location("gpu_models_under_test", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)  # (its dataclasses look it up there)
    spec.loader.exec_module(bench)
    shutil.copy(smoke / "bert.json", tmp_path / "bert.json")
    measured = json.loads((tmp_path / "bert.json").read_text())
    empty = {"environment": measured["environment"], "model": "bert", "rows": []}
    kept = bench.with_earlier(tmp_path / "bert.json", empty)
    assert kept["rows"] == measured["rows"]
    data = {**kept, "failed": "OutOfMemoryError: CUDA out of memory"}
    md = "\n".join(_gpu_table.markdown({"environments": [data["environment"]], "models": [data]}))
    assert "| bert | - | failed: OutOfMemoryError: CUDA out of memory |" in md
    assert "| bert | 4 (seq/s) |" in md and "| bert | 1 (ms) |" in md


def test_kernel_profiles_with_kernels_flag(tmp_path: Path) -> None:
    """--kernels N: every measured peer's cell has its kernels per call, their time and the top
    N, and results.md lists them."""
    r = _run(
        "--device", "cpu", "--tiny", "--models", "bert", "--batch", "1", "--kernels", "3",
        "--out", str(tmp_path), "--inductor-cache", str(tmp_path / "ic"),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    row = json.loads((tmp_path / "bert.json").read_text())["rows"][0]
    for peer in ("tensorkiln", "eager"):
        k = row["peers"][peer]["kernels"]
        assert k["kernels_per_call"] > 0 and k["ms_per_call"] > 0
        assert 0 < len(k["top"]) <= 3
        assert all(ms > 0 and n > 0 for _, ms, n in k["top"])
    text = (tmp_path / "results.md").read_text()
    assert "## Kernels per call" in text and "bert batch 1: tensorkiln" in text


def test_rounds_time_every_peer_in_turns_and_report_the_median(tmp_path: Path) -> None:
    r = _run(
        "--device", "cpu", "--tiny", "--out", str(tmp_path), "--models", "bert",
        "--batch", "large", "--peers", "tensorkiln,eager", "--rounds", "3",
        "--inductor-cache", str(tmp_path / "ic"), timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads((tmp_path / "bert.json").read_text())["rows"]
    for peer in ("tensorkiln", "eager"):
        cell = row["peers"][peer]
        assert len(cell["values"]) == 3 and all(v > 0 for v in cell["values"]), cell
        assert cell["value"] == sorted(cell["values"])[1]
    tk, eager = row["peers"]["tensorkiln"]["value"], row["peers"]["eager"]["value"]
    assert row["ratio"] == pytest.approx(tk / eager)


def test_the_precision_choice_lines_name_the_quantized_tactic() -> None:
    """The table's precision-choice lines: each worst layer with the tactic its quantized form
    was timed on; results written before the tactic was recorded still render."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import _gpu_table

    choice = {"layers": 2, "kept_float": 1, "quantized_ms": 0.9, "quantize_ms": 0.04,
              "float_ms": 0.7, "worst": [["conv3", 0.6, 0.04, 0.3, "cudnn_fp16"],
                                         ["conv1", 0.3, 0.0, 0.4, None]]}  # fmt: skip
    old = {**choice, "worst": [["conv3", 0.6, 0.04, 0.3]]}
    rows = [{"model": "resnet50", "batch": 256, "peers": {"tensorkiln-fp8": {"precision_choice": c}}}
            for c in (choice, old)]  # fmt: skip
    lines = _gpu_table._choice_lines(rows)
    assert "  - `conv3`: 0.6000 ms quantized on cudnn_fp16 (0.0400 Q), 0.3000 float" in lines
    assert "  - `conv1`: 0.3000 ms quantized (0.0000 Q), 0.4000 float" in lines
    assert lines.count("  - `conv3`: 0.6000 ms quantized (0.0400 Q), 0.3000 float") == 1


def test_copies_are_told_from_cutlass_kernels(monkeypatch) -> None:
    """The layer profile's copies: torch's casting copy and a memcpy are copies; a CUTLASS
    kernel, whose name carries CuTe's CopyAtom, is not (kernel names from an H200 profile)."""
    for p in (ROOT / "src", ROOT):
        monkeypatch.syspath_prepend(str(p))
    spec = importlib.util.spec_from_file_location("gpu_models_copies", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, bench)
    spec.loader.exec_module(bench)
    assert bench.is_copy(
        "void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<"
        "at::native::direct_copy_kernel_cuda(at::T"
    )
    assert bench.is_copy("Memcpy DtoD (Device -> Device)")
    assert not bench.is_copy(
        "kernel_cutlass_kernel_cutlass_hopper_gemm_exampleHopperFP8GeluPersistentGemmKernel_"
        "object_at__CopyAtom_ThrID10_TVLayoutS"
    )
    assert not bench.is_copy("_widen_kernel")

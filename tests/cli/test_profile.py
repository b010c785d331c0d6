"""`tensorkiln run --dump-profile / --export-profile`: FLOPs, bytes, achieved rates and the
roofline per layer, the summary, --peak-tflops/--peak-gbps and --profile-by."""

from __future__ import annotations

import json

import pytest

from tests.cli.helpers import FAST, assert_one_line_error
from tests.cli.test_run import PROFILE_HEADER, _profile_table

BATCH = 4  # the engine's opt shape: what the profile runs at
# mlp_model: x[N,4] @ w1[4,8] + b1[8] -> Relu -> @ w2[8,3]; each layer's FLOPs and float32
# tensors (input, weights, output) counted here by hand
FLOPS = {"fc1": 2 * BATCH * 4 * 8, "bias1": BATCH * 8, "act1": BATCH * 8, "fc2": 2 * BATCH * 8 * 3}
BYTES = {
    "fc1": 4 * (BATCH * 4 + 4 * 8 + BATCH * 8),
    "bias1": 4 * (BATCH * 8 + 8 + BATCH * 8),
    "act1": 4 * (BATCH * 8 + BATCH * 8),
    "fc2": 4 * (BATCH * 8 + 8 * 3 + BATCH * 3),
}
ROW_FIELDS = {"name", "op", "precision", "total_ms", "average_ms", "percent", "flops", "bytes",
              "gflop", "mb", "tflops", "gbps", "intensity", "peak_tflops", "peak_gbps", "bound",
              "ideal_ms", "roofline_percent"}  # fmt: skip


@pytest.fixture
def engine(cli, mlp, tmp_path):
    path = tmp_path / "mlp.engine"
    rc, _, err = cli("build", mlp, "-o", path, "--min-shapes", "x:1x4", "--opt-shapes",
                     f"x:{BATCH}x4", "--max-shapes", "x:8x4", "--opt-level", "0",
                     "--backend", "reference")  # fmt: skip
    assert rc == 0, err
    return path


def _expected_roofline(flops: int, nbytes: int, avg_ms: float, tflops: float, gbps: float):
    compute_s, memory_s = flops / (tflops * 1e12), nbytes / (gbps * 1e9)
    bound = "compute" if flops / nbytes > tflops * 1e12 / (gbps * 1e9) else "memory"
    return bound, 100 * max(compute_s, memory_s) / (avg_ms / 1e3)


def test_dump_profile_prints_counts_rates_and_the_roofline(cli, engine):
    rc, out, err = cli("run", engine, *FAST, "--dump-profile", "--peak-tflops", "10",
                       "--peak-gbps", "100")  # fmt: skip
    assert rc == 0, err
    header, rows = _profile_table(out)
    assert header == PROFILE_HEADER and set(rows) == set(FLOPS)
    assert "roofline: cpu (given): TFLOP/s 10" in out and "GB/s 100" in out
    for name, r in rows.items():
        avg_ms, gflop, mb = float(r[2]), float(r[4]), float(r[5])
        assert gflop == pytest.approx(FLOPS[name] / 1e9, rel=1e-3), name
        assert mb == pytest.approx(BYTES[name] / 1e6, rel=1e-3), name
        bound, pct = _expected_roofline(FLOPS[name], BYTES[name], avg_ms, 10, 100)
        assert r[8] == bound == "memory"  # (well below the ridge point of 100 FLOP/byte)
        # (the table prints one decimal, and avg_ms rounded: a value just past a rounding edge
        # prints a whole step away from what the printed avg_ms gives)
        assert float(r[9]) == pytest.approx(pct, rel=0.05, abs=0.1), name
    summary = next(line for line in out.splitlines() if line.startswith("total:"))
    gflop = float(summary.split()[1])
    assert gflop == pytest.approx(sum(FLOPS.values()) / 1e9, rel=1e-3)
    assert "TFLOP/s" in summary and "top op types by time: " in summary
    assert "MatMul" in summary.split("top op types by time: ")[1]


def test_export_profile_is_machine_readable_with_every_field(cli, engine, tmp_path):
    path = tmp_path / "profile.json"
    rc, _, err = cli(
        "run",
        engine,
        *FAST,
        "--export-profile",
        path,
        "--peak-tflops",
        "1e-6",
        "--peak-gbps",
        "100000",
    )  # fmt: skip  (a tiny compute roof: compute bound)
    assert rc == 0, err
    report = json.loads(path.read_text())
    assert report["iterations"] == 3 and report["timed_by"] == "host clock"
    assert report["peaks"]["gbps"] == 100000 and report["peaks"]["source"] == "given"
    rows = {r["name"]: r for r in report["layers"]}
    assert set(rows) == set(FLOPS)
    for name, r in rows.items():
        assert set(r) == ROW_FIELDS, name
        assert r["flops"] == FLOPS[name] and r["bytes"] == BYTES[name]
        for key in ROW_FIELDS - {"name", "op", "precision", "bound"}:
            assert isinstance(r[key], (int, float)), (name, key)
        seconds = r["average_ms"] / 1e3
        assert r["tflops"] == pytest.approx(FLOPS[name] / seconds / 1e12)
        assert r["gbps"] == pytest.approx(BYTES[name] / seconds / 1e9)
        assert r["intensity"] == pytest.approx(FLOPS[name] / BYTES[name])
        bound, pct = _expected_roofline(FLOPS[name], BYTES[name], r["average_ms"], 1e-6, 1e5)
        assert r["bound"] == bound == "compute" and r["roofline_percent"] == pytest.approx(pct)
    s = report["summary"]
    assert s["flops"] == sum(FLOPS.values()) and s["bytes"] == sum(BYTES.values())
    assert s["average_ms"] == pytest.approx(sum(r["average_ms"] for r in rows.values()))
    assert s["tflops"] == pytest.approx(s["flops"] / (s["average_ms"] / 1e3) / 1e12)
    assert {t["op"] for t in s["top_ops"]} == {"MatMul", "Add", "Relu"}


def test_without_peaks_the_cpu_profile_has_no_roofline(cli, engine):
    rc, out, err = cli("run", engine, *FAST, "--dump-profile", "--peak-gbps", "100")
    assert rc == 0, err
    assert "roofline: cpu (given): TFLOP/s unknown; GB/s 100" in out
    _, rows = _profile_table(out)
    assert all(r[8] == "-" and r[9] == "-" for r in rows.values())  # (one roof is not a roofline)
    r = cli.json("run", engine, *FAST, "--dump-profile", "--json")
    assert r["profile"]["peaks"] is None
    for row in r["profile"]["layers"]:
        assert row["bound"] is None and row["roofline_percent"] is None
        assert row["flops"] == FLOPS[row["name"]] and row["tflops"] > 0
    rc, out, _ = cli("run", engine, *FAST, "--dump-profile")
    assert "no roofline: unknown device peaks" in out


def test_profile_by_op_adds_up_the_layers(cli, engine):
    r = cli.json("run", engine, *FAST, "--dump-profile", "--profile-by", "op", "--json",
                 "--peak-tflops", "10", "--peak-gbps", "100")  # fmt: skip
    by_op = {g["op"]: g for g in r["profile"]["by_op"]}
    layers = r["profile"]["layers"]
    assert set(by_op) == {"MatMul", "Add", "Relu"} and by_op["MatMul"]["layers"] == 2
    assert by_op["MatMul"]["flops"] == FLOPS["fc1"] + FLOPS["fc2"]
    assert by_op["MatMul"]["bytes"] == BYTES["fc1"] + BYTES["fc2"]
    mm = [x for x in layers if x["op"] == "MatMul"]
    assert by_op["MatMul"]["average_ms"] == pytest.approx(sum(x["average_ms"] for x in mm))
    ideal = sum(x["ideal_ms"] for x in mm)
    assert by_op["MatMul"]["roofline_percent"] == pytest.approx(
        100 * ideal / by_op["MatMul"]["average_ms"]
    )
    rc, out, err = cli("run", engine, *FAST, "--dump-profile", "--profile-by", "op")
    assert rc == 0, err
    header, rows = _profile_table(out)
    assert header[:2] == ["op", "layers"] and rows["MatMul"][1] == "2"


@pytest.mark.parametrize("flag", ["--peak-tflops", "--peak-gbps"])
@pytest.mark.parametrize("value", ["0", "-5", "nan", "inf", "fast"])
def test_bad_peaks_are_one_line_errors(cli, engine, flag, value):
    rc, _, err = cli("run", engine, *FAST, "--dump-profile", flag, value)
    assert_one_line_error(rc, err, code=2)
    assert flag in err and value in err

"""``tensorkiln perf`` against a running server: a concurrency sweep with throughput and latency
percentiles, a CSV report, and clear errors for what a user can get wrong."""

from __future__ import annotations

import csv

import pytest

pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")

from tensorkiln.cli.common import CLIError
from tensorkiln.cli.main import main
from tensorkiln.cli.perf import concurrency_levels
from tests.serve.helpers import free_port as _free_port
from tests.serve.test_grpc import serving as grpc_serving
from tests.serve.test_http import serving
from tests.serve.test_repository import _model


def test_a_sweep_over_http_reports_every_level(tmp_path, capsys):
    _model(tmp_path / "repo")
    report = tmp_path / "perf.csv"
    with serving(tmp_path / "repo") as (url, core):
        rc = main(["perf", "-m", "digits", "-u", url, "-b", "2", "--concurrency-range", "1:4",
                   "--measurement-interval", "300", "-f", str(report)])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = list(csv.DictReader(report.open()))
    assert [int(r["concurrency"]) for r in rows] == [1, 2, 4]
    for r in rows:
        assert int(r["requests"]) > 0 and int(r["errors"]) == 0
        assert float(r["p50_ms"]) <= float(r["p99_ms"])
    # what the server counted covers what perf sent (warm-up requests included)
    key = (("model", "digits"), ("version", "1"))
    from tests.serve.helpers import samples as labels_of

    served = labels_of(core.metrics, "nv_inference_request_success")[key]
    assert served >= sum(int(r["requests"]) for r in rows)
    assert "concurrency  infer/s" in out


def test_grpc_too(tmp_path):
    _model(tmp_path / "repo")
    with grpc_serving(tmp_path / "repo") as (url, _):
        rc = main(
            ["perf", "-m", "digits", "-u", url, "-i", "grpc", "--measurement-interval", "200"]
        )
    assert rc == 0


def test_what_a_user_gets_wrong_is_named(tmp_path, capsys):
    assert concurrency_levels("1:8") == [1, 2, 4, 8]
    assert concurrency_levels("2:10:4") == [2, 6, 10]
    for bad in ("0", "a:b", "8:2", "1:2:3:4"):
        with pytest.raises(CLIError, match="concurrency-range"):
            concurrency_levels(bad)
    url = f"127.0.0.1:{_free_port()}"
    assert main(["perf", "-m", "digits", "-u", url]) == 1
    assert "no server answers at" in capsys.readouterr().err
    _model(tmp_path / "repo")
    with serving(tmp_path / "repo") as (url, _):
        assert main(["perf", "-m", "nothing", "-u", url]) == 1
        assert "not ready" in capsys.readouterr().err


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_shared_memory_as_perf_analyzer_sends_it(tmp_path, protocol, capsys):
    import os

    pytest.importorskip("tritonclient.utils.shared_memory")
    if not os.path.isdir("/dev/shm"):
        pytest.skip("no /dev/shm")
    _model(tmp_path / "repo")
    run = serving if protocol == "http" else grpc_serving
    with run(tmp_path / "repo", shared_memory=True) as (url, core):
        rc = main(["perf", "-m", "digits", "-u", url, "-i", protocol, "--concurrency-range", "2",
                   "--measurement-interval", "300", "--shared-memory", "system"])  # fmt: skip
        assert rc == 0, capsys.readouterr()
        assert core.shm.status() == []  # (every client's regions unregistered at the end)
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith("tkperf_")]
    assert leftovers == []
    with serving(tmp_path / "repo") as (url, _):  # (the extension off)
        rc = main(["perf", "-m", "digits", "-u", url, "--measurement-interval", "200",
                   "--shared-memory", "system"])  # fmt: skip
    assert rc == 1 and "--allow-shared-memory" in capsys.readouterr().err

"""benchmarks/serve_link.py end to end on small images: both engine processes (the link alone,
and a ServerCore with dynamic batching), tensors through the arena and through the socket, every
answer checked against its own request (the script's exit status)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("aiohttp")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "serve_link.py"


def test_smoke_run(tmp_path, capsys) -> None:
    spec = importlib.util.spec_from_file_location("serve_link_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    out_json = tmp_path / "rows.json"
    argv = ["--seconds", "0.4", "--warmup", "0.1", "--side", "16", "--concurrency", "4",
            "--json", str(out_json)]  # fmt: skip
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for kind in ("link", "server"):
        for tensors in ("arena", "socket"):
            assert re.search(rf"^{kind} +{tensors} *: +[\d,]+ req/s; .* 0 wrong\)$", out, re.M), out
    rows = json.loads(out_json.read_text())
    assert len(rows) == 4 and all(r["requests"] > 0 and r["wrong"] == 0 for r in rows)

"""benchmarks/remove_padding.py end to end with a 2-layer BERT: both engines are built, checked
against PyTorch at the kept positions (the script's exit status), timed and compared."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "remove_padding.py"


def test_smoke_run(capsys) -> None:
    spec = importlib.util.spec_from_file_location("remove_padding_bench", SCRIPT)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench
    spec.loader.exec_module(bench)
    argv = ["--tiny", "--backend", "reference", "--batch", "3", "--runs", "2", "--warmup", "0"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    for kind in ("padded", "packed"):
        found = re.search(
            rf"^{kind}: [\d.]+ ms per batch of 3 .* error at kept positions (\S+)\)", out, re.M
        )
        assert found, out
        assert float(found.group(1)) < 1e-4
    assert re.search(r"^padding removal: [\d.]+x$", out, re.M), out

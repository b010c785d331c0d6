"""gpu_models.py's results: the figures derived from a measured row, the merge of the per-model
files and the markdown table. Needs no GPU and no torch (``--merge``)."""

from __future__ import annotations

import json
from pathlib import Path

PEER_COLUMNS = {
    "tensorkiln": "tensorkiln",
    "tensorkiln-int8": "tensorkiln INT8",
    "tensorkiln-fp8": "tensorkiln FP8",
    "tensorkiln-packed": "tensorkiln packed",
    "tensorkiln-torch": "tensorkiln.torch",
    "eager": "eager",
    "compile": "compile",
    "max-autotune": "max-autotune-no-cudagraphs",
    "reduce-overhead": "reduce-overhead",
}
MiB = 2**20


def derive(row: dict, peak_flops: float | None) -> dict:
    """Best peer, ratios, % of the GEMM peak and the agreement flag of a measured row."""
    large = row["large"]
    tk = row["peers"].get("tensorkiln", {})
    done = {
        p: c["value"]
        for p, c in row["peers"].items()
        if not p.startswith("tensorkiln") and "value" in c
    }
    row["best_peer"] = None
    if done:
        pick = max if large else min  # items/s, or ms
        row["best_peer"] = pick(done, key=done.get)
    best = done.get(row["best_peer"])
    value = tk.get("value")
    row["ratio"] = row["tk_over_best"] = row["pct_peak"] = row["flag"] = None
    if value and best:
        row["ratio"] = value / best if large else best / value
        if not large:
            row["tk_over_best"] = value / best
    # INT8/FP8 engines measured beside the fp16 one: their ratio to the same best PyTorch fp16
    row["quantized_ratios"] = {
        p: (c["value"] / best if large else best / c["value"])
        for p, c in row["peers"].items()
        if p in ("tensorkiln-int8", "tensorkiln-fp8") and c.get("value") and best
    }
    # the fp16 engine built with --remove-padding (masked models): its ratio to the same peer
    cell = row["peers"].get("tensorkiln-packed", {})
    packed, host_mask = cell.get("value"), cell.get("value_host_mask")
    row["packed_ratio"] = row["packed_host_ratio"] = None
    if packed and best:
        row["packed_ratio"] = packed / best if large else best / packed
    # (the same engine given the mask as a host array, as a tokenizer hands it: no read-back)
    if host_mask and best and large:
        row["packed_host_ratio"] = host_mask / best
    # tensorkiln.torch.compile of the module against the ONNX path's engine (the same speed is
    # the aim: one builder behind both)
    from_torch = row["peers"].get("tensorkiln-torch", {}).get("value")
    row["torch_over_onnx"] = None
    if from_torch and value:
        row["torch_over_onnx"] = from_torch / value if large else value / from_torch
    if value and row.get("flops") and peak_flops:
        seconds = row["batch"] / value if large else value / 1e3
        row["pct_peak"] = 100.0 * row["flops"] / seconds / peak_flops
    if "err" in tk:
        bound = 2 * row["eager_fp16_err"] + 1e-3
        quantized = tk.get("precision") in ("int8", "fp8")
        if quantized:  # (quantization error, calibrated on random inputs: a sanity bound only)
            bound = QUANTIZED_BOUND
        if tk["err"] > bound:
            row["flag"] = f"tensorkiln's error {tk['err']:.2e} > " + (
                f"{bound:.0e} ({tk['precision']})"
                if quantized
                else f"2 x eager fp16's + 1e-3 = {bound:.2e}"
            )
    return row


QUANTIZED_BOUND = (
    0.1  # relative L2 error of an INT8/FP8 engine against fp32, beyond which it is flagged
)


def merge(folder: Path, order: list[str]) -> dict:
    """Every DIR/<model>.json (not results.json), in ``order``: {"environments", "models"}."""
    models = []
    for path in sorted(folder.glob("*.json")):
        if path.name == "results.json":
            continue
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{path}: not a results file ({exc})") from None
        if not isinstance(data, dict) or "model" not in data:
            raise ValueError(f"{path}: not a results file (no 'model')")
        models.append(data)
    if not models:
        raise ValueError(f"no <model>.json files in '{folder}'")
    models.sort(key=lambda m: order.index(m["model"]) if m["model"] in order else len(order))
    envs = []
    for m in models:
        env = m.get("environment", {})
        if env not in envs:
            envs.append(env)
    return {"environments": envs, "models": models}


def _num(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def _mib(n: int | None) -> str:
    if n is None:
        return "-"
    return format(n / MiB, ",.0f" if n >= 10 * MiB else ".2g")


def _cell(cell: dict | None, large: bool) -> str:
    if cell is None:
        return "-"  # not asked for
    if "value" in cell:
        return format(cell["value"], ",.0f" if large else ".3f")
    text = f"failed: {cell['failed']}" if "failed" in cell else f"skipped: {cell.get('skipped')}"
    return text.replace("|", "/").replace("\n", " ")


def _env_lines(envs: list[dict]) -> list[str]:
    lines = []
    for env in envs:
        peak = env.get("gemm_peak") or {}
        n = peak.get("n")
        lines += [
            f"- {env.get('device')}; {env.get('date')}; torch {env.get('torch')}, triton "
            f"{env.get('triton')}, transformers {env.get('transformers')}, tensorkiln "
            f"{env.get('tensorkiln')}, python {env.get('python')}",
            f"- {peak.get('dtype')} GEMM peak measured in-process: "
            f"{_num((peak.get('flops') or 0) / 1e12 if peak else None, '.1f')} TFLOP/s "
            f"({n}x{n}x{n} matmul, best of 5 rounds of 10)",
        ]
    return lines


def _header(timing: dict) -> list[str]:
    t = {"loops": 3, "iters": 20, "latency_runs": 200, "clock": "CUDA events", **timing}
    return [
        f"Throughput rows (batch > 1): images or sequences per second, the best of {t['loops']} "
        f"loops of {t['iters']} calls timed with {t['clock']}; **ratio = tensorkiln / best "
        "peer** (above 1: tensorkiln is faster).",
        f"Batch-1 rows: milliseconds, the median of {t['latency_runs']} synchronized calls; "
        "**ratio = best peer ms / tensorkiln ms** (above 1: tensorkiln is faster), and in "
        "brackets **tensorkiln ms / best peer ms** (the target is <= 0.8). tensorkiln.torch: "
        "the PyTorch module through tensorkiln.torch.compile, its ratio to the ONNX path's "
        "engine (above 1: faster). tensorkiln packed: the fp16 engine built with "
        "--remove-padding (the masked tokens left out; its error is measured at the unmasked "
        "positions, where the outputs mean something; GPT-2's inputs mask nothing, but its packed "
        "attentions are causal instead of reading a [B, 1, S, S] mask); host mask: the same engine given the "
        "attention mask as a host array, as a tokenizer hands it, counted on the host.",
        "error: relative L2 distance to PyTorch fp32 eager on the same inputs, tensorkiln / "
        "PyTorch eager fp16; FLAG: tensorkiln's is above 2x eager fp16's + 1e-3 (INT8/FP8 "
        f"engines: above {QUANTIZED_BOUND:g}).",
        "activation MiB: the engine's planned activation peak / what its CUDA-graph context "
        "holds after the runs. % peak: model FLOPs (FlopCounterMode, fp32 eager) / tensorkiln's "
        "time per inference / the measured GEMM peak.",
    ]


def markdown(results: dict) -> list[str]:
    precisions = {
        (r.get("peers", {}).get("tensorkiln") or {}).get("precision", "fp16")
        for m in results["models"]
        for r in m.get("rows", [])
    } - {None}
    ours = "/".join(sorted(p.upper() for p in precisions if p != "fp16"))
    title = "tensorkiln against PyTorch, fp16" + (
        f" (tensorkiln's convolutions and GEMMs in {ours}, the rest fp16)" if ours else ""
    )
    lines = [f"# {title}", "", *_env_lines(results["environments"]), ""]
    timing = results["environments"][0].get("timing") or {}
    lines += [f"- {h}" for h in _header(timing)] + [""]
    cols = ["model", "batch", *PEER_COLUMNS.values(), "best peer", "ratio", "build s cold / warm"]
    cols += ["activation MiB planned / actual", "% fp16 GEMM peak", "error tensorkiln / eager"]
    lines += ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for m in results["models"]:
        if "failed" in m:
            lines.append(f"| {m['model']} | - | {_cell(m, True)} |" + " |" * (len(cols) - 3))
        for row in m.get("rows", []):
            lines.append(_row(row))
    rows = _rows(results)
    return [
        *lines, "", *_notes(rows), *_kernel_lines(rows), *_choice_lines(rows), *_layer_lines(rows)
    ]  # fmt: skip


def _kernel_lines(rows: list[dict]) -> list[str]:
    """Per row with kernel profiles (--kernels): each peer's kernels and their time per call, and
    tensorkiln's top kernels."""
    out = []
    for r in rows:
        cells = {
            p: c["kernels"] for p, c in r["peers"].items() if isinstance(c.get("kernels"), dict)
        }
        if not cells:
            continue
        if not out:
            out = ["", "## Kernels per call (PyTorch profiler, after timing)", ""]
        per_peer = ", ".join(
            f"{PEER_COLUMNS.get(p, p)} {k['kernels_per_call']:.0f} in {k['ms_per_call']:.3f} ms"
            for p, k in cells.items()
        )
        out.append(f"- {r['model']} batch {r['batch']}: {per_peer}")
        for peer, k in cells.items():  # (each tensorkiln engine's top kernels)
            if peer.startswith("tensorkiln"):
                for name, ms, n in k.get("top", []):
                    out.append(f"  - {PEER_COLUMNS.get(peer, peer)} {ms:.4f} ms x{n:g}: `{name}`")
    return out


def _choice_lines(rows: list[dict]) -> list[str]:
    """Per INT8/FP8 engine built choosing per layer: what was timed both ways, and where the
    quantized form lost by most."""
    out = []
    for r in rows:
        for peer, cell in r["peers"].items():
            c = cell.get("precision_choice") if isinstance(cell, dict) else None
            if not isinstance(c, dict):
                continue
            if not out:
                out = [
                    "",
                    "## Precision choice (each 8-bit layer timed against its float form)",
                    "",
                ]
            out.append(
                f"- {r['model']} batch {r['batch']}, {PEER_COLUMNS.get(peer, peer)}: "
                f"{c['layers']} layers, {c['kept_float']} kept in float; quantized "
                f"{c['quantized_ms']:.3f} ms (of which QuantizeLinear {c['quantize_ms']:.3f}) "
                f"against {c['float_ms']:.3f} ms in float"
            )
            for name, q, quant, f, *tactic in c["worst"]:  # (older JSON: no tactic)
                on = f" on {tactic[0]}" if tactic and tactic[0] else ""
                out.append(f"  - `{name}`: {q:.4f} ms quantized{on} ({quant:.4f} Q), {f:.4f} float")
    return out


def _layer_lines(rows: list[dict]) -> list[str]:
    """Per tensorkiln engine with a layer profile (--layers): its slowest layers."""
    out = []
    for r in rows:
        for peer, cell in r["peers"].items():
            prof = cell.get("layers") if isinstance(cell, dict) else None
            if not isinstance(prof, dict):
                continue
            if not out:
                out = ["", "## Slowest layers (layer by layer, CUDA events, after timing)", ""]
            out.append(
                f"- {r['model']} batch {r['batch']}, {PEER_COLUMNS.get(peer, peer)}: "
                f"{prof['ms_per_run']:.3f} ms per run"
            )
            for x in prof["top"]:
                ran = ", ".join(f"{k[:48]} x{n}" for k, _, n in x.get("kernels", []))
                out.append(
                    f"  - {x['ms']:.4f} ms `{x['name']}` {x['op']} {x['tactic']} {x['precision']}"
                    + (f" ({ran})" if ran else "")
                )
            copies = prof.get("copies") or {}
            if copies:
                n = sum(k[2] for kernels in copies.values() for k in kernels)
                ms = sum(k[1] for kernels in copies.values() for k in kernels)
                out.append(f"  - copies: {n} launches, {ms:.3f} ms, in {len(copies)} layers: "
                           + ", ".join(f"`{name}`" for name in list(copies)[:12]))  # fmt: skip
    return out


def _notes(rows: list[dict]) -> list[str]:
    """Flags, runs without a CUDA graph, static exports, and the peers' compile seconds."""
    notes = []
    for r in rows:
        where = f"{r['model']} batch {r['batch']}"
        tk = r["peers"].get("tensorkiln", {})
        if r["flag"]:
            notes.append(f"- FLAG {where}: {r['flag']}")
        if tk.get("graph_fallback"):
            notes.append(f"- {where}: tensorkiln ran without a CUDA graph: {tk['graph_fallback']}")
        if r.get("export") == "static":
            notes.append(f"- {where}: exported at this batch (no dynamic axis, no profile)")
        compiled = [
            f"{PEER_COLUMNS[p]} {c['compile_s']:.0f}"
            for p, c in r["peers"].items()
            if c.get("compile_s") is not None
        ]
        if compiled:
            notes.append(f"- {where}: compile s (first call): {', '.join(compiled)}")
    return notes


def _rows(results: dict) -> list[dict]:
    return [row for m in results["models"] for row in m.get("rows", [])]


def _row(row: dict) -> str:
    large = row["large"]
    unit = ("img/s" if row.get("image") else "seq/s") if large else "ms"
    tk = row["peers"].get("tensorkiln", {})
    ratio = _num(row["ratio"], ".2f")
    if row["tk_over_best"] is not None:
        ratio += f" [{row['tk_over_best']:.2f}]"
    for p, q in (row.get("quantized_ratios") or {}).items():
        ratio += f"; {p.partition('-')[2].upper()} {q:.2f}"
    if row.get("packed_ratio") is not None:
        ratio += f"; packed {row['packed_ratio']:.2f}"
    if row.get("packed_host_ratio") is not None:
        ratio += f" (host mask {row['packed_host_ratio']:.2f})"
    if row.get("torch_over_onnx") is not None:
        ratio += f"; tensorkiln.torch / ONNX {row['torch_over_onnx']:.2f}"
    mem = "-"
    if tk.get("planned_bytes") is not None:
        actual = tk.get("actual_bytes")
        mem = f"{_mib(tk['planned_bytes'])} / {_mib(actual)}"
    err = f"{_num(tk.get('err'), '.1e')} / {row['eager_fp16_err']:.1e}"
    err += " FLAG" if row["flag"] else ""
    cells = [row["model"], f"{row['batch']} ({unit})"]
    cells += [_cell(row["peers"].get(p), large) for p in PEER_COLUMNS]
    build = _num(tk.get("build_s"), ".1f")
    if tk.get("warm_build_s") is not None:
        build += f" / {tk['warm_build_s']:.1f}"
    cells += [row["best_peer"] or "-", ratio, build, mem]
    cells += [_num(row["pct_peak"], ".1f"), err]
    return "| " + " | ".join(cells) + " |"

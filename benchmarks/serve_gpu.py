"""Serving benchmark: `tensorkiln serve` with ResNet-50 fp16 against the same engine run in
process, and dynamic batching against batch-1 serving, driven by tritonclient.

    python benchmarks/serve_gpu.py [--clients 64] [--seconds 10] [--json out.json]
    python benchmarks/serve_gpu.py --tiny --backend cpu --seconds 2     (a smoke run, no GPU)
    python benchmarks/serve_gpu.py --perf-analyzer .perf_analyzer/perf_analyzer
        (scripts/get_perf_analyzer.sh fetches Triton's C++ load generator)
    python benchmarks/serve_gpu.py --frontend-processes 8   (protocols in 8 more processes)

Two models of one repository, built from the same ONNX export (torchvision ResNet-50, random
weights made to look trained): ``resnet50`` with dynamic batching (max_batch_size 64, engine
tuned at batch 64) and ``resnet50_b1`` without (engine tuned at batch 1). Both run as CUDA
graphs on two instances. The server runs as its own process (`tensorkiln serve`), as a user runs
it.

Measured, in order:
1. agreement: every model's answers over gRPC equal the in-process engine's for the same inputs;
2. latency at concurrency 1: the in-process engine (numpy in, numpy out, as the server calls
   it) against tritonclient over gRPC and HTTP; the difference is what the server adds;
3. throughput at ``--clients`` concurrent clients (processes of threads, so that the clients'
   own Python is not the bottleneck) for ``--seconds`` after a warm-up, with and without dynamic
   batching; every answer is checked against its own input's expected output.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "src")]

import numpy as np  # noqa: E402

SIDE = 224
SHM_INPUTS = "tk_bench_inputs"  # the shared-memory region holding the inputs (grpc-shm)
CHECK_INPUTS = 16  # distinct inputs each client cycles through, with their expected outputs
TOLERANCE = 2e-2  # relative L2 between a served answer and the in-process one (fp16, any batch)


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", file=sys.stderr, flush=True)


def rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    got, want = got.astype(np.float64), want.astype(np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))


def environment() -> dict:
    """The versions the server's protocol handling runs on: protobuf's implementation (upb, the
    C one, or pure Python, many times slower per message) above all."""
    import aiohttp
    import grpc
    from google.protobuf import __version__ as protobuf_version
    from google.protobuf.internal import api_implementation

    return {
        "python": sys.version.split()[0],
        "grpcio": grpc.__version__,
        "aiohttp": aiohttp.__version__,
        "protobuf": protobuf_version,
        "protobuf_implementation": api_implementation.Type(),
        "cpus": os.cpu_count(),
    }


# ---------------------------------------------------------------- repository


def make_repository(args: argparse.Namespace, folder: Path) -> tuple[Path, dict]:
    """The ONNX export, two engines and the repository; the build times."""
    from benchmarks._common import export_dynamic, image_feeds, make_model

    from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile

    side = 32 if args.tiny else SIDE
    model = make_model("resnet50", tiny=args.tiny)
    onnx_path = export_dynamic(model, image_feeds(2, side, 0), folder / "resnet50.onnx")
    repo = folder / "repo"
    times = {}
    for name, opt, batching in (
        ("resnet50", args.max_batch, True),
        ("resnet50_b1", 1, False),
    ):
        config = BuilderConfig()
        if args.precision != "fp32":
            config.set_flag(args.precision)
        config.timing_cache = str(folder / "timing.cache")
        profile = OptimizationProfile()
        shape = (3, side, side)
        profile.set_shape("input", (1, *shape), (opt, *shape), (args.max_batch, *shape))
        config.add_optimization_profile(profile)
        t0 = time.perf_counter()
        engine = Builder(args.backend).build(str(onnx_path), config, progress=False)
        times[name] = round(time.perf_counter() - t0, 1)
        log(f"built {name} (tuned at batch {opt}) in {times[name]} s")
        (repo / name / "1").mkdir(parents=True)
        engine.save(repo / name / "1" / "model.engine")
        text = [
            f'name: "{name}"',
            f"max_batch_size: {args.max_batch}",
            f"instance_group [ {{ count: {args.instances} kind: KIND_GPU }} ]",
            "optimization { cuda { graphs: true } }",
        ]
        if batching:
            text.append(f"dynamic_batching {{ max_queue_delay_microseconds: {args.delay_us} }}")
        (repo / name / "config.pbtxt").write_text("\n".join(text) + "\n")
    return repo, times


# ---------------------------------------------------------------- server


def start_server(repo: Path, args: argparse.Namespace, log_file: Path) -> subprocess.Popen:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    )
    env.update(kv.split("=", 1) for kv in args.server_env)
    cmd = [
        sys.executable, "-m", "tensorkiln", "serve", "--model-repository", str(repo),
        "--backend", args.backend, "--http-port", str(args.port), "--grpc-port",
        str(args.port + 1), "--metrics-port", str(args.port + 2),
    ]  # fmt: skip
    if "grpc-shm" in args.protocols or args.perf_analyzer:
        cmd += ["--allow-shared-memory", "true"]
    if args.frontend_processes:
        cmd += ["--frontend-processes", str(args.frontend_processes)]
    cmd += ["--grpc-transport", args.grpc_transport]
    proc = subprocess.Popen(cmd, env=env, stdout=log_file.open("w"), stderr=subprocess.STDOUT)
    wait_ready(args.port, proc, log_file)
    return proc


def wait_ready(
    http_port: int, proc: subprocess.Popen, log_file: Path, seconds: float = 600
) -> None:
    """Poll the server's readiness on ``http_port`` until it answers 200; exit naming why (with
    the tail of ``log_file``, the server's output) when it stops first, or is not ready within
    ``seconds`` (then it is killed)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"the server exited with {proc.returncode}: {log_file.read_text()[-2000:]}"
            )
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{http_port}/v2/health/ready", timeout=2
            ) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"the server was not ready within {seconds:g} s")


def scrape(args: argparse.Namespace) -> dict[tuple[str, str], float]:
    """The server's Prometheus samples: (family, model) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{args.port + 2}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        family, rest = line.split("{", 1)
        labels, value = rest.rsplit("}", 1)
        model = next(
            (p.split("=")[1].strip('"') for p in labels.split(",") if p.startswith("model=")), ""
        )
        out[(family, model)] = out.get((family, model), 0.0) + float(value)
    return out


# ---------------------------------------------------------------- clients


def _client_process(url: str, model: str, threads: int, seconds: float, warmup: float,
                    inputs: np.ndarray, expected: np.ndarray, queue: mp.Queue,
                    protocol: str) -> None:  # fmt: skip
    """``threads`` clients sending back to back; puts (ends, latencies, errors, mismatches,
    worst error, first error) measured after the warm-up. ``protocol`` "grpc-shm": inputs are
    read from the shared-memory region SHM_INPUTS, outputs written to one region per client."""
    import os
    import threading

    if protocol.startswith("grpc"):
        import tritonclient.grpc as client_module
    else:
        import tritonclient.http as client_module
    import tritonclient.utils.shared_memory as shm

    stop_at = time.monotonic() + warmup + seconds
    count_from = time.monotonic() + warmup
    results = []

    def loop(k: int) -> None:
        client = client_module.InferenceServerClient(url)
        ends, lats, errors, bad, worst, first = [], [], 0, 0, 0.0, ""
        out_bytes = expected[0].nbytes
        if protocol == "grpc-shm":
            region = f"tk_out_{os.getpid()}_{k}"
            handle = shm.create_shared_memory_region(region, "/" + region, out_bytes)
            client.register_system_shared_memory(region, "/" + region, out_bytes)
        i = k
        while True:
            t0 = time.monotonic()
            if t0 >= stop_at:
                break
            x = client_module.InferInput("input", list(inputs[i % len(inputs)].shape), "FP32")
            try:
                if protocol == "grpc-shm":
                    nbytes = inputs[0].nbytes
                    x.set_shared_memory(SHM_INPUTS, nbytes, offset=(i % len(inputs)) * nbytes)
                    out = client_module.InferRequestedOutput("output_0")
                    out.set_shared_memory(region, out_bytes)
                    client.infer(model, [x], outputs=[out])
                    got = shm.get_contents_as_numpy(handle, np.float32, expected[0].shape)
                elif protocol == "grpc":
                    x.set_data_from_numpy(inputs[i % len(inputs)])
                    got = client.infer(model, [x]).as_numpy("output_0")
                else:
                    x.set_data_from_numpy(inputs[i % len(inputs)], binary_data=True)
                    got = client.infer(model, [x]).as_numpy("output_0")
            except Exception as exc:  # counted and reported
                errors += 1
                first = first or str(exc)[:200]
                continue
            t1 = time.monotonic()
            err = rel_l2(got, expected[i % len(inputs)])
            worst = max(worst, err)
            bad += err > TOLERANCE
            if t0 >= count_from:
                ends.append(t1)
                lats.append(t1 - t0)
            i += 1
        if protocol == "grpc-shm":
            client.unregister_system_shared_memory(region)
            shm.destroy_shared_memory_region(handle)
        results.append((ends, lats, errors, bad, worst, first))

    ts = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    queue.put(results)


def load(url: str, model: str, clients: int, args: argparse.Namespace, inputs: np.ndarray,
         expected: np.ndarray, protocol: str) -> dict:  # fmt: skip
    procs_n = min(clients, args.client_processes)
    per = [clients // procs_n + (1 if i < clients % procs_n else 0) for i in range(procs_n)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_client_process,
                    args=(url, model, n, args.seconds, args.warmup, inputs, expected, queue,
                          protocol))
        for n in per
    ]  # fmt: skip
    for p in procs:
        p.start()
    rows = [r for _ in procs for r in queue.get(timeout=args.seconds + args.warmup + 300)]
    for p in procs:
        p.join(60)
    lats = sorted(x for r in rows for x in r[1])
    ends = sorted(x for r in rows for x in r[0])
    span = (ends[-1] - ends[0]) if len(ends) > 1 else float("nan")
    out = {
        "clients": clients,
        "requests": len(lats),
        "errors": sum(r[2] for r in rows),
        "mismatches": sum(r[3] for r in rows),
        "worst_rel_l2": max(r[4] for r in rows),
        "infer_per_s": round((len(ends) - 1) / span, 1) if len(ends) > 1 else None,
        "p50_ms": round(1e3 * lats[len(lats) // 2], 3) if lats else None,
        "p99_ms": round(1e3 * lats[min(len(lats) - 1, int(len(lats) * 0.99))], 3) if lats else None,
    }
    first = next((r[5] for r in rows if r[5]), "")
    if first:
        out["first_error"] = first
    return out


def core_load(repo: Path, args: argparse.Namespace, inputs: np.ndarray,
              expected: np.ndarray) -> dict:  # fmt: skip
    """``--clients`` coroutines calling the server's core in this process (no protocol, no
    network) for ``--seconds`` per model: what the scheduler and engine reach on their own."""
    import asyncio

    from tensorkiln.serve.core import ServerCore

    async def one_model(core: ServerCore, model: str) -> dict:
        done, lats, bad, counting = [0], [], [0], [False]

        async def client(k: int, stop_at: float) -> None:
            i = k
            while time.monotonic() < stop_at:
                t0 = time.monotonic()
                _, got = await core.infer(model, None, {"input": inputs[i % len(inputs)]})
                if rel_l2(got["output_0"], expected[i % len(inputs)]) > TOLERANCE:
                    bad[0] += 1
                if counting[0]:
                    done[0] += 1
                    lats.append(time.monotonic() - t0)
                i += 1

        stop_at = time.monotonic() + args.warmup + args.seconds
        tasks = [asyncio.create_task(client(k, stop_at)) for k in range(args.clients)]
        await asyncio.sleep(args.warmup)
        counting[0], t0 = True, time.monotonic()
        await asyncio.gather(*tasks)
        elapsed = time.monotonic() - t0
        lats.sort()
        return {
            "infer_per_s": round(done[0] / elapsed, 1),
            "p50_ms": round(1e3 * lats[len(lats) // 2], 3) if lats else None,
            "mismatches": bad[0],
        }

    async def main() -> dict:
        core = ServerCore(repo, backend=args.backend)
        await core.load_all()
        out = {}
        try:
            for model in ("resnet50_b1", "resnet50"):
                out[model] = await one_model(core, model)
                log(f"{args.clients} coroutines on the core, {model}: {out[model]}")
        finally:
            await core.close()
        b1, dyn = out["resnet50_b1"]["infer_per_s"], out["resnet50"]["infer_per_s"]
        out["dynamic_over_batch1"] = round(dyn / b1, 2) if b1 else None
        return out

    return asyncio.run(main())


def perf_analyzer(binary: str, url: str, work: Path, args: argparse.Namespace) -> dict:
    """Triton's own C++ load generator (scripts/get_perf_analyzer.sh) against the server over
    gRPC, with and without system shared memory: its CSV rows per model and concurrency, the
    server-side breakdown (queue, compute) included."""
    import csv

    out: dict = {}
    for shm in (False, True):
        for model, levels in (
            ("resnet50_b1", f"1:{args.clients}"),
            ("resnet50", f"1:{args.clients}"),
        ):
            key = f"{model} grpc" + (" shared memory" if shm else "")
            report = work / f"pa_{model}_{int(shm)}.csv"
            cmd = [binary, "-m", model, "-u", url, "-i", "grpc", "--concurrency-range",
                   levels + f":{args.clients - 1}", "--measurement-interval", "3000",
                   "-f", str(report)]  # fmt: skip
            if shm:
                cmd += ["--shared-memory", "system"]
            try:
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
            except subprocess.TimeoutExpired:
                out[key] = {"error": "timed out"}
                continue
            if run.returncode != 0 or not report.exists():
                out[key] = {"error": (run.stdout + run.stderr)[-500:]}
                continue
            out[key] = list(csv.DictReader(report.open()))
            log(f"perf_analyzer, {key}: " + "; ".join(
                f"c{r['Concurrency']} {float(r['Inferences/Second']):.0f}/s p50 "
                f"{int(r['p50 latency']) / 1e3:.2f} ms (queue {r['Server Queue']} us, compute "
                f"{r['Server Compute Infer']} us)" for r in out[key]))  # fmt: skip
    return out


def latency_1(call, n: int, warm: int = 30) -> dict:
    """Median and p90 milliseconds of ``n`` calls after ``warm``."""
    for _ in range(warm):
        call()
    lats = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        lats.append(time.perf_counter() - t0)
    lats.sort()
    return {"p50_ms": round(1e3 * statistics.median(lats), 3),
            "p90_ms": round(1e3 * lats[int(0.9 * len(lats))], 3)}  # fmt: skip


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="cuda")
    p.add_argument("--precision", default="fp16")
    p.add_argument("--tiny", action="store_true", help="a small conv net at 32x32 (smoke runs)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--instances", type=int, default=2)
    p.add_argument("--delay-us", type=int, default=200, help="dynamic batching's max queue delay")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--client-processes", type=int, default=16)
    p.add_argument(
        "--protocols", default="grpc,http,grpc-shm",
        help="protocols of the load runs (grpc-shm: gRPC with tensors in shared memory)",
    )  # fmt: skip
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--latency-calls", type=int, default=300)
    p.add_argument("--port", type=int, default=18000)
    p.add_argument("--work", default="/tmp/tk_serve_bench")
    p.add_argument("--json", default=None)
    p.add_argument("--reuse", action="store_true", help="keep --work's repository if built")
    p.add_argument(
        "--perf-analyzer", default=None, metavar="PATH",
        help="also drive the server with Triton's perf_analyzer (scripts/get_perf_analyzer.sh)",
    )  # fmt: skip
    p.add_argument(
        "--frontend-processes", type=int, default=0, metavar="N",
        help="the server's --frontend-processes (protocol handling in N more processes)",
    )  # fmt: skip
    p.add_argument(
        "--grpc-transport",
        choices=["grpcio", "native"],
        default="grpcio",
        help="the server's --grpc-transport",
    )
    p.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="K=V",
        help="an environment variable for the server process (repeatable)",
    )
    args = p.parse_args(argv)

    import tritonclient.grpc as grpcclient
    import tritonclient.http as httpclient

    from tensorkiln.engine import Engine

    work = Path(args.work)
    result: dict = {"args": vars(args), "environment": environment()}
    log(f"environment: {result['environment']}")
    if args.reuse and (work / "repo").is_dir():
        repo = work / "repo"
    else:
        if work.exists():
            import shutil

            shutil.rmtree(work)
        work.mkdir(parents=True)
        repo, result["build_s"] = make_repository(args, work)

    side = 32 if args.tiny else SIDE
    rng = np.random.default_rng()
    inputs = rng.standard_normal((CHECK_INPUTS, 1, 3, side, side)).astype(np.float32)
    engine = Engine.load(repo / "resnet50_b1" / "1" / "model.engine")
    graphs = engine.runtime_backend.cuda_graphs
    ctx = engine.create_execution_context(use_cuda_graph=graphs)
    expected = np.stack([ctx.infer({"input": x})["output_0"] for x in inputs])
    direct = latency_1(lambda: ctx.infer({"input": inputs[0]}), args.latency_calls)
    result["in_process"] = direct
    log(f"in process, batch 1: {direct}")

    proc = start_server(repo, args, work / "server.log")
    try:
        grpc_url, http_url = f"127.0.0.1:{args.port + 1}", f"127.0.0.1:{args.port}"
        gc = grpcclient.InferenceServerClient(grpc_url)
        hc = httpclient.InferenceServerClient(http_url)

        def grpc_call(model: str, x: np.ndarray) -> np.ndarray:
            t = grpcclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x)
            return gc.infer(model, [t]).as_numpy("output_0")

        shm_handle = None
        if "grpc-shm" in args.protocols:
            import tritonclient.utils.shared_memory as shm

            shm_handle = shm.create_shared_memory_region(
                SHM_INPUTS, "/" + SHM_INPUTS, inputs.nbytes
            )
            shm.set_shared_memory_region(shm_handle, [inputs])
            gc.register_system_shared_memory(SHM_INPUTS, "/" + SHM_INPUTS, inputs.nbytes)
            out_handle = shm.create_shared_memory_region("tk_c1_out", "/tk_c1_out", 4000)
            gc.register_system_shared_memory("tk_c1_out", "/tk_c1_out", 4000)

        def grpc_shm_call(model: str) -> np.ndarray:
            t = grpcclient.InferInput("input", list(inputs[0].shape), "FP32")
            t.set_shared_memory(SHM_INPUTS, inputs[0].nbytes)
            o = grpcclient.InferRequestedOutput("output_0")
            o.set_shared_memory("tk_c1_out", expected[0].nbytes)
            gc.infer(model, [t], outputs=[o])
            return shm.get_contents_as_numpy(out_handle, np.float32, expected[0].shape)

        def http_call(model: str, x: np.ndarray) -> np.ndarray:
            t = httpclient.InferInput("input", list(x.shape), "FP32")
            t.set_data_from_numpy(x, binary_data=True)
            return hc.infer(model, [t]).as_numpy("output_0")

        agreement = {}
        for model in ("resnet50", "resnet50_b1"):
            errs = [rel_l2(grpc_call(model, x), e) for x, e in zip(inputs, expected)]
            agreement[model] = max(errs)
        result["agreement_worst_rel_l2"] = agreement
        log(f"agreement with the in-process engine (worst relative L2): {agreement}")
        if max(agreement.values()) > TOLERANCE:
            raise SystemExit("the served answers differ from the engine's: not measuring speed")

        served = {}
        for model in ("resnet50_b1", "resnet50"):
            served[f"{model} grpc"] = latency_1(
                lambda m=model: grpc_call(m, inputs[0]), args.latency_calls
            )
            served[f"{model} http"] = latency_1(
                lambda m=model: http_call(m, inputs[0]), args.latency_calls
            )
        if shm_handle is not None:
            err = rel_l2(grpc_shm_call("resnet50_b1"), expected[0])
            assert err <= TOLERANCE, f"shared-memory answer differs: {err}"
            served["resnet50_b1 grpc shared memory"] = latency_1(
                lambda: grpc_shm_call("resnet50_b1"), args.latency_calls
            )
        before = scrape(args)
        served["resnet50_b1 grpc (again)"] = latency_1(
            lambda: grpc_call("resnet50_b1", inputs[0]), args.latency_calls, warm=0
        )
        after = scrape(args)
        n = (
            after[("nv_inference_request_success", "resnet50_b1")]
            - before[("nv_inference_request_success", "resnet50_b1")]
        )
        for fam in ("nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                    "nv_inference_compute_infer_duration_us"):  # fmt: skip
            served[f"server {fam} mean"] = round(
                (after[(fam, "resnet50_b1")] - before[(fam, "resnet50_b1")]) / n / 1e3, 3
            )
        result["concurrency_1"] = served
        result["grpc_added_p50_ms"] = round(
            served["resnet50_b1 grpc"]["p50_ms"] - direct["p50_ms"], 3
        )
        for k, v in served.items():
            log(f"concurrency 1, {k}: {v}")
        log(f"gRPC adds {result['grpc_added_p50_ms']} ms p50 over the in-process run")

        loads, result["dynamic_over_batch1"] = {}, {}
        for protocol in args.protocols.split(","):
            url = grpc_url if protocol.startswith("grpc") else http_url
            for model in ("resnet50_b1", "resnet50"):
                key = f"{model} {protocol}"
                before = scrape(args)
                loads[key] = load(url, model, args.clients, args, inputs, expected, protocol)
                after = scrape(args)
                runs, rows = (
                    after[(fam, model)] - before[(fam, model)]
                    for fam in ("nv_inference_exec_count", "nv_inference_count")
                )
                loads[key]["mean_batch_rows"] = round(rows / max(runs, 1), 2)
                log(f"{args.clients} clients, {key}: {loads[key]}")
            b1 = loads[f"resnet50_b1 {protocol}"]["infer_per_s"]
            dyn = loads[f"resnet50 {protocol}"]["infer_per_s"]
            ratio = round(dyn / b1, 2) if b1 and dyn else None
            result["dynamic_over_batch1"][protocol] = ratio
            log(f"dynamic batching / batch-1 serving, {args.clients} clients, {protocol}: {ratio}")
        result["load"] = loads
        if args.perf_analyzer:
            result["perf_analyzer"] = perf_analyzer(args.perf_analyzer, grpc_url, work, args)
        result["core_load"] = core_load(repo, args, inputs, expected)
        if shm_handle is not None:
            shm.destroy_shared_memory_region(shm_handle)
            shm.destroy_shared_memory_region(out_handle)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            result["server_exit"] = proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            result["server_exit"] = "killed"
    result["server_log_tail"] = (work / "server.log").read_text()[-3000:]
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

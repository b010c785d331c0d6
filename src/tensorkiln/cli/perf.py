"""``tensorkiln perf``: a load generator for a KServe v2 server (tensorkiln serve or Triton), with
perf_analyzer's habits. For each concurrency level, that many clients send requests back to back
for the measurement interval. Reported per level: throughput and p50/p90/p95/p99 latency, with the
errors counted."""

from __future__ import annotations

import argparse
import contextlib
import csv
import os
import statistics
import sys
import threading
import time
from typing import Any

import numpy as np

from tensorkiln.cli.common import CLIError, add_subcommand, parse_shapes

EPILOG = """examples:
  tensorkiln perf -m digits                                  (HTTP on localhost:8000, concurrency 1)
  tensorkiln perf -m digits --concurrency-range 1:64:2 -i grpc -u localhost:8001
  tensorkiln perf -m bert --shape input_ids:128 --shape attention_mask:128 -b 8 -f report.csv
  tensorkiln perf -m resnet50 -i grpc --shared-memory system   (same machine as the server)

--concurrency-range START:END:STEP doubles when STEP is omitted (1:8 runs 1, 2, 4, 8), as
perf_analyzer's does with a factor; --shape gives the sizes of an input's -1 dimensions (the batch
dimension excluded). Needs tritonclient: pip install 'tritonclient[http,grpc]'.
"""

PERCENTILES = (50, 90, 95, 99)


def add_parser(sub: Any) -> None:
    p = add_subcommand(sub, "perf", "measure a KServe v2 server's throughput and latency", EPILOG)
    p.add_argument("-m", "--model-name", required=True)
    p.add_argument("-x", "--model-version", default="", help="default: the server's choice")
    p.add_argument("-u", "--url", default=None, help="default: localhost:8000 (http), :8001 (grpc)")
    p.add_argument("-i", "--protocol", choices=["http", "grpc"], default="http")
    p.add_argument("-b", "--batch-size", type=int, default=1, help="rows per request (default: 1)")
    p.add_argument("--concurrency-range", default="1", metavar="START[:END[:STEP]]")
    p.add_argument(
        "--measurement-interval", type=int, default=5000, metavar="MS",
        help="milliseconds of requests per concurrency level (default: 5000)",
    )  # fmt: skip
    p.add_argument(
        "--shape", action="append", default=[], metavar="NAME:DIMS",
        help="sizes of an input's -1 dimensions, batch excluded (e.g. input_ids:128); repeatable",
    )  # fmt: skip
    p.add_argument(
        "--shared-memory", choices=["none", "system"], default="none",
        help="system: put each client's inputs and outputs in shared memory, registered with the "
        "server (same machine; the server needs --allow-shared-memory true)",
    )  # fmt: skip
    p.add_argument(
        "--output-shared-memory-size", type=int, default=102400, metavar="BYTES",
        help="with --shared-memory system: bytes reserved per output (default: 102400)",
    )  # fmt: skip
    p.add_argument("-f", "--latency-report-file", default=None, metavar="CSV")
    p.set_defaults(handler=run_perf)


def concurrency_levels(text: str) -> list[int]:
    """perf_analyzer's START:END:STEP (STEP left out: doubling)."""
    parts = text.split(":")
    try:
        nums = [int(x) for x in parts]
    except ValueError:
        raise CLIError(
            f"--concurrency-range '{text}': give START[:END[:STEP]] in integers"
        ) from None
    if not 1 <= len(nums) <= 3 or any(n < 1 for n in nums):
        raise CLIError(f"--concurrency-range '{text}': START[:END[:STEP]], each 1 or more")
    start, end = nums[0], nums[1] if len(nums) > 1 else nums[0]
    if end < start or end > 1024:
        raise CLIError(f"--concurrency-range '{text}': END must be within START..1024")
    if len(nums) == 3:
        return list(range(start, end + 1, nums[2]))
    out, n = [], start
    while n <= end:
        out.append(n)
        n *= 2
    return out


def _client_module(protocol: str) -> Any:
    try:
        if protocol == "grpc":
            import tritonclient.grpc as module  # lazy: cli start time (an optional dependency)
        else:
            import tritonclient.http as module  # lazy: cli start time (an optional dependency)
    except ImportError:
        raise CLIError(
            f"tensorkiln perf needs tritonclient: pip install 'tritonclient[{protocol}]'"
        ) from None
    return module


def _inputs(client: Any, args: argparse.Namespace, rng: np.random.Generator) -> tuple[list, list]:
    """(name, datatype, random data) of each input of the model's metadata, and the names of
    its outputs."""
    from tensorkiln.serve import protocol  # lazy: cli start time

    grpc = args.protocol == "grpc"
    meta = client.get_model_metadata(
        args.model_name, args.model_version, **({"as_json": True} if grpc else {})
    )
    config = client.get_model_config(
        args.model_name, args.model_version, **({"as_json": True} if grpc else {})
    )
    config = config.get("config", config)
    batched = int(config.get("max_batch_size", 0)) > 0
    given = {name: dims for name, dims in ((s.split(":", 1)[0], s) for s in args.shape)}
    shapes = parse_shapes(",".join(given.values()), "--shape") if given else {}
    out = []
    for t in meta["inputs"]:
        dims = [int(d) for d in t["shape"]][1 if batched else 0 :]
        if -1 in dims:
            fill = list(shapes.get(t["name"], ()))
            if len(fill) != dims.count(-1):
                raise CLIError(
                    f"input '{t['name']}' has shape {dims} (batch excluded): give its "
                    f"{dims.count(-1)} -1 sizes with --shape {t['name']}:SIZES"
                )
            dims = [fill.pop(0) if d == -1 else d for d in dims]
        shape = ([args.batch_size] if batched else []) + dims
        dtype = protocol.numpy_dtype(t["datatype"])
        if dtype is None:
            raise CLIError(f"input '{t['name']}' is {t['datatype']}, which perf cannot draw")
        if dtype.kind == "f":
            data = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            data = rng.integers(0, 2, shape).astype(bool)
        else:
            data = rng.integers(0, 100, shape).astype(dtype)
        out.append((t["name"], t["datatype"], data))
    return out, [t["name"] for t in meta["outputs"]]


class _SharedMemory:
    """One client's regions (perf_analyzer's --shared-memory system): its inputs, written once,
    and room for each output; registered with the server, and removed at the end."""

    def __init__(self, module: Any, client: Any, tag: str, inputs: list, outputs: list,
                 out_size: int) -> None:  # fmt: skip
        import tritonclient.utils.shared_memory as shm  # lazy: an optional dependency

        self.shm, self.client, self.made = shm, client, []
        try:
            self._make(module, tag, inputs, outputs, out_size)
        except BaseException:
            self.close()
            raise

    def _make(self, module: Any, tag: str, inputs: list, outputs: list, out_size: int) -> None:
        shm = self.shm
        size = sum(d.nbytes for _, _, d in inputs)
        self.inputs, offset = [], 0
        handle = self._region(f"{tag}_in", size)
        for name, datatype, data in inputs:
            shm.set_shared_memory_region(handle, [data], offset=offset)
            x = module.InferInput(name, list(data.shape), datatype)
            x.set_shared_memory(f"{tag}_in", data.nbytes, offset=offset)
            self.inputs.append(x)
            offset += data.nbytes
        self.outputs = []
        if outputs:
            self._region(f"{tag}_out", out_size * len(outputs))
            for j, name in enumerate(outputs):
                o = module.InferRequestedOutput(name)
                o.set_shared_memory(f"{tag}_out", out_size, offset=j * out_size)
                self.outputs.append(o)

    def _region(self, name: str, size: int) -> Any:
        handle = self.shm.create_shared_memory_region(name, "/" + name, max(size, 1))
        self.made.append((name, handle))
        self.client.register_system_shared_memory(name, "/" + name, max(size, 1))
        return handle

    def close(self) -> None:
        for name, handle in self.made:
            with contextlib.suppress(Exception):  # (best effort: the region goes regardless)
                self.client.unregister_system_shared_memory(name)
            self.shm.destroy_shared_memory_region(handle)
        self.made = []


def _plain_inputs(module: Any, inputs: list) -> list:
    x = []
    for name, datatype, data in inputs:
        t = module.InferInput(name, list(data.shape), datatype)
        t.set_data_from_numpy(data)
        x.append(t)
    return x


def _requests(client: Any, args: argparse.Namespace, request: dict, stop: threading.Event,
              latencies: list, errors: list, i: int, first_error: list) -> None:  # fmt: skip
    """One client's requests, back to back until ``stop``."""
    while not stop.is_set():
        t0 = time.perf_counter()
        try:
            client.infer(args.model_name, model_version=args.model_version, **request)
        except Exception as exc:  # counted and reported; the load goes on
            errors[i] += 1
            if not first_error:
                first_error.append(str(exc)[:200])
            continue
        latencies.append(time.perf_counter() - t0)


def _level(module: Any, url: str, args: argparse.Namespace, concurrency: int,
           inputs: list, outputs: list) -> dict[str, Any]:  # fmt: skip
    """``concurrency`` clients sending back to back for the interval: the level's figures."""
    latencies: list[list[float]] = [[] for _ in range(concurrency)]
    errors = [0] * concurrency
    first_error: list[str] = []
    stop = threading.Event()

    def client_loop(i: int) -> None:
        client = module.InferenceServerClient(url)
        shared = None
        if args.shared_memory == "system":
            tag = f"tkperf_{os.getpid()}_{concurrency}_{i}"
            try:
                shared = _SharedMemory(module, client, tag, inputs, outputs,
                                       args.output_shared_memory_size)  # fmt: skip
            except Exception as exc:  # (counted: the server refused, or no /dev/shm)
                errors[i] += 1
                first_error.append(f"shared memory: {str(exc)[:200]}")
                return
            request = {"inputs": shared.inputs, "outputs": shared.outputs}
        else:
            request = {"inputs": _plain_inputs(module, inputs)}
        try:
            _requests(client, args, request, stop, latencies[i], errors, i, first_error)
        finally:
            if shared is not None:
                shared.close()

    threads = [
        threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(concurrency)
    ]
    for t in threads:
        t.start()
    time.sleep(min(0.5, args.measurement_interval / 4000))  # (warm-up, not counted)
    for lat in latencies:
        lat.clear()
    t0 = time.perf_counter()
    time.sleep(args.measurement_interval / 1000)
    counted = [list(lat) for lat in latencies]
    elapsed = time.perf_counter() - t0
    stop.set()
    for t in threads:
        t.join(30)
    every = sorted(x for lat in counted for x in lat)
    row: dict[str, Any] = {
        "concurrency": concurrency,
        "requests": len(every),
        "errors": sum(errors),
        "infer_per_s": len(every) * args.batch_size / elapsed,
    }
    for p in PERCENTILES:
        row[f"p{p}_ms"] = (
            1e3 * every[min(len(every) - 1, int(len(every) * p / 100))] if every else None
        )
    row["mean_ms"] = 1e3 * statistics.fmean(every) if every else None
    if first_error:
        row["first_error"] = first_error[0]
    return row


def run_perf(args: argparse.Namespace) -> int:
    if args.batch_size < 1:
        raise CLIError(f"--batch-size {args.batch_size} must be 1 or more")
    if args.measurement_interval < 100:
        raise CLIError("--measurement-interval must be 100 ms or more")
    if args.output_shared_memory_size < 1:
        raise CLIError("--output-shared-memory-size must be 1 or more")
    levels = concurrency_levels(args.concurrency_range)
    module = _client_module(args.protocol)
    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    client = module.InferenceServerClient(url)
    try:
        ready = client.is_model_ready(args.model_name, args.model_version)
    except Exception as exc:
        raise CLIError(f"no server answers at {url} ({args.protocol}): {str(exc)[:200]}") from None
    if not ready:
        raise CLIError(f"model '{args.model_name}' is not ready at {url}")
    inputs, outputs = _inputs(client, args, np.random.default_rng())
    rows = []
    print(f"{args.model_name} over {args.protocol} at {url}, batch {args.batch_size}, "
          f"{args.measurement_interval} ms per level")  # fmt: skip
    print("concurrency  infer/s   p50 ms   p90 ms   p95 ms   p99 ms  errors")
    for c in levels:
        row = _level(module, url, args, c, inputs, outputs)
        rows.append(row)
        cells = [
            f"{row[f'p{p}_ms']:8.2f}" if row[f"p{p}_ms"] is not None else "       -"
            for p in PERCENTILES
        ]
        print(f"{c:11d} {row['infer_per_s']:8.1f} {' '.join(cells)} {row['errors']:7d}")
        if row.get("first_error"):
            print(f"  first error: {row['first_error']}", file=sys.stderr)
    if args.latency_report_file:
        keys = [
            "concurrency",
            "requests",
            "errors",
            "infer_per_s",
            *(f"p{p}_ms" for p in PERCENTILES),
            "mean_ms",
        ]
        with open(args.latency_report_file, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return 1 if any(r["errors"] for r in rows) else 0

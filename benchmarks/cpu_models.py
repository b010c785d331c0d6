"""tensorkiln's cpu backend next to onnxruntime on the CPU, at batch 1 and batch 16.

    python benchmarks/cpu_models.py [--models mobilenet_v3_small,efficientnet_b0,...]
        [--batch-sizes 1,16] [--rounds 5] [--runs 5] [--tiny] [--cache DIR] [--out DIR]
        [--compile] [--pause S] [--round-warmup N]

Models (random weights, nothing downloads): MobileNetV3-Small, EfficientNet-B0 and ResNet-50
(written here in torch.nn with torchvision's layer shapes; torchvision is not a dependency),
BERT-base (seq 128) and the Whisper-base encoder (80x3000 log-mel input, d_model 512, 6 layers),
both from transformers. Each is exported once with the TorchScript exporter (opset 17, dynamic
batch) into --cache (default /tmp/tk-cpu-models) and reused by later runs.

Per model and batch size: an engine is built for the cpu backend with a profile covering the batch
sizes; its outputs are checked against onnxruntime's on the same fresh random inputs (max |diff|
relative to the largest |onnxruntime output| under 1e-4), then both are timed in this process:
warm-up runs, then --rounds rounds alternating between the two runtimes, each round the median of
--runs runs, fewer for slow models (a round of one runtime lasts about --round-s seconds; a
runtime runs alone within a round, and --pause seconds pass before each round: the threads of the
runtime that ran last keep spinning for a while and take a core from the next one, which made the
cpu backend's MobileNetV3-Small at batch 1 run 7-8 ms after onnxruntime's rounds and 3.1-3.5 ms
after a pause of 0.1 s; onnxruntime's own runs after the cpu backend's are slowed the same way;
after the pause --round-warmup untimed runs, as the first runs after a pause are slow for both:
the idle cores wake up, MobileNetV3-Small's first run after 0.1 s took 2x a warm one);
the median of the round medians is reported. onnxruntime runs with its default graph
optimizations and intra_op_num_threads = --threads (default: the machine's cores), torch with as
many threads. The reference (numpy) backend is timed at batch 1 for context (fewer runs).
--tiny uses small configs and images (for the smoke test; its numbers mean nothing).
--compile times the cpu backend's compiled path (create_execution_context(compile=True)): the
first run, which compiles, is reported as compile s, and the plain loop runs in the same rounds
(plain ms) for comparison.
Prints a markdown table and the versions, and writes results.json to --out when given.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from benchmarks.reference_cpu import environment, load_average  # noqa: E402
from tests.models.test_architectures import (  # noqa: E402
    build_bert,
    max_rel_diff,
    resnet50,
    token_feeds,
)

import tensorkiln  # noqa: E402
from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile  # noqa: E402

nn = torch.nn
AGREE_RTOL = 1e-4
Feeds = dict[str, np.ndarray]


# ---------------------------------------------------------------- conv nets, torchvision's shapes


def _make_divisible(v: float, divisor: int = 8) -> int:
    new = max(divisor, int(v + divisor / 2) // divisor * divisor)
    return new + divisor if new < 0.9 * v else new


def _conv_bn(cin: int, cout: int, k: int, stride: int = 1, groups: int = 1, act=None) -> nn.Module:
    layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False)]
    layers.append(nn.BatchNorm2d(cout))
    if act is not None:
        layers.append(act())
    return nn.Sequential(*layers)


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, squeeze: int, act, gate) -> None:
        super().__init__()
        self.fc1 = nn.Conv2d(channels, squeeze, 1)
        self.fc2 = nn.Conv2d(squeeze, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        s = x.mean((2, 3), keepdim=True)
        return x * self.gate(self.fc2(self.act(self.fc1(s))))


class InvertedResidual(nn.Module):
    """MobileNetV3's and EfficientNet's block: expand 1x1, depthwise kxk, SE, project 1x1."""

    def __init__(self, cin, k, cexp, cout, se_squeeze, act, gate, stride) -> None:
        super().__init__()
        layers = []
        if cexp != cin:
            layers.append(_conv_bn(cin, cexp, 1, act=act))
        layers.append(_conv_bn(cexp, cexp, k, stride, groups=cexp, act=act))
        if se_squeeze:
            se_act = nn.ReLU if gate is nn.Hardsigmoid else act
            layers.append(SqueezeExcite(cexp, se_squeeze, se_act, gate))
        layers.append(_conv_bn(cexp, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


def mobilenet_v3_small(num_classes: int = 1000) -> nn.Module:
    # (in, kernel, expanded, out, SE, hardswish, stride): torchvision's mobilenet_v3_small
    setting = [
        (16, 3, 16, 16, True, False, 2),
        (16, 3, 72, 24, False, False, 2),
        (24, 3, 88, 24, False, False, 1),
        (24, 5, 96, 40, True, True, 2),
        (40, 5, 240, 40, True, True, 1),
        (40, 5, 240, 40, True, True, 1),
        (40, 5, 120, 48, True, True, 1),
        (48, 5, 144, 48, True, True, 1),
        (48, 5, 288, 96, True, True, 2),
        (96, 5, 576, 96, True, True, 1),
        (96, 5, 576, 96, True, True, 1),
    ]
    layers = [_conv_bn(3, 16, 3, 2, act=nn.Hardswish)]
    for cin, k, cexp, cout, se, hs, stride in setting:
        act = nn.Hardswish if hs else nn.ReLU
        squeeze = _make_divisible(cexp // 4) if se else 0
        layers.append(InvertedResidual(cin, k, cexp, cout, squeeze, act, nn.Hardsigmoid, stride))
    layers += [
        _conv_bn(96, 576, 1, act=nn.Hardswish),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(576, 1024),
        nn.Hardswish(),
        nn.Dropout(0.2),
        nn.Linear(1024, num_classes),
    ]
    return _randomized(nn.Sequential(*layers))


def efficientnet_b0(num_classes: int = 1000) -> nn.Module:
    # (expand ratio, kernel, stride, in, out, repeats): torchvision's efficientnet_b0
    setting = [
        (1, 3, 1, 32, 16, 1),
        (6, 3, 2, 16, 24, 2),
        (6, 5, 2, 24, 40, 2),
        (6, 3, 2, 40, 80, 3),
        (6, 5, 1, 80, 112, 3),
        (6, 5, 2, 112, 192, 4),
        (6, 3, 1, 192, 320, 1),
    ]
    layers = [_conv_bn(3, 32, 3, 2, act=nn.SiLU)]
    for ratio, k, stride, cin, cout, repeats in setting:
        for i in range(repeats):
            c = cin if i == 0 else cout
            squeeze = max(1, c // 4)
            layers.append(
                InvertedResidual(
                    c, k, c * ratio, cout, squeeze, nn.SiLU, nn.Sigmoid, stride if i == 0 else 1
                )
            )
    layers += [
        _conv_bn(320, 1280, 1, act=nn.SiLU),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Dropout(0.2),
        nn.Linear(1280, num_classes),
    ]
    return _randomized(nn.Sequential(*layers))


def _randomized(model: nn.Module) -> nn.Module:
    """Random weights with BatchNorm statistics that are not the identity (exercises folding)."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", generator=gen)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.0, generator=gen)
                m.bias.normal_(0.0, 0.1, generator=gen)
                m.running_mean.normal_(0.0, 0.1, generator=gen)
                m.running_var.uniform_(0.5, 1.5, generator=gen)
    return model.eval()


# ---------------------------------------------------------------- transformers


class WhisperEncoder(nn.Module):
    """transformers' Whisper encoder with a plain tensor output (last_hidden_state)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers.models.whisper.modeling_whisper import WhisperEncoder as Encoder

        self.model = Encoder(config)

    def forward(self, input_features):
        return self.model(input_features, return_dict=False)[0]


# ---------------------------------------------------------------- the model table


@dataclass(frozen=True)
class Spec:
    make: Callable[[bool], nn.Module]
    feeds: Callable[[int, bool], Feeds]  # (batch, tiny) -> fresh random inputs


def _image(size_full: int, size_tiny: int) -> Callable[[int, bool], Feeds]:
    def feeds(batch: int, tiny: bool) -> Feeds:
        s = size_tiny if tiny else size_full
        rng = np.random.default_rng(batch)
        return {"input": rng.standard_normal((batch, 3, s, s)).astype(np.float32)}

    return feeds


def _bert(tiny: bool) -> nn.Module:
    # bert-base (12 layers, hidden 768, 12 heads), or the tests' small BERT (vocab 1000, seq 16)
    return build_bert(full=not tiny)[0]


def _bert_feeds(batch: int, tiny: bool) -> Feeds:
    return token_feeds(batch, 16 if tiny else 128, 1000 if tiny else 30522)


def _whisper(tiny: bool) -> nn.Module:
    from transformers import WhisperConfig

    # whisper-base's encoder: d_model 512, 6 layers, 8 heads, FFN 2048, 80 mel bins, 1500 frames
    size = dict(d_model=512, encoder_layers=6, encoder_attention_heads=8, encoder_ffn_dim=2048)
    if tiny:
        size = dict(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=128)
    config = WhisperConfig(num_mel_bins=80, max_source_positions=50 if tiny else 1500, **size)
    torch.manual_seed(0)
    return WhisperEncoder(config).eval()


def _whisper_feeds(batch: int, tiny: bool) -> Feeds:
    rng = np.random.default_rng(batch)
    frames = 100 if tiny else 3000
    return {"input_features": rng.standard_normal((batch, 80, frames)).astype(np.float32)}


MODELS: dict[str, Spec] = {
    "mobilenet_v3_small": Spec(lambda tiny: mobilenet_v3_small(), _image(224, 64)),
    "efficientnet_b0": Spec(lambda tiny: efficientnet_b0(), _image(224, 64)),
    "resnet50": Spec(lambda tiny: resnet50(), _image(224, 64)),
    "bert": Spec(_bert, _bert_feeds),
    "whisper_encoder": Spec(_whisper, _whisper_feeds),
}


def export_model(name: str, tiny: bool, cache: Path) -> Path:
    """The model's ONNX file in ``cache`` (TorchScript exporter, opset 17, dynamic batch)."""
    path = cache / f"{name}{'-tiny' if tiny else ''}.onnx"
    if path.exists():
        return path
    cache.mkdir(parents=True, exist_ok=True)
    spec = MODELS[name]
    model, feeds = spec.make(tiny), spec.feeds(1, tiny)
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    with torch.no_grad():
        n_out = len(_as_tuple(model(*args)))
    outputs = [f"output_{i}" for i in range(n_out)]
    axes = {n: {0: "batch"} for n in [*feeds, *outputs]}
    tmp = path.with_suffix(".partial")
    with warnings.catch_warnings(), contextlib.redirect_stdout(sys.stderr), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            args,
            str(tmp),
            input_names=list(feeds),
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    tmp.rename(path)
    return path


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, tuple | list) else (x,)


# ---------------------------------------------------------------- measuring


@dataclass
class Row:
    model: str
    batch: int
    tensorkiln_ms: float | None = None
    onnxruntime_ms: float | None = None
    reference_ms: float | None = None
    max_rel_diff: float | None = None
    rounds_tk_ms: list[float] = field(default_factory=list)
    rounds_ort_ms: list[float] = field(default_factory=list)
    compile_s: float | None = None  # --compile: the first run's seconds (compiling)
    plain_ms: float | None = None  # --compile: the plain loop in the same rounds
    rounds_plain_ms: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        if self.tensorkiln_ms is None or not self.onnxruntime_ms:
            return None
        return self.tensorkiln_ms / self.onnxruntime_ms


def median_ms(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def ort_session(path: Path, threads: int):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def build_engine(path: Path, feeds: Feeds, batches: list[int], backend: str):
    config = BuilderConfig()
    profile = OptimizationProfile()
    for name, x in feeds.items():
        rest = x.shape[1:]
        profile.set_shape(
            name, min=(min(batches), *rest), opt=(min(batches), *rest), max=(max(batches), *rest)
        )
    config.add_optimization_profile(profile)
    return Builder(backend).build(path, config, progress=False)


def measure(name: str, batch: int, path: Path, engine, session, args) -> Row:
    row = Row(name, batch)
    feeds = MODELS[name].feeds(batch, args.tiny)
    ctx = engine.create_execution_context(compile=args.compile)
    plain = engine.create_execution_context(compile=False) if args.compile else None
    names = [o.name for o in session.get_outputs()]
    t0 = time.perf_counter()
    got = ctx.infer(feeds)
    if args.compile:
        row.compile_s = time.perf_counter() - t0
        if ctx._compiled._failed:  # (it warned: the plain loop ran)
            row.note = "compile failed; the plain loop ran"
    expected = session.run(None, feeds)
    row.max_rel_diff = max_rel_diff([got[n] for n in names], expected)
    if row.max_rel_diff > AGREE_RTOL:
        row.note = "outputs disagree with onnxruntime; not timed"
        return row
    for _ in range(args.warmup):
        time.sleep(args.pause)
        ctx.infer(feeds)
        time.sleep(args.pause)
        session.run(None, feeds)
        if plain is not None:
            plain.infer(feeds)
    # runs per round: --runs, fewer where one run is long (at most about --round-s a round)
    t0 = time.perf_counter()
    session.run(None, feeds)
    runs = max(1, min(args.runs, int(args.round_s / (time.perf_counter() - t0))))

    def round_ms(fn: Callable[[], object]) -> float:
        time.sleep(args.pause)
        for _ in range(args.round_warmup if runs > 1 else 0):
            fn()
        return median_ms(fn, runs)

    for _ in range(args.rounds):
        row.rounds_ort_ms.append(round_ms(lambda: session.run(None, feeds)))
        row.rounds_tk_ms.append(round_ms(lambda: ctx.infer(feeds)))
        if plain is not None:
            row.rounds_plain_ms.append(round_ms(lambda: plain.infer(feeds)))
    row.tensorkiln_ms = statistics.median(row.rounds_tk_ms)
    if plain is not None:
        row.plain_ms = statistics.median(row.rounds_plain_ms)
    row.onnxruntime_ms = statistics.median(row.rounds_ort_ms)
    if batch == 1 and args.reference:
        ref = build_engine(path, feeds, [1], "reference").create_execution_context()
        ref.infer(feeds)
        row.reference_ms = median_ms(lambda: ref.infer(feeds), max(2, args.runs // 2))
    return row


def run_model(name: str, args) -> list[Row]:
    try:
        path = export_model(name, args.tiny, Path(args.cache))
    except Exception as exc:
        note = f"export failed: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        return [Row(name, b, note=note) for b in args.batch_sizes]
    session = ort_session(path, args.threads)
    feeds = MODELS[name].feeds(1, args.tiny)
    try:
        engine = build_engine(path, feeds, args.batch_sizes, "cpu")
    except tensorkiln.TensorkilnError as exc:
        return [Row(name, b, note=f"build failed: {exc}"[:200]) for b in args.batch_sizes]
    rows = []
    for batch in args.batch_sizes:
        row = measure(name, batch, path, engine, session, args)
        print(f"{name} batch {batch}: {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[Row], compiled: bool = False) -> list[str]:
    if compiled:
        return compile_table(rows)
    lines = [
        "| model | batch | tensorkiln cpu ms | onnxruntime ms | ratio | reference ms "
        "| max rel diff | note |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {_fmt(r.tensorkiln_ms, '.2f')} | "
            f"{_fmt(r.onnxruntime_ms, '.2f')} | {_fmt(r.ratio, '.2f')}x | "
            f"{_fmt(r.reference_ms, '.1f')} | {_fmt(r.max_rel_diff, '.1e')} | {r.note} |"
        )
    return lines


def compile_table(rows: list[Row]) -> list[str]:
    lines = [
        "| model | batch | compile s | compiled ms | plain loop ms | onnxruntime ms | ratio "
        "| max rel diff | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.model} | {r.batch} | {_fmt(r.compile_s, '.1f')} | "
            f"{_fmt(r.tensorkiln_ms, '.2f')} | {_fmt(r.plain_ms, '.2f')} | "
            f"{_fmt(r.onnxruntime_ms, '.2f')} | {_fmt(r.ratio, '.2f')}x | "
            f"{_fmt(r.max_rel_diff, '.1e')} | {r.note} |"
        )
    return lines


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--batch-sizes", default="1,16", help="comma-separated batch sizes")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    parser.add_argument("--runs", type=int, default=5, help="timed runs per round (median)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed runs of each first")
    parser.add_argument(
        "--round-s", type=float, default=2.0, help="fewer runs per round for slow models"
    )
    parser.add_argument(
        "--pause", type=float, default=0.1, help="seconds of quiet before each round"
    )
    parser.add_argument("--round-warmup", type=int, default=2, help="untimed runs after each pause")
    parser.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="both runtimes' threads"
    )
    parser.add_argument("--tiny", action="store_true", help="small configs (smoke test)")
    parser.add_argument("--no-reference", dest="reference", action="store_false")
    parser.add_argument(
        "--compile", action="store_true", help="the compiled path (torch.compile), with the loop"
    )
    parser.add_argument("--cache", default="/tmp/tk-cpu-models", help="exported ONNX files")
    parser.add_argument("--out", default=None, help="folder for results.json")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(MODELS)}")
    args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    load_at_start = load_average()
    rows = [row for name in args.models for row in run_model(name, args)]
    env = environment(load_at_start)
    wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    env.append(
        f"- torch threads {torch.get_num_threads()}, ISA {torch.backends.cpu.get_cpu_capability()}"
        f", OMP_WAIT_POLICY {wait}"
    )
    print("\n".join([*table(rows, args.compile), "", *env]))
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        results = {"models": [asdict(r) | {"ratio": r.ratio} for r in rows], "environment": env}
        (out / "results.json").write_text(json.dumps(results, indent=1))
    return 0 if all(r.max_rel_diff is not None and not r.note for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

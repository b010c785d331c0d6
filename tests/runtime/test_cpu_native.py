"""The cpu backend's native convolution kernels (kernels/cpu/native.c): every geometry,
activation and residual order against the numpy reference ConvAct, NaN and inf kept, the network
path against onnxruntime, and the ways the library can be missing (no compiler, switched off, a
cache folder others can write), where the cpu backend must run as before."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

from tensorkiln.kernels.cpu import native as cpu_native  # noqa: E402
from tensorkiln.kernels.cpu.conv import hold_weight  # noqa: E402
from tensorkiln.kernels.cuda.fused_conv import conv_act, geometry_of  # noqa: E402
from tensorkiln.kernels.reference.fused_conv import conv_act as reference  # noqa: E402
from tests.runtime.test_cpu_backend import RTOL, _build, _conv_net, _export  # noqa: E402

pytestmark = pytest.mark.skipif(
    cpu_native.library() is None, reason="no C compiler to build the native kernels"
)

ACTIVATIONS = [
    ("", {}),
    ("Relu", {}),
    ("Clip", {"activation_min": -0.5, "activation_max": 0.75}),
    ("Clip", {"activation_min": 0.0}),
    ("HardSwish", {}),
    ("HardSigmoid", {}),
    ("HardSigmoid", {"activation_alpha": 1 / 6, "activation_beta": 0.5}),
    ("Sigmoid", {}),
    ("Swish", {}),
    ("LeakyRelu", {"activation_alpha": 0.2}),
    ("LeakyRelu", {}),
]


def _native(x, w, b, z, **attrs):
    """The native function for these arguments (asserting that it applies)."""
    xt, wt = torch.from_numpy(x), torch.from_numpy(w)
    bt = None if b is None else torch.from_numpy(b)
    g = geometry_of(
        xt,
        wt,
        attrs.get("auto_pad", "NOTSET"),
        attrs.get("dilations"),
        None,
        attrs.get("pads"),
        attrs.get("strides"),
    )
    act = cpu_native.activation(
        attrs.get("activation", ""),
        attrs.get("activation_alpha"),
        attrs.get("activation_beta"),
        attrs.get("activation_min"),
        attrs.get("activation_max"),
    )
    order = 0 if attrs.get("residual_order", "add_act") == "add_act" else 1
    fn = cpu_native.layer(xt, wt, bt, g, attrs.get("group", 1), act, order)
    assert fn is not None
    return fn(xt, None if z is None else torch.from_numpy(z))


def _close(got, want) -> None:
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))


# (channels, kernel, strides, pads, dilations, batch, size): tails of every vector width
DEPTHWISE = [
    (16, 3, 1, [1, 1, 1, 1], 1, 1, 12),
    (72, 3, 2, [1, 1, 1, 1], 1, 2, 15),
    (20, 5, 1, [2, 2, 2, 2], 1, 1, 9),
    (7, 5, 2, [0, 1, 2, 1], 1, 1, 11),  # asymmetric padding, fewer channels than a vector
    (33, 3, 1, [2, 2, 2, 2], 2, 1, 10),  # dilated
    (48, 3, 3, [0, 0, 0, 0], 1, 1, 13),
    (12, 1, 1, [0, 0, 0, 0], 1, 1, 6),
]


@pytest.mark.parametrize(("c", "k", "s", "pads", "d", "n", "size"), DEPTHWISE)
def test_depthwise_matches_the_reference(c, k, s, pads, d, n, size) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((n, c, size, size + 3)).astype(np.float32)
    w = rng.standard_normal((c, 1, k, k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    for activation, extra in ACTIVATIONS:
        attrs = {"group": c, "strides": [s, s], "pads": pads, "dilations": [d, d]}
        attrs.update(activation=activation, **extra)
        _close(_native(x, w, b, None, **attrs).numpy(), reference(x, w, b, **attrs))


# (cin, cout, batch, height, width): rows and columns off the kernels' blocks
POINTWISE = [
    (16, 16, 1, 7, 9),
    (24, 72, 2, 5, 5),
    (96, 40, 1, 3, 3),
    (5, 3, 1, 1, 1),
    (8, 100, 1, 4, 1),
]


@pytest.mark.parametrize(("cin", "cout", "n", "h", "wd"), POINTWISE)
def test_pointwise_matches_the_reference(cin, cout, n, h, wd) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((n, cin, h, wd)).astype(np.float32)
    w = rng.standard_normal((cout, cin, 1, 1)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    for activation, extra in ACTIVATIONS:
        attrs = {"activation": activation, **extra}
        _close(_native(x, w, b, None, **attrs).numpy(), reference(x, w, b, **attrs))
    _close(_native(x, w, None, None).numpy(), reference(x, w))  # no bias


@pytest.mark.parametrize(
    ("cin", "cout", "k", "s", "pads", "d"),
    [(3, 16, 3, 2, [1, 1, 1, 1], 1), (3, 40, 3, 1, [0, 1, 1, 0], 1), (8, 8, 3, 1, [2, 2, 2, 2], 2)],
)
def test_stem_convolution_matches_the_reference(cin, cout, k, s, pads, d) -> None:
    rng = np.random.default_rng()
    x = rng.standard_normal((2, cin, 17, 14)).astype(np.float32)
    w = rng.standard_normal((cout, cin, k, k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    for activation, extra in ACTIVATIONS[:5]:
        attrs = {"strides": [s, s], "pads": pads, "dilations": [d, d], "activation": activation}
        attrs.update(extra)
        _close(_native(x, w, b, None, **attrs).numpy(), reference(x, w, b, **attrs))


@pytest.mark.parametrize("order", ["add_act", "act_add"])
@pytest.mark.parametrize("kind", ["depthwise", "pointwise", "stem"])
def test_residual_in_both_orders(order: str, kind: str) -> None:
    rng = np.random.default_rng()
    c = 24
    cin, k, group = {"depthwise": (c, 3, c), "pointwise": (40, 1, 1), "stem": (3, 3, 1)}[kind]
    x = rng.standard_normal((2, cin, 9, 9)).astype(np.float32)
    w = rng.standard_normal((c, cin // group, k, k)).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    z = rng.standard_normal((2, c, 9, 9)).astype(np.float32)
    kept = z.copy()
    attrs = {
        "group": group,
        "pads": [k // 2] * 4,
        "activation": "HardSwish",
        "residual_order": order,
    }
    _close(_native(x, w, b, z, **attrs).numpy(), reference(x, w, b, z, **attrs))
    np.testing.assert_array_equal(z, kept)  # the residual is read, never written


def test_nan_and_inf_propagate_as_in_the_reference() -> None:
    c = 16
    x = np.random.default_rng().standard_normal((1, c, 6, 6)).astype(np.float32)
    x[0, :4, 2, 2] = [np.nan, np.inf, -np.inf, 1e30]
    w = np.abs(np.random.default_rng().standard_normal((c, 1, 1, 1))).astype(np.float32)
    b = np.zeros(c, np.float32)
    for activation, extra in ACTIVATIONS:
        attrs = {"group": c, "activation": activation, **extra}
        got = _native(x, w, b, None, **attrs).numpy()
        with np.errstate(invalid="ignore", over="ignore"):
            want = reference(x, w, b, **attrs)
        np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
        finite = np.isfinite(want)
        np.testing.assert_array_equal(
            got[~finite & ~np.isnan(want)], want[~finite & ~np.isnan(want)]
        )
        scale = float(np.abs(want[finite]).max())
        np.testing.assert_allclose(got[finite], want[finite], rtol=RTOL, atol=RTOL * scale)


def test_network_through_native_kernels_matches_onnxruntime(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "always")
    shape = (1, 3, 32, 32)
    path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", tmp_path)
    engine = _build(path, "cpu", shape, 4)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    with engine.create_execution_context() as ctx:
        ctx._threads = None  # (one run per call: the second call at a shape is specialized)
        for batch in (2, 2, 1, 1):
            x = rng.standard_normal((batch, *shape[1:])).astype(np.float32) * 3
            _close(ctx.infer({"x": x})["y"], session.run(None, {"x": x})[0])
        steps = ctx._executor._plan(engine.graph)
        names = [fn.__name__ for s in steps if s.specialized for fn in s.specialized.values()]
    # the depthwise, stem and 1x1 convolutions ran natively (the grouped one has no kernel here)
    assert names.count("run_native") >= 10


def test_native_function_hands_other_weights_to_the_kernel(monkeypatch) -> None:
    """A specialized function serves the weight and bias it was made for; any other goes to
    the general path (never the packed copy of the first)."""
    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "always")
    rng = np.random.default_rng()
    x = torch.from_numpy(rng.standard_normal((1, 8, 6, 6)).astype(np.float32))
    w = hold_weight(torch.from_numpy(rng.standard_normal((8, 1, 3, 3)).astype(np.float32)))
    b = torch.from_numpy(rng.standard_normal(8).astype(np.float32))
    attrs = {"group": 8, "pads": [1, 1, 1, 1], "activation": "Relu"}
    with torch.inference_mode():
        fast = conv_act.specialize(x, w, b, **attrs)
        assert fast is not None and fast.__name__ == "run_native"
        b2 = b + 1.0
        w2 = hold_weight(w * 2.0)
        for ww, bb in ((w, b), (w, b2), (w2, b)):
            want = reference(x.numpy(), ww.contiguous().numpy(), bb.numpy(), **attrs)
            _close(fast(x, ww, bb).numpy(), want)


def _reload(monkeypatch, **env: str) -> cpu_native.Native | None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cpu_native._load.cache_clear()
    try:
        return cpu_native.library()
    finally:
        cpu_native._load.cache_clear()


def test_missing_compiler_or_switched_off_runs_without_them(
    tmp_path: Path, monkeypatch, caplog
) -> None:
    assert _reload(monkeypatch, TENSORKILN_CPU_NATIVE="0") is None
    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "1")
    with caplog.at_level(logging.INFO, logger="tensorkiln"):
        got = _reload(
            monkeypatch,
            CC="no-such-compiler",
            PATH=str(tmp_path),
            TENSORKILN_CACHE_DIR=str(tmp_path / "c"),
        )
    assert got is None
    assert "native CPU kernels unavailable" in caplog.text and "no C compiler" in caplog.text
    # the cpu backend then runs its torch paths, with the same answers
    shape = (1, 3, 32, 32)
    monkeypatch.setenv("PATH", os.defpath)
    path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", tmp_path)
    engine = _build(path, "cpu", shape, 2)
    x = np.random.default_rng().standard_normal(shape).astype(np.float32)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with engine.create_execution_context() as ctx:
        for _ in range(2):
            _close(ctx.infer({"x": x})["y"], session.run(None, {"x": x})[0])


def test_cache_folder_others_can_write_is_refused(tmp_path: Path, monkeypatch, caplog) -> None:
    cache = tmp_path / "shared"
    (cache / "native").mkdir(parents=True)
    os.chmod(cache / "native", 0o777)
    with caplog.at_level(logging.INFO, logger="tensorkiln"):
        assert _reload(monkeypatch, TENSORKILN_CACHE_DIR=str(cache)) is None
    assert "not private" in caplog.text


def test_library_is_built_once_and_reused(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    first = _reload(monkeypatch, TENSORKILN_CACHE_DIR=str(cache))
    assert first is not None
    built = list((cache / "native").glob("cpu_native-*.so"))
    assert len(built) == 1 and oct(os.stat(cache / "native").st_mode & 0o777) == "0o700"
    stamp = built[0].stat().st_mtime_ns
    assert _reload(monkeypatch, TENSORKILN_CACHE_DIR=str(cache)) is not None
    assert built[0].stat().st_mtime_ns == stamp  # loaded, not rebuilt


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_matches_the_reference(m: int, trans_b: int, monkeypatch) -> None:
    """The native GEMM of Gemm and GemmAct (a classifier head at small batch), through the
    kernels' specialization: rows fewer than a block, columns off the panels."""
    from tensorkiln.kernels.cuda.fused_gemm import gemm, gemm_act
    from tensorkiln.kernels.reference.fused_gemm import gemm_act as reference_gemm_act

    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "always")
    rng = np.random.default_rng()
    k, n = 37, 70
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    t = torch.from_numpy
    for c in (None, rng.standard_normal(n).astype(np.float32)):
        for activation, extra in ACTIVATIONS[:6]:
            attrs = {"transB": trans_b, "activation": activation, **extra}
            want = reference_gemm_act(a, b, c, **attrs)
            ct = None if c is None else t(c)
            args = (t(a), t(b), ct)
            fast = gemm_act.specialize(*args, **attrs)
            plain = gemm.specialize(*args, transB=trans_b) if activation == "" else None
            assert fast is not None and fast.__name__ == "run_native"
            _close(fast(*args).numpy(), want)
            if plain is not None:
                _close(plain(*args).numpy(), want)


def test_squeeze_excite_runs_natively_in_the_network(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "always")
    shape = (1, 3, 32, 32)
    path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", tmp_path)
    engine = _build(path, "cpu", shape, 4)
    assert sum(n.op == "SqueezeExcite" for n in engine.graph.nodes) == 2
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng().standard_normal((3, *shape[1:])).astype(np.float32)
    with engine.create_execution_context() as ctx:
        first = ctx.infer({"x": x})["y"]
        _close(first, session.run(None, {"x": x})[0])
        np.testing.assert_array_equal(ctx.infer({"x": x})["y"], first)  # one function per shape
        steps = ctx._executor._plan(engine.graph)
    se = [fn for s in steps if s.node.op == "SqueezeExcite" for fn in s.specialized.values()]
    assert len(se) == 2 and all(fn.__name__ == "run_native" for fn in se)


def test_channels_last_copy_matches_torch() -> None:
    for shape in ((1, 3, 224, 224), (2, 5, 7, 9), (1, 1, 1, 1)):
        x = torch.randn(shape)
        y = torch.empty_like(x, memory_format=torch.channels_last)
        assert cpu_native.to_channels_last(x, y)
        assert torch.equal(y, x) and y.is_contiguous(memory_format=torch.channels_last)
    # layouts it does not take are left to torch
    x = torch.randn(2, 3, 4, 5)
    assert not cpu_native.to_channels_last(x.transpose(2, 3), torch.empty(2, 3, 5, 4))


def test_source_builds_with_openmp_where_the_compiler_has_it(tmp_path: Path) -> None:
    """The library falls back to one thread when -fopenmp fails; that must only ever be for a
    compiler without OpenMP, never an error in the source."""
    import subprocess

    cc = cpu_native._compiler()
    probe = tmp_path / "probe.c"
    probe.write_text("#include <omp.h>\nint f(void) { return omp_get_max_threads(); }\n")
    flags = [*cpu_native._FLAGS, "-fopenmp"]
    if subprocess.run([cc, *flags, "-o", str(tmp_path / "p.so"), str(probe)]).returncode:
        pytest.skip(f"{cc} has no OpenMP")
    done = subprocess.run(
        [cc, *flags, "-Wall", "-o", str(tmp_path / "k.so"), str(cpu_native._SOURCE)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0 and "warning" not in done.stderr, done.stderr


def test_malloc_tuning_is_skipped_where_asked_or_set_by_the_user(monkeypatch) -> None:
    from tensorkiln.backends import cpu_memory

    monkeypatch.setenv("TENSORKILN_CPU_MALLOC", "0")
    assert not cpu_memory.wanted()
    monkeypatch.delenv("TENSORKILN_CPU_MALLOC")
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # the user's own setting stands
    assert not cpu_memory.wanted()
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    import platform
    import sys

    on_glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert cpu_memory.wanted() == on_glibc


_PAGE_FAULTS = """
import resource, sys
import numpy as np
from tensorkiln.backends import cpu_memory
from tests.runtime.test_cpu_backend import _build, _conv_net, _export
from pathlib import Path

shape = (16, 3, 160, 160)  # (a 52 MB activation: 64,000 page faults in 5 runs untuned)
path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", Path(sys.argv[1]))
engine = _build(path, "cpu", shape, 16)
x = np.random.default_rng().standard_normal(shape).astype(np.float32)
with engine.create_execution_context() as ctx:
    assert cpu_memory.tune()
    for _ in range(12):  # (specialization and thread choice settle first)
        ctx.infer({"x": x})
    windows = []
    for _ in range(3):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(5):
            ctx.infer({"x": x})
        windows.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(min(windows))
"""


def test_runs_at_batch_16_touch_no_new_pages_after_the_first(tmp_path: Path) -> None:
    """With malloc tuned (cpu_memory), a run's activations reuse the memory of the run before:
    no page faults in steady state (before: tens of thousands a run at batch 16), measured as the
    quietest of three windows of five runs. In a process
    of its own, as a user's would be: what hundreds of earlier tests left in a test process's
    heap (fragments, other threads' arenas) is not what a deployment sees."""
    import subprocess
    import sys

    from tensorkiln.backends import cpu_memory

    if not cpu_memory.wanted():
        pytest.skip("malloc tuning is for glibc")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    done = subprocess.run(
        [sys.executable, "-c", _PAGE_FAULTS, str(tmp_path)],
        capture_output=True, text=True, env=env, cwd=root, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    faults = int(done.stdout.split()[-1])
    # (untuned: about 64,000 in every window of 5 runs; a few dozen come from elsewhere in the
    # process. The quietest of three windows: once in a CI run of the whole suite one window
    # took 12,800, one activation's pages faulted once, which is not the steady state)
    assert faults < 2000, faults


def test_global_average_pool_matches_the_reference() -> None:
    from tensorkiln.kernels.cuda.pool import global_average_pool
    from tensorkiln.kernels.reference.pool import global_average_pool as reference_pool

    for shape in ((1, 576, 7, 7), (3, 20, 5, 9), (2, 7, 1, 1)):
        x = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        fast = global_average_pool.specialize(x)
        assert fast is not None
        want = reference_pool(x.contiguous().numpy())
        _close(fast(x).numpy(), want)
        _close(fast(x.contiguous()).numpy(), want)  # an NCHW input is made channels-last first

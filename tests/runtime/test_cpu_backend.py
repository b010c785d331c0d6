"""The cpu backend (the torch kernels on CPU tensors) against the reference backend and
onnxruntime: a small conv net with the layers of MobileNet and EfficientNet (depthwise and
grouped convolutions, squeeze-excite, residual adds, hardswish, SiLU), a transformer block, dynamic
batch, the "auto" choice, engine files, and clear errors where PyTorch is missing."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from tensorkiln import backends as backends_module
from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile
from tensorkiln.engine import Engine
from tensorkiln.errors import EngineCompatibilityError, InputError, TensorkilnError
from tests.cli.helpers import CLI, assert_one_line_error, mlp_model

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn = torch.nn

RTOL = 1e-4


class _Block(nn.Module):
    """Expand 1x1, depthwise kxk (strided), squeeze-excite, project 1x1, residual where it fits."""

    def __init__(self, cin: int, cexp: int, cout: int, k: int, stride: int, act) -> None:
        super().__init__()
        self.expand = nn.Sequential(
            nn.Conv2d(cin, cexp, 1, bias=False), nn.BatchNorm2d(cexp), act()
        )
        self.depthwise = nn.Sequential(
            nn.Conv2d(cexp, cexp, k, stride, k // 2, groups=cexp, bias=False),
            nn.BatchNorm2d(cexp),
            act(),
        )
        self.se = nn.Sequential(
            nn.AdaptiveAvgPool2d(1),
            nn.Conv2d(cexp, 8, 1),
            nn.ReLU(),
            nn.Conv2d(8, cexp, 1),
            nn.Hardsigmoid(),
        )
        self.project = nn.Sequential(nn.Conv2d(cexp, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.depthwise(self.expand(x))
        y = self.project(y * self.se(y))
        return x + y if self.residual else y


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1, bias=False),
        nn.BatchNorm2d(16),
        nn.Hardswish(),
        _Block(16, 32, 16, 3, 1, nn.ReLU),
        _Block(16, 48, 24, 5, 2, nn.SiLU),
        nn.Conv2d(24, 24, 3, 1, 1, groups=4),  # grouped, not depthwise
        nn.Conv2d(24, 512, 1),  # 1x1 convolutions with large weights (prepacked)
        nn.ReLU(),
        nn.Conv2d(512, 256, 1),
        nn.ReLU6(),  # (Clip)
        nn.Conv2d(256, 24, 1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(24, 10),
    )
    with torch.no_grad():  # BatchNorm statistics that are not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.normal_(0.0, 0.2)
                m.running_var.uniform_(0.5, 1.5)
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0.0, 0.2)
    return model.eval()


def _transformer() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()


def _export(model: nn.Module, example: np.ndarray, name: str, folder: Path) -> Path:
    """TorchScript exporter, opset 17, dynamic batch."""
    path = folder / f"{name}.onnx"
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # (the fused path does not export)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                model,
                (torch.from_numpy(example),),
                str(path),
                input_names=["x"],
                output_names=["y"],
                dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}},
                opset_version=17,
                dynamo=False,
            )
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    return path


def _build(path: Path, backend: str, shape: tuple[int, ...], max_batch: int) -> Engine:
    config = BuilderConfig()
    rest = shape[1:]
    profile = OptimizationProfile().set_shape(
        "x", min=(1, *rest), opt=(1, *rest), max=(max_batch, *rest)
    )
    config.add_optimization_profile(profile)
    return Builder(backend).build(path, config, progress=False)


def _check_against_oracles(path: Path, shape: tuple[int, ...]) -> Engine:
    cpu = _build(path, "cpu", shape, 4)
    ref = _build(path, "reference", shape, 4)
    assert cpu.backend == "cpu" and ref.backend == "reference"
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    with cpu.create_execution_context() as c, ref.create_execution_context() as r:
        for batch in (1, 3, 1):  # dynamic batch, and back
            x = rng.standard_normal((batch, *shape[1:])).astype(np.float32)
            got = c.infer({"x": x})["y"]
            want = r.infer({"x": x})["y"]
            (onnxruntime,) = session.run(None, {"x": x})
            assert isinstance(got, np.ndarray) and got.flags.c_contiguous
            assert got.shape == want.shape == onnxruntime.shape and got.dtype == np.float32
            for expected in (want, onnxruntime):
                atol = RTOL * float(np.abs(expected).max())
                np.testing.assert_allclose(got, expected, rtol=RTOL, atol=atol)
    return cpu


def test_conv_net_matches_reference_and_onnxruntime(tmp_path: Path) -> None:
    shape = (1, 3, 32, 32)
    path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", tmp_path)
    engine = _check_against_oracles(path, shape)
    # the convolutions ran on weights held channels-last, prepacked where it pays
    weights = [w for w in engine.device_weights["cpu"].values() if w.ndim == 4]
    assert weights and all(w.is_contiguous(memory_format=torch.channels_last) for w in weights)
    packed = [w for w in weights if getattr(w, "_tensorkiln_packed", None)]
    assert {tuple(w.shape[2:]) for w in packed} == {(3, 3), (5, 5), (1, 1)}


def test_shape_specialized_convolutions_match_the_oracles(tmp_path: Path, monkeypatch) -> None:
    import functools

    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "0")  # the torch paths (test_cpu_native.py: theirs)

    shape = (1, 3, 32, 32)
    path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", tmp_path)
    engine = _build(path, "cpu", shape, 4)
    ref = _build(path, "reference", shape, 4).create_execution_context()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng()
    with engine.create_execution_context() as ctx:
        ctx._threads = None  # (one run per call: the second call at a shape is specialized)
        for batch in (2, 2, 1, 2, 1):
            x = rng.standard_normal((batch, *shape[1:])).astype(np.float32) * 3
            got = ctx.infer({"x": x})["y"]
            for want in (ref.infer({"x": x})["y"], session.run(None, {"x": x})[0]):
                atol = RTOL * float(np.abs(want).max())
                np.testing.assert_allclose(got, want, rtol=RTOL, atol=atol)
        steps = ctx._executor._plan(engine.graph)
        tables = [s.specialized for s in steps if s.node.op == "ConvAct"]
        assert tables and all(t is not None and len(t) == 2 for t in tables)  # 2 shapes each
        fns = [fn for t in tables for fn in t.values()]
        # oneDNN (fused activation) and GEMM paths specialized; the rest run the kernel itself
        special = [fn for fn in fns if not isinstance(fn, functools.partial)]
        assert {"conv", "gemm"} <= {fn.__name__ for fn in special} <= {"conv", "gemm", "conv_add"}


def test_transformer_block_matches_reference_and_onnxruntime(tmp_path: Path) -> None:
    shape = (1, 12, 32)
    path = _export(_transformer(), np.zeros(shape, np.float32), "encoder", tmp_path)
    _check_against_oracles(path, shape)


def test_engine_file_round_trip(tmp_path: Path) -> None:
    path = mlp_model(tmp_path / "mlp.onnx")
    engine = Builder("cpu").build(path, progress=False)
    assert engine.target["device"] == "cpu" and engine.target["torch"] == torch.__version__
    assert engine.target["isa"] == torch.backends.cpu.get_cpu_capability()
    engine.save(tmp_path / "mlp.engine")
    loaded = Engine.load(tmp_path / "mlp.engine")
    assert loaded.backend == "cpu" and loaded.device == "cpu"
    x = np.random.default_rng().standard_normal((5, 4)).astype(np.float32)
    want = Builder("reference").build(path, progress=False).create_execution_context()
    with loaded.create_execution_context() as ctx:
        got = ctx.infer({"x": x})["y"]
        as_tensor = ctx.infer({"x": torch.from_numpy(x)})["y"]  # tensors in, tensors out
    np.testing.assert_allclose(got, want.infer({"x": x})["y"], rtol=1e-5, atol=1e-5)
    assert isinstance(as_tensor, torch.Tensor)
    np.testing.assert_allclose(as_tensor.numpy(), got, rtol=1e-6, atol=1e-6)


def test_auto_is_cpu_without_a_gpu_and_reference_without_torch(monkeypatch) -> None:
    monkeypatch.setattr(backends_module, "cuda_available", lambda: False)
    assert Builder().backend == "cpu" and Builder().device == "cpu"
    monkeypatch.setattr(backends_module, "cuda_available", lambda: True)
    assert backends_module.auto_backend() == "cuda"
    _without_torch(monkeypatch)
    monkeypatch.setattr(backends_module, "cuda_available", lambda: False)
    assert Builder().backend == "reference" and Builder().device is None


def _without_torch(monkeypatch) -> None:
    """Make `import torch` fail, as on a machine without it."""
    monkeypatch.setitem(sys.modules, "torch", None)


def test_cpu_backend_without_torch_is_a_clear_error(monkeypatch, tmp_path: Path) -> None:
    path = mlp_model(tmp_path / "mlp.onnx")
    Builder("cpu").build(path, progress=False).save(tmp_path / "mlp.engine")
    _without_torch(monkeypatch)
    with pytest.raises(
        InputError, match=r"cpu backend needs PyTorch.*download\.pytorch\.org/whl/cpu"
    ):
        Builder("cpu")
    with pytest.raises(EngineCompatibilityError, match=r"needs PyTorch.*--backend reference"):
        Engine.load(tmp_path / "mlp.engine")


def test_cli_cpu_backend_without_torch_is_one_line(monkeypatch, capsys, tmp_path: Path) -> None:
    path = mlp_model(tmp_path / "mlp.onnx")
    _without_torch(monkeypatch)
    rc, _, err = CLI(capsys)("build", path, "-o", tmp_path / "m.engine", "--backend", "cpu")
    assert_one_line_error(rc, err)
    assert "needs PyTorch" in err


def test_unsupported_op_names_the_cpu_backend() -> None:
    from tensorkiln.kernels.registry import lookup

    with pytest.raises(TensorkilnError, match="'cpu' backend does not support"):
        lookup("NoSuchOp", "", 17, "cpu")


@pytest.fixture
def two_threads():
    """torch on 2 threads for the test, the caller's count restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _sleeps(at_one: float, at_more: float, calls: list[int]):
    """A run that takes ``at_one`` seconds on 1 torch thread and ``at_more`` on more."""
    import time

    def fn() -> int:
        calls.append(torch.get_num_threads())
        time.sleep(at_one if torch.get_num_threads() == 1 else at_more)
        return len(calls)

    return fn


def test_thread_choice_keeps_the_faster_count_per_shape(two_threads) -> None:
    from tensorkiln.runtime.cpu_threads import ThreadChoice

    choice = ThreadChoice()
    calls: list[int] = []
    # a run slower on 2 threads than on 1 (fork/join per small layer): 1 thread from then on
    assert choice.run("small", _sleeps(0.001, 0.006, calls)) == 1  # the first run's result
    assert choice.chosen("small") == 1 and 1 in calls and 2 in calls
    assert torch.get_num_threads() == 2  # restored after every run
    calls.clear()
    choice.run("small", _sleeps(0.001, 0.006, calls))
    assert calls == [1] and torch.get_num_threads() == 2
    # another shape, faster on 2 threads: measured on its own, keeps 2
    choice.run("large", _sleeps(0.006, 0.001, calls))
    assert choice.chosen("large") == 2 and choice.chosen("small") == 1
    # a run too long to be worth measuring runs once, at torch's count; the first may be slow
    # only because it is the first (weights uploaded and packed): decided at the second
    calls.clear()
    choice.run("slow", _sleeps(0.0, 0.06, calls))
    assert calls == [2] and choice.chosen("slow") is None
    choice.run("slow", _sleeps(0.0, 0.06, calls))
    assert calls == [2, 2] and choice.chosen("slow") == 2
    calls.clear()
    choice.run("cold", _sleeps(0.0, 0.06, calls))
    choice.run("cold", _sleeps(0.001, 0.006, calls))  # warm: measured
    assert choice.chosen("cold") == 1 and calls.count(1) >= 2
    # torch's count is the upper bound: set to 1, nothing is measured
    torch.set_num_threads(1)
    calls.clear()
    choice.run("one", _sleeps(0.006, 0.001, calls))
    assert calls == [1] and choice.chosen("one") == 1


def test_context_runs_agree_whatever_the_thread_choice(tmp_path: Path, two_threads) -> None:
    shape = (1, 3, 32, 32)
    path = _export(_conv_net(), np.zeros(shape, np.float32), "convnet", tmp_path)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    engine = _build(path, "cpu", shape, 4)
    rng = np.random.default_rng()
    with engine.create_execution_context() as ctx:
        for batch in (1, 4, 1, 4):  # measured at the first run of each shape, then kept
            x = rng.standard_normal((batch, *shape[1:])).astype(np.float32)
            got = ctx.infer({"x": x})["y"]
            (want,) = session.run(None, {"x": x})
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * float(np.abs(want).max()))
            assert torch.get_num_threads() == 2
        assert {ctx._threads.chosen(k) for k in ctx._threads._best} <= {1, 2}
        assert len(ctx._threads._best) == 2


def _conv_and_relu_model(path: Path, x_also_to_relu: bool) -> Path:
    """x[N,3,8,8] -> Conv 3x3 -> y; with ``x_also_to_relu``, Relu(x) is a second output."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng()
    w = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["y"], pads=[1, 1, 1, 1], name="conv")]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])]
    if x_also_to_relu:
        nodes.append(helper.make_node("Relu", ["x"], ["r"], name="relu"))
        outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 3, 8, 8]))
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])
    graph = helper.make_graph(nodes, "g", [x], outputs, initializer=[w])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    return path


@pytest.mark.parametrize("x_also_to_relu", [False, True])
def test_inputs_only_convolutions_read_are_uploaded_channels_last(
    tmp_path: Path, x_also_to_relu: bool
) -> None:
    path = _conv_and_relu_model(tmp_path / "m.onnx", x_also_to_relu)
    engine = _build(path, "cpu", (1, 3, 8, 8), 2)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    x = np.random.default_rng().standard_normal((2, 3, 8, 8)).astype(np.float32)
    kept = x.copy()
    x.setflags(write=False)  # (read-only arrays are taken without a warning)
    with engine.create_execution_context() as ctx, warnings.catch_warnings():
        warnings.simplefilter("error")
        executor = ctx._executor
        (graph_input,) = engine.graph.inputs
        uploaded = executor.upload_input(graph_input, x)
        # one fresh channels-last copy where only the convolution reads the input; otherwise
        # the plain upload (a Relu may take it NCHW)
        assert uploaded.is_contiguous(memory_format=torch.channels_last) != x_also_to_relu
        assert uploaded.data_ptr() != x.ctypes.data
        got = ctx.infer({"x": x})
    for name, want in zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})):
        np.testing.assert_allclose(
            got[name], want, rtol=RTOL, atol=RTOL * float(np.abs(want).max())
        )
    np.testing.assert_array_equal(x, kept)  # the caller's array is never written


@pytest.mark.parametrize(
    ("activation", "order", "kernel"),
    [("", "add_act", 3), ("Relu", "add_act", 3), ("Relu", "act_add", 3), ("Relu", "add_act", 1)],
)
def test_residual_convolutions_on_held_weights_match_the_reference(
    activation: str, order: str, kernel: int, monkeypatch
) -> None:
    """ConvAct with a residual on a weight the cpu backend holds: oneDNN's conv + add + ReLU in
    one call where the activation follows the add (or there is none), the separate passes
    otherwise; the same numbers as the numpy reference either way, first call and specialized."""
    from tensorkiln.kernels.cpu.conv import hold_weight
    from tensorkiln.kernels.cuda.fused_conv import conv_act
    from tensorkiln.kernels.reference.fused_conv import conv_act as reference

    monkeypatch.setenv("TENSORKILN_CPU_NATIVE", "0")  # oneDNN's paths (native: test_cpu_native)
    rng = np.random.default_rng()
    x, w, b, z = (
        rng.standard_normal(s).astype(np.float32)
        for s in ((2, 16, 40, 40), (24, 16, kernel, kernel), (24,), (2, 24, 40, 40))
    )
    attrs = {"pads": [kernel // 2] * 4, "activation": activation, "residual_order": order}
    want = reference(x, w, b, z, **attrs)
    args = (torch.from_numpy(x), hold_weight(torch.from_numpy(w)), torch.from_numpy(b))
    zt = torch.from_numpy(z).clone()
    with torch.inference_mode():
        got = conv_act(*args, zt, **attrs)
        fast = conv_act.specialize(*args, zt, **attrs)
        fused = kernel == 3 and (order == "add_act" or activation == "")
        assert (fast is not None) == fused
        runs = [got] + ([fast(*args, zt)] if fast is not None else [])
    for y in runs:
        np.testing.assert_allclose(
            y.numpy(), want, rtol=RTOL, atol=RTOL * float(np.abs(want).max())
        )
    np.testing.assert_array_equal(zt.numpy(), z)  # the residual is read, never written

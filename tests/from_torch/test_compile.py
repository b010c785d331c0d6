"""tensorkiln.torch.compile: PyTorch modules in, torch tensors out, checked against eager PyTorch."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxscript")

import tensorkiln.torch as tkt  # noqa: E402
from tensorkiln.builder import BuilderConfig  # noqa: E402
from tensorkiln.errors import InputError, ModelLoadError, UnsupportedOpError  # noqa: E402

BACKENDS = ["cpu", "reference"]


class ConvNet(torch.nn.Module):
    """Convolution, BatchNorm, pooling and a linear head; a dict out, a number in."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.drop = torch.nn.Dropout(0.5)
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x, y, scale=2.0):
        h = self.drop(torch.relu(self.bn(self.conv(x)))).mean((2, 3))
        return {"logits": torch.relu(self.head(h)) * scale + y, "features": h}


def _convnet() -> ConvNet:
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    m = ConvNet()
    with torch.no_grad():  # statistics a trained network would have, not the identity
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
        m.bn.weight.uniform_(0.5, 1.5)
        m.bn.bias.uniform_(-0.5, 0.5)
    return m


def _batch(n: int) -> tuple:
    return torch.randn(n, 3, 12, 12), torch.randn(n, 4)


def _compile_convnet(m, backend, **kw):
    batch = torch.export.Dim("batch", min=1, max=16)
    return tkt.compile(
        m, _batch(2), example_kwargs={"scale": 2.0}, backend=backend,
        dynamic_shapes={"x": {0: batch}, "y": {0: batch}, "scale": None}, **kw,
    )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_dynamic_batch_matches_eager(backend):
    m = _convnet()
    m.train()  # compiled for inference; the module's own mode is left as it was
    fast = _compile_convnet(m, backend)
    assert m.training and m.drop.training
    m.eval()
    for n in (1, 5, 16):
        x, y = _batch(n)
        got = fast(x, y, scale=2.0)
        want = m(x, y, scale=2.0)
        assert set(got) == {"logits", "features"}
        for k in want:
            assert isinstance(got[k], torch.Tensor) and got[k].dtype == torch.float32
            torch.testing.assert_close(got[k], want[k].detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_in_and_out_of_inference_mode_give_tensors_the_caller_can_update(backend):
    m = _convnet().eval()
    fast = _compile_convnet(m, backend)
    x, y = _batch(3)
    want = m(x, y, scale=2.0)["logits"].detach()
    with torch.inference_mode():
        inside = fast(torch.clone(x), torch.clone(y), scale=2.0)["logits"]
    outside = fast(x, y, scale=2.0)["logits"]
    assert not outside.is_inference()  # PyTorch's own rule: made outside, updatable outside
    outside += 1.0
    torch.testing.assert_close(outside - 1.0, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(inside, want, rtol=1e-5, atol=1e-5)


def test_a_batch_beyond_the_declared_maximum_is_refused():
    fast = _compile_convnet(_convnet(), "cpu")
    with pytest.raises(InputError, match="x"):
        fast(*_batch(17), scale=2.0)


def test_compiled_in_numbers_must_be_repeated():
    fast = _compile_convnet(_convnet(), "cpu")
    with pytest.raises(InputError, match=r"keyword 'scale' was 2.0 when compiled and is 3.0"):
        fast(*_batch(2), scale=3.0)


def test_a_call_of_another_structure_is_refused():
    fast = _compile_convnet(_convnet(), "cpu")
    with pytest.raises(InputError, match="compiled for calls shaped"):
        fast(*_batch(2))  # scale left out
    with pytest.raises(InputError, match=r"must be a torch.Tensor"):
        fast(np.zeros((2, 3, 12, 12), np.float32), torch.randn(2, 4), scale=2.0)


def test_an_input_on_another_device_is_refused():
    fast = _compile_convnet(_convnet(), "cpu")
    x = torch.empty((2, 3, 12, 12), device="meta")
    with pytest.raises(InputError, match="input 'x' is on meta"):
        fast(x, torch.randn(2, 4), scale=2.0)


def test_an_unbounded_dynamic_dimension_asks_for_a_maximum():
    m = _convnet()
    batch = torch.export.Dim("batch")
    with pytest.raises(InputError, match=r"no maximum.*Dim\('batch', max="):
        tkt.compile(m, _batch(2), dynamic_shapes={"x": {0: batch}, "y": {0: batch}})


def test_what_torch_export_cannot_capture_is_named():
    class Branchy(torch.nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow
                return x * 2
            return x

    with pytest.raises(ModelLoadError, match=r"torch.export could not capture Branchy"):
        tkt.compile(Branchy(), (torch.randn(3),), require_full_compilation=True)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="Branchy runs partly in PyTorch"):
        part = tkt.compile(Branchy(), (torch.randn(3),), backend="cpu")
    for x in (torch.rand(3) + 0.1, -torch.rand(3) - 0.1):  # each branch, as dynamo guards it
        torch.testing.assert_close(part(x), x * 2 if x.sum() > 0 else x)
    torch._dynamo.reset()
    with pytest.raises(InputError, match=r"torch.nn.Module or a torch.export.ExportedProgram"):
        tkt.compile(lambda x: x, (torch.randn(3),))


@torch.library.custom_op("tensorkiln_test::cube", mutates_args=())
def cube(x: torch.Tensor) -> torch.Tensor:
    return x**3


@cube.register_fake
def _(x):
    return torch.empty_like(x)


class Custom(torch.nn.Module):
    """Blocks of supported ops around an op nobody translates."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        return torch.tanh(self.b(cube(torch.relu(self.a(x))) * 0.5)).softmax(-1)


def test_an_op_without_a_translation_is_named_or_left_to_pytorch_outside(tmp_path):
    torch._dynamo.reset()
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    m = Custom().eval()
    x = torch.randn(4, 6)
    with pytest.raises(UnsupportedOpError, match=r"Custom.*tensorkiln_test::cube"):
        tkt.compile(m, (x,), require_full_compilation=True, torch_ops=False)
    with pytest.warns(UserWarning, match=r"Custom runs partly in PyTorch.*tensorkiln_test::cube"):
        part = tkt.compile(m, (x,), backend="cpu", min_block_size=2, torch_ops=False)
    assert isinstance(part, tkt.PartialModule) and "tensorkiln_test::cube" in part.reason
    for n in (4, 2):
        x = torch.randn(n, 6)
        torch.testing.assert_close(part(x), m(x).detach(), rtol=1e-5, atol=1e-6)
    report = part.report
    assert report.engines == 2 and "tensorkiln_test::cube" in report.unsupported, str(report)
    with pytest.raises(InputError, match=r"runs partly in PyTorch"):
        tkt.save(part, tmp_path / "m")
    torch._dynamo.reset()


def _tiny_bert():
    """transformers' BertModel, 2 layers of hidden size 64, random weights, in eval mode."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        vocab_size=500, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    return transformers.BertModel(cfg).eval()


def test_a_transformer_with_a_padding_mask_matches_eager():
    m = _tiny_bert()
    batch, seq = torch.export.Dim("batch", min=1, max=8), torch.export.Dim("seq", min=2, max=64)

    def feeds(b, s):
        mask = torch.ones(b, s, dtype=torch.int64)
        mask[-1, s // 2 :] = 0
        return {"input_ids": torch.randint(0, 500, (b, s)), "attention_mask": mask}

    fast = tkt.compile(
        m, (), example_kwargs=feeds(2, 16), backend="cpu",
        dynamic_shapes={"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}},
    )  # fmt: skip
    for b, s in [(1, 9), (3, 24), (8, 64)]:
        f = feeds(b, s)
        got, want = fast(**f), m(**f)
        assert type(got) is type(want)  # the model's own output class
        for k in ("last_hidden_state", "pooler_output"):
            torch.testing.assert_close(got[k], want[k].detach(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_save_and_load_round_trip(tmp_path, backend):
    m = _convnet().eval()
    fast = _compile_convnet(m, backend)
    tkt.save(fast, tmp_path / "m")
    again = tkt.load(tmp_path / "m")
    x, y = _batch(3)
    want = m(x, y, scale=2.0)
    got = again(x, y, scale=2.0)
    for k in want:
        torch.testing.assert_close(got[k], want[k].detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="keyword 'scale'"):
        again(x, y, scale=1.0)


def test_damaged_saved_modules_are_refused(tmp_path):
    fast = _compile_convnet(_convnet(), "cpu")
    tkt.save(fast, tmp_path / "m")
    meta_path = tmp_path / "m" / "module.json"
    good = json.loads(meta_path.read_text())

    def refused(meta, match):
        meta_path.write_text(meta if isinstance(meta, str) else json.dumps(meta))
        with pytest.raises(ModelLoadError, match=match):
            tkt.load(tmp_path / "m")

    refused("{not json", "not valid JSON")
    refused({**good, "format": "other/9"}, "format 'other/9'")
    refused({**good, "leaves": ["x", "nope", None]}, "do not match the engine")
    refused({**good, "leaves": good["leaves"][:1]}, "inputs for a call of")
    refused({**good, "constants": [{"__class__": "os.system"}, None, 2.0]}, "plain values")
    refused({**good, "in_spec": '[1, {"type": "no.such.Type"}]'}, "input/output structure")
    with pytest.raises(ModelLoadError, match=r"no module.json"):
        tkt.load(tmp_path / "elsewhere")


def test_a_program_exported_already_is_taken_with_its_dynamic_dimensions():
    m = _convnet().eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    program = torch.export.export(
        m,
        _batch(2),
        {"scale": 2.0},
        dynamic_shapes={"x": {0: batch}, "y": {0: batch}, "scale": None},
    )
    fast = tkt.compile(program, _batch(4), example_kwargs={"scale": 2.0}, backend="cpu")
    assert fast.engine.profiles[0].shapes["x"] == ((1, 3, 12, 12), (4, 3, 12, 12), (16, 3, 12, 12))
    for n in (1, 16):
        x, y = _batch(n)
        got, want = fast(x, y, scale=2.0), m(x, y, scale=2.0)
        for k in want:
            torch.testing.assert_close(got[k], want[k].detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(InputError, match="carries its own dynamic dimensions"):
        tkt.compile(program, _batch(4), example_kwargs={"scale": 2.0}, dynamic_shapes={})


@torch.library.custom_op("tensorkiln_test::repeat_rows", mutates_args=())
def repeat_rows(x: torch.Tensor, n: int = 2, scale: float = 1.0) -> torch.Tensor:
    return x.repeat(n, 1) * scale


@repeat_rows.register_fake
def _(x, n=2, scale=1.0):
    return x.new_empty((x.shape[0] * n, x.shape[1]))


class Repeats(torch.nn.Module):
    """A custom op whose output size follows a dynamic dimension, twice, between supported ops."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(repeat_rows(self.a(x), 3, 0.5))
        return h.sum(0, keepdim=True) + repeat_rows(x).mean()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_op_without_a_translation_runs_in_pytorch_inside_one_engine(tmp_path, backend):
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    m = Repeats().eval()
    batch = torch.export.Dim("batch", min=1, max=8)
    with pytest.warns(UserWarning, match=r"runs tensorkiln_test::repeat_rows in PyTorch"):
        fast = tkt.compile(m, (torch.randn(2, 4),), dynamic_shapes=({0: batch},), backend=backend)
    assert isinstance(fast, tkt.CompiledModule)
    assert fast.torch_ops == ["tensorkiln_test::repeat_rows"]
    assert [n.op for n in fast.engine.graph.nodes].count("repeat_rows") == 2
    for n in (1, 5, 8):
        x = torch.randn(n, 4)
        torch.testing.assert_close(fast(x), m(x).detach(), rtol=1e-5, atol=1e-5)
    tkt.save(fast, tmp_path / "m")
    x = torch.randn(3, 4)
    torch.testing.assert_close(tkt.load(tmp_path / "m")(x), m(x).detach(), rtol=1e-5, atol=1e-5)


def test_a_fresh_process_loads_it_once_the_op_is_defined(tmp_path):
    """The saved engine names the op, never holds it: a process that defines the op loads and
    runs it; one that does not is told which op to define."""
    m = Repeats().eval()
    with pytest.warns(UserWarning):
        fast = tkt.compile(m, (torch.randn(2, 4),), backend="cpu")
    tkt.save(fast, tmp_path / "m")
    (tmp_path / "defs.py").write_text(
        "import torch\n"
        "@torch.library.custom_op('tensorkiln_test::repeat_rows', mutates_args=())\n"
        "def repeat_rows(x: torch.Tensor, n: int = 2, scale: float = 1.0) -> torch.Tensor:\n"
        "    return x.repeat(n, 1) * scale\n"
        "@repeat_rows.register_fake\n"
        "def _(x, n=2, scale=1.0):\n"
        "    return x.new_empty((x.shape[0] * n, x.shape[1]))\n"
    )
    x = torch.randn(2, 4)
    np.save(tmp_path / "x.npy", x.numpy())
    load = (
        "import json, sys, numpy, torch\nimport tensorkiln.torch as tkt\n"
        "from tensorkiln.errors import EngineCompatibilityError\n"
        "if sys.argv[1] == 'define':\n    sys.path.insert(0, sys.argv[2]); import defs\n"
        "try:\n    fast = tkt.load(sys.argv[2] + '/m')\n"
        "except EngineCompatibilityError as e:\n    print(e); sys.exit(3)\n"
        "y = fast(torch.from_numpy(numpy.load(sys.argv[2] + '/x.npy')))\n"
        "print(json.dumps(y.tolist()))\n"
    )
    run = [sys.executable, "-c", load]
    without = subprocess.run([*run, "bare", str(tmp_path)], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert without.returncode == 3, without.stderr[-2000:]
    assert "tensorkiln_test::repeat_rows" in without.stdout and "torch.library" in without.stdout
    defined = subprocess.run([*run, "define", str(tmp_path)], capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert defined.returncode == 0, defined.stderr[-2000:]
    got = torch.tensor(json.loads(defined.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(got, m(x).detach(), rtol=1e-5, atol=1e-5)


def test_int8_from_calibration_batches_shaped_like_the_example():
    """precision='int8' with calibration batches given as the module takes them: the engine's
    convolutions and GEMMs are quantized, and its outputs stay near eager fp32."""
    torch.manual_seed(np.random.default_rng().integers(1 << 31))
    m = _convnet().eval()
    batches = [(torch.randn(4, 3, 12, 12), torch.randn(4, 4)) for _ in range(8)]
    # min-max ranges: what is tested is how the data is given. The default entropy calibrator
    # clips some seeds' ranges from 32 samples; measured over 25 seeds, the worst error is 0.33
    # with entropy and 0.0043 with min-max.
    config = BuilderConfig(calibrator="minmax")
    fast = tkt.compile(
        m, _batch(4), example_kwargs={"scale": 2.0}, precision="int8", backend="reference",
        calibration_data=batches, config=config,
    )  # fmt: skip
    ops = [n.op for n in fast.engine.graph.nodes]
    assert any(op.startswith("Q") for op in ops), ops  # (QConvAct / QGemmAct)
    as_keywords = tkt.compile(
        m, _batch(4), example_kwargs={"scale": 2.0}, precision="int8", backend="reference",
        calibration_data=[{"x": x, "y": y} for x, y in batches], config=config,
    )  # fmt: skip
    x, y = _batch(4)
    want = m(x, y, scale=2.0)
    for compiled in (fast, as_keywords):
        got = compiled(x, y, scale=2.0)
        for k in want:
            w = want[k].detach()
            assert float((got[k] - w).norm() / w.norm()) < 0.05, k
    # the same calibration data, however it was given: the same engine's outputs
    torch.testing.assert_close(
        as_keywords(x, y, scale=2.0)["logits"], fast(x, y, scale=2.0)["logits"]
    )


def test_an_fp16_module_on_the_cuda_kernels_keeps_its_types():
    """A half-precision module built for the cuda backend (its kernels on torch CPU tensors
    here): fp16 in and out as PyTorch has them, close to the fp32 module."""
    m = _tiny_bert()
    m16 = copy.deepcopy(m).half()
    ids = torch.randint(0, 500, (2, 16))
    mask = torch.ones(2, 16, dtype=torch.int64)
    mask[1, 9:] = 0
    fast = tkt.compile(m16, (), example_kwargs={"input_ids": ids, "attention_mask": mask},
                       precision="fp16", backend="cuda")  # fmt: skip
    assert fast.engine.backend == "cuda"
    got = fast(input_ids=ids, attention_mask=mask).last_hidden_state
    want = m(input_ids=ids, attention_mask=mask).last_hidden_state.detach()
    assert got.dtype == torch.float16
    assert float((got.float() - want).norm() / want.norm()) < 5e-3


def test_a_config_given_is_left_as_it_was_for_the_next_compile():
    config = BuilderConfig(optimization_level=2)
    m = _convnet().eval()
    for _ in range(2):  # (a second compile must not find the first's profile and formats)
        fast = _compile_convnet(m, "reference", config=config)
        assert len(fast.engine.profiles) == 1
    assert config.profiles == [] and config.precisions == {"fp32"}
    assert config.input_io_formats == [] and config.output_io_formats == []
    x, y = _batch(3)
    got, want = fast(x, y, scale=2.0), m(x, y, scale=2.0)
    torch.testing.assert_close(got["logits"], want["logits"].detach(), rtol=1e-5, atol=1e-5)


def test_a_float64_input_is_taken_as_it_is():
    class Scaled(torch.nn.Module):
        def forward(self, x, scale):
            return torch.relu(x) * scale.float()

    fast = tkt.compile(Scaled(), (torch.randn(3, 4), torch.rand(4, dtype=torch.float64)))
    x, scale = torch.randn(3, 4), torch.rand(4, dtype=torch.float64) + 0.5
    torch.testing.assert_close(fast(x, scale), Scaled()(x, scale))

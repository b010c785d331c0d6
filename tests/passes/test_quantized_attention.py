"""quantize_in_attention: a fused Attention whose output a QuantizeLinear alone reads (the
attention output projection's input in a quantized BERT) writes the quantized tensor itself.

Oracle: the same build without the rewrite, whose QuantizeLinear quantizes the attention's
float output: the fused engine must give the same outputs bit for bit, on the reference backend
and on the cuda backend's kernels (on CPU tensors here), INT8 and FP8.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from tensorkiln.builder import Builder, BuilderConfig
from tensorkiln.engine import Engine
from tensorkiln.ir import DType
from tensorkiln.passes import fuse_qdq
from tensorkiln.passes.remove_padding import _check_attention, _Skip
from tensorkiln.precision import quantize
from tests.models.test_architectures import build_bert, token_feeds
from tests.passes.test_remove_padding import _export

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A 2-layer BERT (hidden 128, 4 heads), exported with a dynamic batch."""
    model, feeds = build_bert()
    path = tmp_path_factory.mktemp("bert") / "bert.onnx"
    return _export(model, feeds, path, ["hidden", "pooled"])


def _feeds(rng: np.random.Generator, batch: int) -> dict:
    """Random tokens; the last sequence right-padded, and one more at a random length."""
    feeds = token_feeds(batch, 16, 1000)
    feeds["input_ids"] = rng.integers(0, 1000, (batch, 16)).astype(np.int64)
    feeds["attention_mask"][0, rng.integers(4, 12) :] = 0
    return feeds


def _build(path, backend: str, precision: str, monkeypatch, fuse: bool, calib: list,
           device: str = "cpu"):  # fmt: skip
    rules = fuse_qdq.REQUANTIZE
    if not fuse:
        rules = tuple(r for r in rules if r.name != "quantize_in_attention")
    monkeypatch.setattr(quantize, "REQUANTIZE", rules)
    config = BuilderConfig()
    config.set_flag(precision)
    if backend == "cuda":
        config.set_flag("fp16")
        if device == "cpu":  # (default kernels: two tuned builds may pick others elsewhere)
            config.tactic_sources = []
    config.calibration_data = calib
    config.choose_precision_per_layer = False
    builder = Builder(backend, device=device) if backend == "cuda" else Builder(backend)
    return builder.build(path, config, progress=False), builder.last_report


@pytest.mark.parametrize("backend", ["reference", "cuda"])
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_the_attention_writes_its_output_quantized(tmp_path, bert, monkeypatch, backend, precision):
    rng = np.random.default_rng()
    calib = [_feeds(rng, 3) for _ in range(2)]
    fused, report = _build(bert, backend, precision, monkeypatch, True, calib)
    plain, _ = _build(bert, backend, precision, monkeypatch, False, calib)
    attentions = [n for n in fused.graph.nodes if n.op == "Attention"]
    code = DType.INT8 if precision == "int8" else DType.FLOAT8E4M3FN
    assert len(attentions) == 2 and all(n.attrs.get("q_dtype") == code for n in attentions)
    assert all(n.outputs[0].dtype == code for n in attentions)
    # (the scale stays float32 under the fp16 lowering, as QuantizeLinear's does)
    assert all(n.inputs[4].dtype == DType.FLOAT for n in attentions)
    assert any("2 attentions write their output quantized" in n for n in report.notes)

    def count(engine):
        return [n.op for n in engine.graph.nodes].count("QuantizeLinear")

    assert count(fused) == count(plain) - 2
    saved = tmp_path / "bert.engine"
    fused.save(saved)
    fused = Engine.load(saved)  # (Y_scale and q_dtype survive the file)
    assert all(n.attrs.get("q_dtype") for n in fused.graph.nodes if n.op == "Attention")
    feeds = _feeds(rng, 4)
    got = fused.create_execution_context().infer(feeds)
    want = plain.create_execution_context().infer(feeds)
    for name in ("hidden", "pooled"):
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]))


def test_padding_removal_leaves_a_quantized_attention_alone(tmp_path, bert, monkeypatch) -> None:
    """PackedAttention writes float only: an attention writing its output quantized (an
    explicitly quantized model's, fused before padding removal runs) is named, not packed."""
    calib = [_feeds(np.random.default_rng(), 2)]
    fused, _ = _build(bert, "reference", "int8", monkeypatch, True, calib)
    node = next(n for n in fused.graph.nodes if n.op == "Attention")
    with pytest.raises(_Skip, match="writes its output quantized"):
        _check_attention(node)


def test_a_quantized_output_needs_its_scale() -> None:
    """The op's own checks: a q_dtype without Y_scale, or of another type, is a clear error."""
    from tensorkiln.kernels.reference.fused_attention import fused_attention

    rng = np.random.default_rng()
    q, k, v = (rng.standard_normal((1, 2, 4, 8)).astype(np.float32) for _ in range(3))
    with pytest.raises(ValueError, match=r"Attention: a quantized output .* needs the Y_scale"):
        fused_attention(q, k, v, q_dtype=3)
    with pytest.raises(ValueError, match="Attention: q_dtype 1 is not int8"):
        fused_attention(q, k, v, None, np.float32(0.1), q_dtype=1)
    y = fused_attention(q, k, v, None, np.float32(0.01), q_dtype=3)
    want = np.clip(np.rint(fused_attention(q, k, v) / np.float32(0.01)), -128, 127)
    assert y.dtype == np.int8
    np.testing.assert_array_equal(y, want.astype(np.int8))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_on_the_gpu_the_flash_kernel_writes_the_quantized_output(bert, monkeypatch, precision):
    """Built and tuned on the GPU, where the Triton flash tactics compete: every attention
    writes its output quantized, and the engine agrees with the build without the rewrite (whose
    other layers may have tuned to other kernels: within one quantization step's effect)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    rng = np.random.default_rng()
    calib = [_feeds(rng, 3) for _ in range(2)]
    fused, report = _build(bert, "cuda", precision, monkeypatch, True, calib, device="cuda")
    plain, _ = _build(bert, "cuda", precision, monkeypatch, False, calib, device="cuda")
    attentions = [x for x in report.layers if x["op"] == "tensorkiln.Attention"]
    assert len(attentions) == 2 and all(x.get("rejected") is None for x in attentions), attentions
    assert all(n.attrs.get("q_dtype") for n in fused.graph.nodes if n.op == "Attention")
    feeds = _feeds(rng, 4)
    got = fused.create_execution_context().infer(feeds)
    want = plain.create_execution_context().infer(feeds)
    for name in ("hidden", "pooled"):
        g, w = (np.asarray(x[name], np.float32) for x in (got, want))
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 2e-2, name

"""Padding removal on a real GPU: fp16 BERT and GPT-2 engines with --remove-padding, run as CUDA graphs on
device tensors, against onnxruntime (fp32) at the kept positions, for masks of different token
counts (one graph per packed length, counts rounded up: 96 tokens here, so the counts of 3 and 9
pads share one graph and its padding rows) and for a mask with the same count at other positions
(the same graph, indices recomputed on the device).

Run on a GPU machine:  PYTHONPATH=src python3 -m pytest -q -m gpu tests
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile  # noqa: E402
from tests.models.test_architectures import build_bert, build_gpt2, run_onnxruntime  # noqa: E402
from tests.passes.test_remove_padding import SEQ, _export  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")]


def _engine(path, packed: bool, batch: int):
    config = BuilderConfig()
    config.set_flag("fp16")
    config.remove_padding = packed
    profile = OptimizationProfile()
    for name in ("input_ids", "attention_mask"):
        profile.set_shape(name, (1, SEQ), (batch, SEQ), (batch, SEQ))
    config.add_optimization_profile(profile)
    builder = Builder("cuda")
    return builder.build(path, config, progress=False), builder.last_report


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_packed_engines_cuda_graphs_agree_with_onnxruntime(tmp_path, family: str) -> None:
    """BERT's key-padding mask, and GPT-2's causal one (each packed attention causal)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, feeds = build_bert() if family == "bert" else build_gpt2()
    outputs = ["hidden", "pooled"] if family == "bert" else ["hidden"]
    path = _export(model, feeds, tmp_path / f"{family}.onnx", outputs)
    batch = 6
    engine, report = _engine(path, True, batch)
    assert report.passes.get("remove_padding", 0) > 0, report.notes
    plain, _ = _engine(path, False, batch)
    ctx = engine.create_execution_context(use_cuda_graph=True)
    ref_ctx = plain.create_execution_context(use_cuda_graph=True)
    rng = np.random.default_rng()
    masks = []
    for n_pad in (3, 3, 0, 9):  # the second: the same count as the first, other positions
        m = np.ones((batch, SEQ), np.int64)
        rows = rng.integers(0, batch, n_pad)
        cols = rng.integers(1, SEQ, n_pad)
        m[rows, cols] = 0
        masks.append(m)
    for m in masks:
        ids = rng.integers(0, 1000, m.shape)
        want = run_onnxruntime(path, {"input_ids": ids, "attention_mask": m})[0]
        dev = {
            "input_ids": torch.from_numpy(ids).cuda(),
            "attention_mask": torch.from_numpy(m).cuda(),
        }
        got = ctx.infer(dev)["hidden"].float().cpu().numpy()
        plain_out = ref_ctx.infer(dev)["hidden"].float().cpu().numpy()
        keep = m != 0
        scale = np.abs(want[keep]).max()
        np.testing.assert_allclose(got[keep], want[keep], rtol=2e-2, atol=2e-2 * scale)
        assert not got[~keep].any()
        # as close to fp32 as the engine without padding removal
        err = np.linalg.norm(got[keep] - want[keep]) / np.linalg.norm(want[keep])
        err_plain = np.linalg.norm(plain_out[keep] - want[keep]) / np.linalg.norm(want[keep])
        assert err <= 2 * err_plain + 1e-3, (err, err_plain)
    # the mask as a host array (a tokenizer's): counted on the host, the same graphs replayed
    m = masks[0]
    ids = torch.from_numpy(rng.integers(0, 1000, m.shape)).cuda()
    on_device = ctx.infer({"input_ids": ids, "attention_mask": torch.from_numpy(m).cuda()})
    on_host = ctx.infer({"input_ids": ids, "attention_mask": m})
    a, b = (x["hidden"].float().cpu().numpy() for x in (on_device, on_host))
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-3 * np.abs(a).max())
    assert ctx.cuda_graph_fallback is None

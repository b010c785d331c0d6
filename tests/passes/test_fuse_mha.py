"""batch_first_attention on real exports of torch.nn.MultiheadAttention(batch_first=True).

Blocks written as torchvision's ViT writes them (pre-norm, MHA, MLP) are exported by the
TorchScript exporter, with a fixed and with a dynamic batch axis, with and without a key padding
mask; the pass must turn every attention's sequence-first shuffle into Split views and a "bsd"
attention, and engines built from the models must agree with onnxruntime on fresh inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

import tensorkiln  # noqa: E402
from tensorkiln.builder import Builder, BuilderConfig  # noqa: E402
from tensorkiln.passes import PassManager  # noqa: E402
from tests.models.test_architectures import _no_mha_fastpath, run_onnxruntime  # noqa: E402
from tests.passes.util import assert_pass_preserves_outputs  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
E, HEADS, SEQ, LAYERS = 32, 4, 7, 2


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(E)
        self.attn = torch.nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.ln_2 = torch.nn.LayerNorm(E)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(E, 2 * E), torch.nn.GELU(), torch.nn.Linear(2 * E, E)
        )

    def forward(self, x, pad=None):
        y = self.ln_1(x)
        y, _ = self.attn(y, y, y, key_padding_mask=pad, need_weights=False)
        x = x + y
        return x + self.mlp(self.ln_2(x))


class _Encoder(torch.nn.Module):
    def __init__(self, masked: bool) -> None:
        super().__init__()
        self.masked = masked
        self.blocks = torch.nn.ModuleList(_Block() for _ in range(LAYERS))

    def forward(self, x, *mask):
        pad = mask[0] if self.masked else None
        for block in self.blocks:
            x = block(x, pad)
        return x


def _export(tmp_path, masked: bool, dynamic: bool, batch: int = 3):
    torch.manual_seed(0)
    model = _Encoder(masked).eval()
    with torch.no_grad():  # biases and norm parameters as a trained model has them
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    rng = np.random.default_rng()
    feeds = {"x": rng.standard_normal((batch, SEQ, E)).astype(np.float32)}
    if masked:
        pad = np.zeros((batch, SEQ), bool)
        pad[:, -2:] = True  # the last two keys of every sequence are padding
        feeds["pad"] = pad
    path = tmp_path / "mha.onnx"
    axes = {k: {0: "N"} for k in (*feeds, "y")} if dynamic else None
    with torch.no_grad(), _no_mha_fastpath():  # (as an exporter of a traced model sees it)
        torch.onnx.export(
            model, tuple(torch.from_numpy(v) for v in feeds.values()), str(path),
            input_names=list(feeds), output_names=["y"], dynamic_axes=axes, opset_version=17,
            dynamo=False,
        )  # fmt: skip
    return path, feeds


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic-batch"])
@pytest.mark.parametrize("masked", [False, True], ids=["no-mask", "key-padding-mask"])
def test_every_attention_becomes_batch_first(tmp_path, masked, dynamic):
    path, feeds = _export(tmp_path, masked, dynamic)
    graph = tensorkiln.import_onnx(str(path))
    after = assert_pass_preserves_outputs(
        graph, PassManager(level=3, verify=True).run, feeds, rtol=1e-5, atol=1e-5
    )
    attention = [n for n in after.nodes if n.op == "Attention"]
    assert len(attention) == LAYERS
    assert all(n.attrs["input_layout"] == "bsd" for n in attention)
    assert all(n.attrs["num_heads"] == HEADS for n in attention)
    # the sequence-first shuffle is gone: no Transpose or Squeeze is left in the blocks
    assert not [n for n in after.nodes if n.op in ("Transpose", "Squeeze", "Unsqueeze")]


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_engines_agree_with_onnxruntime(tmp_path, backend):
    path, feeds = _export(tmp_path, masked=True, dynamic=True, batch=2)
    want = run_onnxruntime(path, feeds)[0]
    kwargs = {"device": "cpu"} if backend == "cuda" else {}
    engine = Builder(backend, **kwargs).build(str(path), BuilderConfig(), progress=False)
    assert sum(layer["op"] == "tensorkiln.Attention" for layer in engine.layers) == LAYERS
    assert len(engine.layers) <= LAYERS * 8 + 8  # (+ the key padding mask, made once)
    rng = np.random.default_rng()
    for batch in (2, 5):  # the dynamic batch axis, at another size too
        x = rng.standard_normal((batch, SEQ, E)).astype(np.float32)
        pad = np.zeros((batch, SEQ), bool)
        pad[:, -3:] = True
        got = engine.create_execution_context().infer({"x": x, "pad": pad})["y"]
        want = run_onnxruntime(path, {"x": x, "pad": pad})[0]
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)

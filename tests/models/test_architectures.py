"""Real architectures, exported by both torch exporters, run by tensorkiln and onnxruntime.

ResNet-50 (full size, written here: torchvision is not a dependency), BERT and GPT-2 (transformers,
small configs that keep the real structure, random weights) and a small nn.TransformerEncoder.
Each is exported with the TorchScript exporter (dynamo=False, opset 17) and the torch.export-based
one (dynamo=True, its default opset), into a temporary folder and loaded by path so that external
data next to the model is found. onnxruntime is the independent oracle; both run the same inputs.

The model builders and helpers are also used by benchmarks/reference_cpu.py (full-size configs).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

import tensorkiln

torch = pytest.importorskip("torch")
nn = torch.nn

os.environ["HF_HUB_OFFLINE"] = "1"

# Outputs must agree within RTOL relative, plus an absolute floor of RTOL times the largest
# reference magnitude (float32 sums of hundreds of terms differ by a few ulps of the scale).
RTOL = 1e-4
SEED = 20240601

Feeds = dict[str, np.ndarray]


# ---------------------------------------------------------------- ResNet-50, written by hand


class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: 1x1 reduce, 3x3 (carries the stride), 1x1 expand, residual add."""

    expansion = 4

    def __init__(self, in_channels: int, width: int, stride: int) -> None:
        super().__init__()
        out_channels = width * self.expansion
        self.conv1 = nn.Conv2d(in_channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, out_channels, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out_channels)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


def resnet50(num_classes: int = 1000) -> nn.Module:
    """ResNet-50: stem, bottleneck stages [3, 4, 6, 3], global average pool, linear classifier."""
    layers: list[nn.Module] = [
        nn.Conv2d(3, 64, 7, 2, 3, bias=False),
        nn.BatchNorm2d(64),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, 2, 1),
    ]
    in_channels = 64
    for width, blocks, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
        for i in range(blocks):
            layers.append(Bottleneck(in_channels, width, stride if i == 0 else 1))
            in_channels = width * Bottleneck.expansion
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    model = nn.Sequential(*layers)
    _randomize(model)
    return model


def _randomize(model: nn.Module) -> None:
    """torchvision's conv init, and BatchNorm statistics that are not the identity.

    The TorchScript exporter folds eval-mode BatchNorm into the convolutions; random running
    statistics make sure the folded weights are really exercised.
    """
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.0, generator=gen)
                m.bias.normal_(0.0, 0.1, generator=gen)
                m.running_mean.normal_(0.0, 0.1, generator=gen)
                m.running_var.uniform_(0.5, 1.5, generator=gen)


# ---------------------------------------------------------------- transformers and nn models


class BertEncoder(nn.Module):
    """BertModel with plain tensor outputs: (last_hidden_state, pooler_output)."""

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import BertModel

        self.model = BertModel(config)

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)
        return out[0], out[1]


class GPT2Decoder(nn.Module):
    """GPT2Model without the KV cache; returns last_hidden_state.

    The attention mask is an input: without it, transformers 5 looks for packed sequences with
    torch.diff, which the TorchScript exporter cannot export (aten::diff, opset 17).
    """

    def __init__(self, config) -> None:
        super().__init__()
        from transformers import GPT2Model

        self.model = GPT2Model(config)

    def forward(self, input_ids, attention_mask):
        out = self.model(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False, return_dict=False
        )
        return out[0]


def token_feeds(batch: int, seq: int, vocab: int) -> Feeds:
    """Random token ids and a mask whose last row is right-padded (exercises the masking)."""
    rng = np.random.default_rng(SEED)
    mask = np.ones((batch, seq), np.int64)
    if batch > 1:
        mask[-1, seq * 2 // 3 :] = 0
    return {
        "input_ids": rng.integers(0, vocab, (batch, seq)).astype(np.int64),
        "attention_mask": mask,
    }


def build_resnet50(full: bool = True) -> tuple[nn.Module, Feeds]:
    """Always full size (batch 1, 224x224): ResNet-50 is quick enough on the CPU."""
    rng = np.random.default_rng(SEED)
    x = rng.standard_normal((1, 3, 224, 224)).astype(np.float32)
    return resnet50().eval(), {"input": x}


def build_bert(full: bool = False) -> tuple[nn.Module, Feeds]:
    from transformers import BertConfig

    if full:  # bert-base: 12 layers, hidden 768, 12 heads, vocab 30522
        config, batch, seq = BertConfig(), 1, 128
    else:
        config = BertConfig(
            vocab_size=1000,
            hidden_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=512,
            max_position_embeddings=64,
        )
        batch, seq = 2, 16
    torch.manual_seed(0)
    return BertEncoder(config).eval(), token_feeds(batch, seq, config.vocab_size)


def build_gpt2(full: bool = False) -> tuple[nn.Module, Feeds]:
    from transformers import GPT2Config

    if full:  # gpt2 (124M): 12 layers, hidden 768, 12 heads, vocab 50257
        config, batch, seq = GPT2Config(), 1, 128
    else:
        config = GPT2Config(
            vocab_size=1000,
            n_embd=128,
            n_layer=2,
            n_head=4,
            n_positions=64,
            bos_token_id=0,
            eos_token_id=0,
        )
        batch, seq = 2, 16
    torch.manual_seed(0)
    return GPT2Decoder(config).eval(), token_feeds(batch, seq, config.vocab_size)


def build_transformer_encoder(full: bool = False) -> tuple[nn.Module, Feeds]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.0, batch_first=True
    )
    model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False).eval()
    rng = np.random.default_rng(SEED)
    return model, {"src": rng.standard_normal((2, 16, 64)).astype(np.float32)}


BUILDERS: dict[str, Callable[..., tuple[nn.Module, Feeds]]] = {
    "resnet50": build_resnet50,
    "bert": build_bert,
    "gpt2": build_gpt2,
    "transformer_encoder": build_transformer_encoder,
}


# ---------------------------------------------------------------- export and compare


@contextlib.contextmanager
def _no_mha_fastpath() -> Iterator[None]:
    """Eval-mode nn.TransformerEncoderLayer takes a fused fast path (aten::_transformer_encoder_
    layer_fwd) that the TorchScript exporter cannot export; the decomposed path is equivalent."""
    enabled = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(enabled)


def export(
    model: nn.Module, feeds: Feeds, folder: Path, *, dynamo: bool, opset: int | None = None
) -> Path:
    """Export ``model`` to ``folder``/model.onnx (dynamo may add model.onnx.data next to it).

    ``opset`` defaults to 17 for the TorchScript exporter and to the dynamo exporter's default.
    """
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    options: dict = {"dynamo": dynamo, "opset_version": opset or (None if dynamo else 17)}
    with warnings.catch_warnings(), _no_mha_fastpath(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), input_names=list(feeds), verbose=False, **options)
    return path


def run_onnxruntime(path: Path, feeds: Feeds, threads: int = 0) -> list[np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return session.run(None, {n: feeds[n] for n in names})


def run_tensorkiln(path: Path, feeds: Feeds) -> list[np.ndarray]:
    with tensorkiln.Runner(path) as runner:
        outputs = runner.infer({n: feeds[n] for n in runner.input_names})
        return [outputs[n] for n in runner.output_names]


def max_rel_diff(got: list[np.ndarray], expected: list[np.ndarray]) -> float:
    """Largest |got - expected| over all outputs, relative to that output's largest |expected|."""
    return max(
        float(np.abs(g.astype(np.float64) - e).max() / max(np.abs(e).max(), 1e-30))
        for g, e in zip(got, expected)
    )


def assert_agree(got: list[np.ndarray], expected: list[np.ndarray]) -> None:
    assert len(got) == len(expected), f"{len(got)} outputs, onnxruntime has {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.shape == e.shape, f"output {i}: shape {g.shape}, onnxruntime {e.shape}"
        assert g.dtype == e.dtype, f"output {i}: dtype {g.dtype}, onnxruntime {e.dtype}"
        atol = RTOL * float(np.abs(e).max())
        np.testing.assert_allclose(g, e, rtol=RTOL, atol=atol, err_msg=f"output {i}")


# ---------------------------------------------------------------- tests


@functools.cache
def _small(name: str) -> tuple[nn.Module, Feeds]:
    return BUILDERS[name](full=False)


# dynamo-opset23: from opset 23 the dynamo exporter writes scaled dot-product attention as one
# ONNX Attention node (with the padding or causal mask as its attn_mask).
CASES = [
    pytest.param("resnet50", "torchscript", id="resnet50-torchscript", marks=pytest.mark.slow),
    pytest.param("resnet50", "dynamo", id="resnet50-dynamo", marks=pytest.mark.slow),
    pytest.param("bert", "torchscript", id="bert-torchscript"),
    pytest.param("bert", "dynamo", id="bert-dynamo"),
    pytest.param("bert", "dynamo-opset23", id="bert-dynamo-opset23"),
    pytest.param("gpt2", "torchscript", id="gpt2-torchscript"),
    pytest.param("gpt2", "dynamo", id="gpt2-dynamo"),
    pytest.param("gpt2", "dynamo-opset23", id="gpt2-dynamo-opset23"),
    pytest.param("transformer_encoder", "torchscript", id="transformer_encoder-torchscript"),
    pytest.param("transformer_encoder", "dynamo", id="transformer_encoder-dynamo"),
    pytest.param("transformer_encoder", "dynamo-opset23", id="transformer_encoder-dynamo-opset23"),
]


@pytest.mark.parametrize(("name", "exporter"), CASES)
def test_architecture_matches_onnxruntime(name: str, exporter: str, tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    if name in ("bert", "gpt2"):
        pytest.importorskip("transformers")
    dynamo = exporter.startswith("dynamo")
    if dynamo:
        pytest.importorskip("onnxscript")
    model, feeds = _small(name)
    opset = 23 if exporter == "dynamo-opset23" else None
    path = export(model, feeds, tmp_path, dynamo=dynamo, opset=opset)
    expected = run_onnxruntime(path, feeds)
    got = run_tensorkiln(path, feeds)
    assert_agree(got, expected)

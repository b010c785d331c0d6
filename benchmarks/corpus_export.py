"""Architectures of the corpus benchmark, exported to ONNX with random weights.

torchvision, timm and transformers models (small configs where a full size would be slow on the
numpy reference backend), each exported with the TorchScript exporter at opsets 13 and 17 and
with the torch.export-based one at its default opset, with a dynamic batch axis where the
exporter manages one. Each export is a folder: model.onnx (dynamo may add external data beside
it), inputs.npz (the sample inputs the check runs) and meta.json (what it is). A package that
does not import here (torchvision and timm need a torch of their own) is skipped, and said so.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tests.models.test_architectures import _no_mha_fastpath, token_feeds

nn = torch.nn
Feeds = dict[str, np.ndarray]
# (tag, dynamo, opset): opset None is the dynamo exporter's default
EXPORTERS = (("ts13", False, 13), ("ts17", False, 17), ("dynamo", True, None))
SEED = 20261201


def _image(batch: int, size: int = 224) -> Feeds:
    rng = np.random.default_rng(SEED)
    return {"input": rng.standard_normal((batch, 3, size, size)).astype(np.float32)}


def _randomize_norms(model: nn.Module) -> nn.Module:
    """Random BatchNorm statistics and affine parameters (the defaults are the identity, which
    would leave the exporters' BatchNorm folding untested), and no all-zero weights: some
    libraries zero-initialize classifier heads or residual branches, and an all-zero output
    'agrees' with anything."""
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.normal_(0.0, 0.1, generator=gen)
                m.running_var.uniform_(0.5, 1.5, generator=gen)
            for p in m.parameters(recurse=False):
                if p.numel() > 0 and not p.any():
                    p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


class _FirstOutput(nn.Module):
    """A model whose outputs are plain tensors: dict/tuple outputs reduced to the tensors."""

    def __init__(self, model: nn.Module, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.keys = model, keys

    def forward(self, *args):
        out = self.model(*args)
        if isinstance(out, dict):
            return tuple(out[k] for k in self.keys)
        return out


# ---------------------------------------------------------------- torchvision and timm


def _torchvision(name: str, **kwargs) -> Callable[[], tuple[nn.Module, Feeds, int]]:
    def make() -> tuple[nn.Module, Feeds, int]:
        import torchvision

        torch.manual_seed(0)
        model = torchvision.models.get_model(name, weights=None, **kwargs)
        if name.startswith(("lraspp", "deeplab", "fcn")):  # segmentation: a dict of outputs
            model = _FirstOutput(model, ("out",))
        return _randomize_norms(model), _image(1), 0

    return make


def _timm(name: str) -> Callable[[], tuple[nn.Module, Feeds, int]]:
    def make() -> tuple[nn.Module, Feeds, int]:
        import timm

        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False)
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
        return _randomize_norms(model), _image(1, size), 0

    return make


# ---------------------------------------------------------------- transformers


class _HF(nn.Module):
    """A transformers model called with keyword inputs; returns its first output (and the
    pooler output where the model has one), as plain tensors."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *args):
        out = self.model(**dict(zip(self.names, args)), return_dict=True)
        keep = [out[0]]
        if getattr(out, "pooler_output", None) is not None:
            keep.append(out.pooler_output)
        return tuple(keep)


SMALL = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
VOCAB = 1000


def _text(config_name: str, model_name: str, **extra) -> Callable[[], tuple]:
    def make() -> tuple[nn.Module, Feeds, int]:
        import transformers

        config = getattr(transformers, config_name)(vocab_size=VOCAB, **{**SMALL, **extra})
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config)
        feeds = token_feeds(2, 16, VOCAB)
        return _randomize_norms(_HF(model, tuple(feeds))), feeds, VOCAB

    return make


def _gpt2() -> tuple[nn.Module, Feeds, int]:
    from transformers import GPT2Config, GPT2Model

    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    torch.manual_seed(0)
    return (
        _HF(GPT2Model(config), ("input_ids", "attention_mask")).eval(),
        token_feeds(2, 16, VOCAB),
        VOCAB,
    )


def _t5_encoder() -> tuple[nn.Module, Feeds, int]:
    from transformers import T5Config, T5EncoderModel

    config = T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
    torch.manual_seed(0)
    model = _HF(T5EncoderModel(config), ("input_ids", "attention_mask"))
    return model.eval(), token_feeds(2, 16, VOCAB), VOCAB


def _whisper_encoder() -> tuple[nn.Module, Feeds, int]:
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        d_model=64,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=128,
        num_mel_bins=80,
        max_source_positions=50,
    )
    torch.manual_seed(0)
    rng = np.random.default_rng(SEED)
    feeds = {"input_features": rng.standard_normal((2, 80, 100)).astype(np.float32)}
    return _HF(WhisperEncoder(config), tuple(feeds)).eval(), feeds, 0


def _wav2vec2() -> tuple[nn.Module, Feeds, int]:
    from transformers import Wav2Vec2Config, Wav2Vec2Model

    config = Wav2Vec2Config(
        **SMALL,
        conv_dim=(32, 32, 32),
        conv_stride=(5, 2, 2),
        conv_kernel=(10, 3, 3),
        num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4,
        do_stable_layer_norm=True,
        feat_extract_norm="layer",
    )
    torch.manual_seed(0)
    rng = np.random.default_rng(SEED)
    feeds = {"input_values": rng.standard_normal((2, 1600)).astype(np.float32)}
    return _HF(Wav2Vec2Model(config), tuple(feeds)).eval(), feeds, 0


def _vision(config_name: str, model_name: str, **extra) -> Callable[[], tuple]:
    def make() -> tuple[nn.Module, Feeds, int]:
        import transformers

        config = getattr(transformers, config_name)(**{**SMALL, **extra})
        torch.manual_seed(0)
        model = getattr(transformers, model_name)(config)
        rng = np.random.default_rng(SEED)
        size = extra.get("image_size", 32)
        feeds = {"pixel_values": rng.standard_normal((2, 3, size, size)).astype(np.float32)}
        return _HF(model, tuple(feeds)).eval(), feeds, 0

    return make


# name -> (package it needs, builder returning (model, sample feeds, token vocabulary or 0))
ARCHITECTURES: dict[str, tuple[str, Callable[[], tuple[nn.Module, Feeds, int]]]] = {
    "tv-resnet18": ("torchvision", _torchvision("resnet18")),
    "tv-mobilenet_v3_small": ("torchvision", _torchvision("mobilenet_v3_small")),
    "tv-efficientnet_b0": ("torchvision", _torchvision("efficientnet_b0")),
    "tv-convnext_tiny": ("torchvision", _torchvision("convnext_tiny")),
    "tv-regnet_y_400mf": ("torchvision", _torchvision("regnet_y_400mf")),
    "tv-shufflenet_v2_x1_0": ("torchvision", _torchvision("shufflenet_v2_x1_0")),
    "tv-squeezenet1_1": ("torchvision", _torchvision("squeezenet1_1")),
    "tv-densenet121": ("torchvision", _torchvision("densenet121")),
    "tv-mnasnet0_5": ("torchvision", _torchvision("mnasnet0_5")),
    "tv-vit_b_16": ("torchvision", _torchvision("vit_b_16")),
    "tv-swin_t": ("torchvision", _torchvision("swin_t")),
    "tv-lraspp_mobilenet_v3_large": (
        "torchvision",
        _torchvision("lraspp_mobilenet_v3_large", weights_backbone=None),
    ),
    "timm-deit_tiny_patch16_224": ("timm", _timm("deit_tiny_patch16_224")),
    "timm-convnextv2_atto": ("timm", _timm("convnextv2_atto")),
    "timm-efficientvit_m0": ("timm", _timm("efficientvit_m0")),
    "timm-mobilevitv2_050": ("timm", _timm("mobilevitv2_050")),
    "timm-ghostnet_100": ("timm", _timm("ghostnet_100")),
    "timm-levit_128s": ("timm", _timm("levit_128s")),
    "timm-regnetx_002": ("timm", _timm("regnetx_002")),
    "timm-rexnet_100": ("timm", _timm("rexnet_100")),
    "timm-fastvit_t8": ("timm", _timm("fastvit_t8")),
    "timm-tf_efficientnetv2_b0": ("timm", _timm("tf_efficientnetv2_b0")),
    "hf-bert": ("transformers", _text("BertConfig", "BertModel")),
    "hf-distilbert": (
        "transformers",
        _text("DistilBertConfig", "DistilBertModel", dim=64, n_layers=2, n_heads=4, hidden_dim=128),
    ),
    "hf-roberta": ("transformers", _text("RobertaConfig", "RobertaModel", pad_token_id=1)),
    "hf-albert": ("transformers", _text("AlbertConfig", "AlbertModel", embedding_size=32)),
    "hf-electra": ("transformers", _text("ElectraConfig", "ElectraModel", embedding_size=32)),
    "hf-gpt2": ("transformers", _gpt2),
    "hf-t5_encoder": ("transformers", _t5_encoder),
    "hf-whisper_encoder": ("transformers", _whisper_encoder),
    "hf-wav2vec2": ("transformers", _wav2vec2),
    "hf-vit": ("transformers", _vision("ViTConfig", "ViTModel", image_size=32, patch_size=8)),
    "hf-clip_vision": (
        "transformers",
        _vision("CLIPVisionConfig", "CLIPVisionModel", image_size=32, patch_size=8),
    ),
}


def importable(package: str) -> bool:
    try:
        __import__(package)
    except Exception:  # torchvision beside a torch it was not built for fails with anything
        return False
    return True


def _batch2(feeds: Feeds) -> Feeds:
    """Sample inputs with batch 2 for the dynamo exporter: it specializes a batch of 1."""
    return {k: np.concatenate([v, v[::-1] if v.ndim > 1 else v]) for k, v in feeds.items()}


def _torch_export(
    model: nn.Module, feeds: Feeds, path: Path, dynamo: bool, opset: int | None, dynamic: bool
) -> None:
    args = tuple(torch.from_numpy(x) for x in feeds.values())
    names = list(feeds)
    options: dict = {"dynamo": dynamo, "opset_version": opset, "input_names": names}
    if dynamic and dynamo:
        batch = torch.export.Dim("batch", min=1, max=64)
        # the models take *args: one positional tuple holding every input
        options["dynamic_shapes"] = (tuple({0: batch} for _ in names),)
    elif dynamic:
        options["dynamic_axes"] = {n: {0: "batch"} for n in names}
    with warnings.catch_warnings(), _no_mha_fastpath(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, str(path), verbose=False, **options)


def export_one(name: str, tag: str, out: Path) -> dict:
    """Export architecture ``name`` with exporter ``tag`` into ``out``/name-tag; returns meta.

    A dynamic batch axis is tried first and a static export is the fallback (meta says which).
    """
    package, make = ARCHITECTURES[name]
    _, dynamo, opset = next(e for e in EXPORTERS if e[0] == tag)
    model, feeds, vocab = make()
    if opset is not None and opset < 14:
        _eager_attention(model)
    folder = out / f"{name}-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    sample = _batch2(feeds) if dynamo and len(next(iter(feeds.values()))) == 1 else feeds
    try:
        _torch_export(model, sample, path, dynamo, opset, dynamic=True)
        dynamic = True
    except Exception:  # the export with a dynamic batch failed: a static one still counts
        for stale in folder.iterdir():
            stale.unlink()
        _torch_export(model, feeds, path, dynamo, opset, dynamic=False)
        dynamic = False
    np.savez(folder / "inputs.npz", **feeds)
    meta = {
        "source": package,
        "model": name,
        "exporter": "dynamo" if dynamo else "torchscript",
        "opset_requested": opset,
        "dynamic_batch": dynamic,
        "vocab": vocab,
        "versions": {package: _version(package), "torch": torch.__version__},
    }
    (folder / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def _eager_attention(model: nn.Module) -> None:
    """transformers' attention as matmul and softmax: scaled_dot_product_attention has no
    TorchScript export below opset 14."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = "eager"


def _version(package: str) -> str | None:
    try:
        return __import__(package).__version__
    except Exception:
        return None

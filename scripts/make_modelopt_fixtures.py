"""Writes the Q/DQ models of tests/passes/data/modelopt/: small networks with random weights,
quantized by NVIDIA Model Optimizer's ONNX post-training quantization (INT8 and FP8), exactly as
a user of it gets them. The tests check that tensorkiln runs each as onnxruntime's reference run
of the same model does; CI does not install Model Optimizer (its ONNX extra pulls in CUDA
packages), so its output is kept here, made by:

    python -m venv --system-site-packages /tmp/mo && /tmp/mo/bin/pip install --no-deps \\
        nvidia-modelopt onnx-graphsurgeon polygraphy onnxslim onnxconverter-common pulp \\
        omegaconf nvidia-ml-py lief cppimport
    /tmp/mo/bin/python scripts/make_modelopt_fixtures.py

(onnxruntime's CPU provider does the calibration; nothing needs a GPU.) It prints the Model
Optimizer version, recorded in the folder's README.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import torch

OUT = Path(__file__).resolve().parents[1] / "tests" / "passes" / "data" / "modelopt"


class _Block(torch.nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.c1 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.b1 = torch.nn.BatchNorm2d(c)
        self.c2 = torch.nn.Conv2d(c, c, 3, padding=1)
        self.b2 = torch.nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.b2(self.c2(torch.relu(self.b1(self.c1(x))))))


def convnet() -> torch.nn.Module:
    """A residual conv net: stem, two blocks, a strided convolution, a block, pool, classifier
    (16 and 32 channels: Model Optimizer's FP8 mode leaves narrower convolutions in float)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(
        torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(), _Block(16), _Block(16),
        torch.nn.MaxPool2d(2), torch.nn.Conv2d(16, 32, 3, stride=2, padding=1), torch.nn.ReLU(),
        _Block(32), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(32, 10),
    )  # fmt: skip
    for mod in m.modules():  # (statistics as a trained net's, so that BatchNorm folds to something)
        if isinstance(mod, torch.nn.BatchNorm2d):
            mod.running_mean.uniform_(-0.2, 0.2)
            mod.running_var.uniform_(0.5, 1.5)
    return m.eval()


class _Encoder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        from transformers import BertConfig, BertModel

        torch.manual_seed(0)
        config = BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, max_position_embeddings=16,
        )  # fmt: skip
        self.m = BertModel(config).eval()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.m(input_ids=input_ids, attention_mask=attention_mask, return_dict=False)[0]


def export(model: torch.nn.Module, args: tuple, names: list[str], path: Path) -> None:
    torch.onnx.export(
        model, args, str(path), opset_version=17, input_names=names, output_names=["y"],
        dynamo=False,
    )  # fmt: skip


def main() -> int:
    import modelopt
    from modelopt.onnx.quantization import quantize

    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        image = torch.from_numpy(rng.standard_normal((2, 3, 16, 16)).astype(np.float32))
        export(convnet(), (image,), ["x"], Path(tmp) / "convnet.onnx")
        ids = torch.from_numpy(rng.integers(0, 100, (2, 16)))
        mask = torch.ones(2, 16, dtype=torch.int64)
        mask[1, 12:] = 0
        export(_Encoder(), (ids, mask), ["input_ids", "attention_mask"], Path(tmp) / "encoder.onnx")
        calibration = {
            "convnet": rng.standard_normal((16, 3, 16, 16)).astype(np.float32),
            "encoder": {
                "input_ids": rng.integers(0, 100, (16, 16)).astype(np.int64),
                "attention_mask": np.ones((16, 16), np.int64),
            },
        }
        for name, data in calibration.items():
            for mode in ("int8", "fp8"):
                out = OUT / f"{name}_{mode}.onnx"
                quantize(
                    str(Path(tmp) / f"{name}.onnx"), quantize_mode=mode, calibration_data=data,
                    calibration_eps=["cpu"], output_path=str(out), high_precision_dtype="fp32",
                    calibration_shapes=None if name == "convnet" else
                    "input_ids:2x16,attention_mask:2x16",
                )  # fmt: skip
                counts: dict[str, int] = {}
                for node in onnx.load(str(out)).graph.node:
                    counts[node.op_type] = counts.get(node.op_type, 0) + 1
                print(out.name, out.stat().st_size, "bytes", dict(sorted(counts.items())))
    print("nvidia-modelopt", modelopt.__version__)
    return 0


if __name__ == "__main__":
    sys.exit(main())

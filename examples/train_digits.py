"""Train the small CNN bundled with the quick start, export it to ONNX, save the test split.

Needs torch and scikit-learn; the files it writes (digits_cnn.onnx, digits_test.npz) are
committed, so `python examples/digits.py` runs without either.

    python examples/train_digits.py
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

HERE = Path(__file__).resolve().parent
MODEL_PATH = HERE / "digits_cnn.onnx"
TEST_PATH = HERE / "digits_test.npz"


def make_model() -> nn.Module:
    """About 6k parameters: two 3x3 convolutions, one pool, one linear layer."""
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1),  # 8x8
        nn.ReLU(),
        nn.MaxPool2d(2),  # 4x4
        nn.Conv2d(8, 16, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 10),
    )


def load_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Digits images as float32 [n, 1, 8, 8] in [0, 1] (pixels are 0..16), labels int64."""
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[:, None, :, :]
    labels = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(
        images, labels, test_size=0.25, random_state=0
    )
    return x_train, x_test, y_train, y_test


def train(model: nn.Module, x: np.ndarray, y: np.ndarray, epochs: int = 15) -> None:
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    loss_fn = nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(0)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=gen).split(64):
            opt.zero_grad()
            loss_fn(model(xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()


def accuracy(model: nn.Module, x: np.ndarray, y: np.ndarray) -> float:
    with torch.no_grad():
        pred = model(torch.from_numpy(x)).argmax(1).numpy()
    return float((pred == y).mean())


def export(model: nn.Module, path: Path) -> None:
    torch.onnx.export(
        model,
        (torch.zeros(1, 1, 8, 8),),
        str(path),
        dynamo=False,
        opset_version=17,
        input_names=["input"],
        output_names=["logits"],
        dynamic_axes={"input": {0: "N"}, "logits": {0: "N"}},
    )


def main() -> None:
    # Tiny batches: one thread is faster than several fighting over them.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    x_train, x_test, y_train, y_test = load_split()
    model = make_model()
    start = time.perf_counter()
    train(model, x_train, y_train)
    n_params = sum(p.numel() for p in model.parameters())
    acc = accuracy(model, x_test, y_test)
    print(
        f"trained {n_params} parameters in {time.perf_counter() - start:.1f} s; "
        f"test accuracy {acc:.4f} on {len(y_test)} images"
    )
    export(model, MODEL_PATH)
    np.savez_compressed(TEST_PATH, images=x_test, labels=y_test)
    print(f"wrote {MODEL_PATH.name} and {TEST_PATH.name} in {HERE}")


if __name__ == "__main__":
    main()

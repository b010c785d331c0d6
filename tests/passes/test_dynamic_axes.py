"""Models exported with dynamic batch and sequence axes still fuse (shape simplification's job).

BERT and GPT-2 (small configs) exported by the TorchScript exporter with dynamic_axes compute
their reshape targets from Shape nodes at run time; after level 3 every attention block must be
one Attention op and every LayerNorm one LayerNorm, and outputs must equal the unoptimized graph's
at several batch sizes and sequence lengths.
"""

from __future__ import annotations

import collections
import warnings

import numpy as np
import pytest

import tensorkiln
from tensorkiln.builder import Builder
from tests.models import test_architectures as arch

torch = pytest.importorskip("torch")


def _export_dynamic(name: str, folder):
    model, feeds = arch.BUILDERS[name](full=False)
    path = folder / "model.onnx"
    axes = {k: {0: "N", 1: "S"} for k in feeds}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            tuple(torch.from_numpy(x) for x in feeds.values()),
            str(path),
            input_names=list(feeds),
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )
    return path


def token_feeds(n: int, s: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Fresh token ids (vocabulary 1000) for batch ``n`` and length ``s``, the last row's mask
    right-padded from the middle."""
    mask = np.ones((n, s), np.int64)
    mask[-1, s // 2 :] = 0
    return {"input_ids": rng.integers(0, 1000, (n, s)).astype(np.int64), "attention_mask": mask}


def assert_outputs_close(got: dict, want: dict) -> None:
    """Every output of ``want`` matched by ``got``'s to 1e-5, relative to its largest value."""
    for k in want:
        scale = float(np.abs(want[k]).max())
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-5 * scale, err_msg=k)


@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_dynamic_axes_models_fuse_attention_and_layernorm(name, tmp_path):
    path = _export_dynamic(name, tmp_path)
    plain = tensorkiln.Runner(path)
    assert [v.shape for v in plain.graph.inputs] == [("N", "S")] * 2
    engine = Builder().build(path)
    ops = collections.Counter(f"{n.domain}.{n.op}" for n in engine.graph.nodes)
    # the small configs have 2 layers: 2 attention blocks, 2 LayerNorms each plus one more
    assert ops["tensorkiln.Attention"] == 2
    assert ops["tensorkiln.LayerNorm"] == 5
    assert ops[".Softmax"] == 0 and ops[".LayerNormalization"] == 0
    ctx = engine.create_execution_context()
    rng = np.random.default_rng()
    for n, s in [(1, 5), (3, 13)]:
        feeds = token_feeds(n, s, rng)
        want = plain.infer(feeds)
        got = ctx.infer(feeds)
        assert_outputs_close(got, want)

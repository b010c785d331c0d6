"""A served model: engines loaded or built (and cached) from the repository, the configuration
completed and checked against the engine, requests refused before they reach it, and results
equal to the engine run directly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tensorkiln.builder import Builder
from tensorkiln.errors import InputError, ModelLoadError
from tensorkiln.serve import ModelRepository
from tensorkiln.serve.model import PinnedPool, ServedModel
from tests.serve.test_repository import CONFIG, DIGITS, _model


def _load(root: Path, name: str = "digits", **kw) -> ServedModel:
    entry = ModelRepository(root).read(name)
    return ServedModel.load(entry, entry.versions[-1], **kw)


def test_an_onnx_version_is_built_cached_and_agrees_with_the_engine(tmp_path):
    _model(tmp_path / "repo")
    cache = tmp_path / "cache"
    served = _load(tmp_path / "repo", cache_dir=cache)
    assert len(list(cache.glob("*.engine"))) == 1 and served.instances == 2
    again = _load(tmp_path / "repo", cache_dir=cache)  # (from the cache: no second file)
    assert len(list(cache.glob("*.engine"))) == 1
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    x = np.random.default_rng().standard_normal((5, 1, 8, 8)).astype(np.float32)
    assert served.check({"input": x}) == 5
    want = direct.infer({"input": x})["logits"]
    for model in (served, again):
        np.testing.assert_allclose(model.infer({"input": x})["logits"], want, rtol=1e-5, atol=1e-6)
    meta = served.metadata()
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 1, 8, 8]}]
    assert meta["outputs"] == [{"name": "logits", "datatype": "FP32", "shape": [-1, 10]}]


def test_a_config_without_tensors_is_completed_from_the_engine(tmp_path):
    _model(tmp_path, config="max_batch_size: 8")
    served = _load(tmp_path)
    assert [(t.name, list(t.dims)) for t in served.config.input] == [("input", [1, 8, 8])]
    assert [(t.name, list(t.dims)) for t in served.config.output] == [("logits", [10])]
    with pytest.raises(InputError, match="batch of 9; the model takes 1 to 8"):
        served.check({"input": np.zeros((9, 1, 8, 8), np.float32)})


@pytest.mark.parametrize(
    "config,message",
    [
        ("max_batch_size: 4 input [ { name: 'image' data_type: TYPE_FP32 dims: [1, 8, 8] } ]",
         "input 'image' is not the engine's; its inputs are 'input'"),
        ("max_batch_size: 4 input [ { name: 'input' data_type: TYPE_INT64 dims: [1, 8, 8] } ]",
         "input 'input' is INT64 in the config and FP32 in the engine"),
        ("max_batch_size: 4 input [ { name: 'input' data_type: TYPE_FP32 dims: [8, 8] } ]",
         r"dims \[8, 8\] in the config and \[1, 8, 8\] in the engine \(batch dimension left out\)"),
        ("max_batch_size: 4 output [ { name: 'logits' data_type: TYPE_FP32 dims: [12] } ]",
         r"output 'logits' has dims \[12\]"),
    ],
)  # fmt: skip
def test_a_config_that_disagrees_with_the_engine_is_refused(tmp_path, config, message):
    _model(tmp_path, config=config)
    with pytest.raises(ModelLoadError, match=message):
        _load(tmp_path)


def test_requests_the_engine_must_not_see_are_refused(tmp_path):
    _model(tmp_path)
    served = _load(tmp_path)
    good = np.zeros((2, 1, 8, 8), np.float32)
    cases = [
        ({"image": good}, "has no input 'image'; its inputs are 'input'"),
        ({}, "lacks input 'input'"),
        ({"input": good.astype(np.float64)}, "input 'input' is FP32, the request gives FP64"),
        ({"input": np.zeros((2, 8, 8), np.float32)}, r"has shape \[2, 8, 8\]; the model takes \[-1, 1, 8, 8\]"),
        ({"input": np.zeros((0, 1, 8, 8), np.float32)}, "batch of 0"),
        ({"input": np.zeros((17, 1, 8, 8), np.float32)}, "batch of 17; the model takes 1 to 16"),
        ({"input": np.zeros((), np.float32)}, "needs a batch dimension"),
    ]  # fmt: skip
    for feeds, message in cases:
        with pytest.raises(InputError, match=message):
            served.check(feeds)


def test_a_model_without_a_batch_dimension(tmp_path):
    _model(tmp_path, config="max_batch_size: 0")
    served = _load(tmp_path)
    assert served.metadata()["inputs"][0]["shape"] == [-1, 1, 8, 8]  # (the engine's own dims)
    x = np.random.default_rng().standard_normal((3, 1, 8, 8)).astype(np.float32)
    assert served.check({"input": x}) == 1


def test_a_damaged_engine_file_is_a_load_error(tmp_path):
    folder = _model(tmp_path, config=None, filename="model.engine")
    (folder / "1" / "model.engine").write_bytes(b"not an engine at all")
    with pytest.raises(ModelLoadError, match="model 'digits' version 1"):
        _load(tmp_path)


def test_an_engine_version_is_served_as_built(tmp_path):
    engine = Builder("reference").build(str(DIGITS), progress=False)
    folder = _model(tmp_path, config=CONFIG, versions=())
    (folder / "4").mkdir()
    engine.save(folder / "4" / "model.engine")
    served = _load(tmp_path)
    assert served.version == 4
    x = np.random.default_rng().standard_normal((3, 1, 8, 8)).astype(np.float32)
    want = engine.create_execution_context().infer({"input": x})["logits"]
    np.testing.assert_allclose(served.infer({"input": x})["logits"], want, rtol=1e-6)


@pytest.mark.parametrize(
    "optimization,sizes",
    [
        ("", (1, 2, 4, 8, 16, 12)),  # (max_batch_size 12: the powers of two below, and 12)
        ("graph_spec [ { batch_size: 3 }, { batch_size: 8 }, { batch_size: 40 } ]", (3, 8, 12)),
    ],
)
def test_graph_batch_sizes_follow_the_config(tmp_path, optimization, sizes):
    from tensorkiln.serve.model import _graph_batches

    config = f"max_batch_size: 12 optimization {{ cuda {{ graphs: true {optimization} }} }}"
    _model(tmp_path, config=config)
    entry = ModelRepository(tmp_path).read("digits")
    want = tuple(sorted(s for s in sizes if s <= 12))
    assert _graph_batches(entry.config) == want


def test_a_batch_padded_up_to_a_graph_size_returns_only_its_own_rows(tmp_path):
    # (the reference backend captures no graphs: the padding is set as a GPU engine's would be)
    _model(tmp_path, config="max_batch_size: 16 optimization { cuda { graphs: true } }")
    served = _load(tmp_path)
    assert served.graph_batches == ()  # (no CUDA graphs on the reference backend)
    served.graph_batches = (1, 2, 4, 8, 16)
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    rng = np.random.default_rng()
    for rows in (1, 3, 5, 16):
        x = rng.standard_normal((rows, 1, 8, 8)).astype(np.float32)
        got = served.infer({"input": x})["logits"]
        assert got.shape == (rows, 10)
        want = direct.infer({"input": x})["logits"]
        # (float32 sums blocked differently at the padded batch size: error relative to the
        # logits' scale, not to each logit, which may be near zero)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * abs(want).max())


def test_a_batch_of_requests_is_joined_padded_and_split_back(tmp_path):
    _model(tmp_path, config="max_batch_size: 16 optimization { cuda { graphs: true } }")
    served = _load(tmp_path)
    served.graph_batches = (1, 2, 4, 8, 16)
    direct = Builder("reference").build(str(DIGITS), progress=False).create_execution_context()
    rng = np.random.default_rng()
    requests = [{"input": rng.standard_normal((n, 1, 8, 8)).astype(np.float32)} for n in (2, 1, 3)]
    for _ in range(2):  # (the second batch reuses the thread's buffer)
        results = served.infer_batch(requests)
        for feeds, got in zip(requests, results):
            want = direct.infer(feeds)["logits"]
            # (float32 sums blocked differently at another batch size: error relative to the
            # logits' scale, not to each logit, which may be near zero)
            np.testing.assert_allclose(got["logits"], want, rtol=1e-5, atol=1e-5 * abs(want).max())
        requests = requests[::-1]


def test_the_pinned_pool_gives_nothing_where_memory_cannot_be_page_locked():
    """Without a GPU, page-locked memory cannot be had: the pool says so (its caller receives
    into pageable memory), and the refused bytes do not count against its limit."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here (tests/gpu/test_serve_gpu.py covers the pool)")
    pool = PinnedPool(limit=1 << 20)
    assert pool.take(4096) is None
    assert pool.used == 0
    assert pool.take(2 << 20) is None  # (over the limit)
    assert pool.used == 0

"""The model repository in Triton's layout: configs (pbtxt and JSON) parsed by the protocol's own
schema, versions and their policy, and every malformed or hostile repository refused with a
message naming the model and the problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from tensorkiln.errors import ModelLoadError
from tensorkiln.serve import ModelRepository, protocol

DIGITS = Path(__file__).resolve().parents[2] / "examples" / "digits_cnn.onnx"

CONFIG = """
name: "digits"
max_batch_size: 16
input [ { name: "input" data_type: TYPE_FP32 dims: [ 1, 8, 8 ] } ]
output [ { name: "logits" data_type: TYPE_FP32 dims: [ 10 ] } ]
dynamic_batching { preferred_batch_size: [ 4, 8 ] max_queue_delay_microseconds: 500 }
instance_group [ { count: 2 kind: KIND_CPU } ]
"""


def _model(root: Path, name: str = "digits", config: str | None = CONFIG,
           versions: tuple = (1,), filename: str = "model.onnx") -> Path:  # fmt: skip
    folder = root / name
    folder.mkdir(parents=True)
    if config is not None:
        (folder / "config.pbtxt").write_text(config)
    for v in versions:
        (folder / str(v)).mkdir()
        (folder / str(v) / filename).write_bytes(DIGITS.read_bytes())
    return folder


def digit_inputs(count: int) -> list[np.ndarray]:
    """``count`` fresh random inputs of the digits model, each of 1 to 3 rows."""
    rng = np.random.default_rng()
    return [
        rng.standard_normal((int(rng.integers(1, 4)), 1, 8, 8)).astype(np.float32)
        for _ in range(count)
    ]


def test_a_triton_repository_reads_as_triton_reads_it(tmp_path):
    _model(tmp_path, versions=(1, 3, 2))
    (tmp_path / "digits" / "notes").mkdir()  # (not a version: skipped)
    (tmp_path / "digits" / "0").mkdir()  # (version 0 is not a version either)
    repo = ModelRepository(tmp_path)
    entry = repo.read("digits")
    assert [v.version for v in entry.versions] == [3]  # the default policy: the latest one
    assert entry.versions[0].kind == "onnx" and entry.versions[0].path.name == "model.onnx"
    assert entry.max_batch_size == 16
    assert list(entry.config.dynamic_batching.preferred_batch_size) == [4, 8]
    assert entry.config.instance_group[0].count == 2
    assert [protocol.config_type_name(t.data_type) for t in entry.config.input] == ["FP32"]
    assert repo.index() == [{"name": "digits", "version": "3"}]


def test_json_configs_and_version_policies(tmp_path):
    folder = _model(tmp_path, config=None, versions=(1, 2, 3))
    cfg = json.loads(json.dumps({"max_batch_size": 4, "version_policy": {"all": {}}}))
    (folder / "config.json").write_text(json.dumps(cfg))
    repo = ModelRepository(tmp_path)
    assert [v.version for v in repo.read("digits").versions] == [1, 2, 3]
    cfg["version_policy"] = {"specific": {"versions": [3, 1]}}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert [v.version for v in repo.read("digits").versions] == [1, 3]
    cfg["version_policy"] = {"latest": {"num_versions": 2}}
    (folder / "config.json").write_text(json.dumps(cfg))
    assert [v.version for v in repo.read("digits").versions] == [2, 3]
    cfg["version_policy"] = {"specific": {"versions": [7]}}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=r"asks for versions \[7\].*has \[1, 2, 3\]"):
        repo.read("digits")


def test_a_model_without_a_config_is_served_from_its_file(tmp_path):
    _model(tmp_path, name="bare", config=None, filename="model.engine")
    entry = ModelRepository(tmp_path).read("bare")
    assert entry.config.name == "bare" and entry.versions[0].kind == "engine"


@pytest.mark.parametrize(
    "config,message",
    [
        ('name: "other"', "names the model 'other'"),
        ("max_batch_size: 4 input [ { name: 'x' } ]", "input 'x' has no data_type"),
        ("max_batch_size: -1", "max_batch_size is -1"),
        ("max_batch_size: 4 dynamic_batching { preferred_batch_size: 8 }", r"not within 1..max_batch_size \(4\)"),
        ("dynamic_batching { }", "needs a batch dimension"),
        ("sequence_batching { }", "sequence_batching is not supported"),
        ('platform: "tensorrt_plan"', "not a tensorkiln engine"),
        ('backend: "python"', "backend 'python' is not served"),
        ("max_batch_size: 4 unknown_field: 3", "config.pbtxt"),
        ("max_batch_size: {", "config.pbtxt"),
        ('default_model_filename: "../../etc/passwd"', "must be a file name, not a path"),
        ("input [ { name: 'a' data_type: TYPE_FP32 dims: [ -2 ] } ]", "dims \\[-2\\]"),
        ("input [ { name: 'a' data_type: TYPE_FP32 }, { name: 'a' data_type: TYPE_FP32 } ]",
         "input 'a' is listed twice"),
        ("version_policy { latest { num_versions: 0 } }", "num_versions of 1 or more"),
    ],
)  # fmt: skip
def test_bad_configs_are_named(tmp_path, config, message):
    _model(tmp_path, config=config)
    with pytest.raises(ModelLoadError, match=message) as err:
        ModelRepository(tmp_path).read("digits")
    assert "model 'digits'" in str(err.value)


def test_the_index_lists_a_broken_model_with_its_reason(tmp_path):
    _model(tmp_path)
    _model(tmp_path, name="broken", config="max_batch_size: -3")
    index = ModelRepository(tmp_path).index()
    assert {"name": "digits", "version": "1"} in index
    broken = next(x for x in index if x["name"] == "broken")
    assert broken["state"] == "UNAVAILABLE" and "max_batch_size is -3" in broken["reason"]


def test_hostile_repositories_are_refused(tmp_path):
    repo_root = tmp_path / "repo"
    repo_root.mkdir()
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "model.onnx").write_bytes(DIGITS.read_bytes())
    # a version's model file that is a link out of the model's folder
    folder = _model(repo_root, versions=())
    (folder / "1").mkdir()
    os.symlink(outside / "model.onnx", folder / "1" / "model.onnx")
    repo = ModelRepository(repo_root)
    with pytest.raises(ModelLoadError, match="leads outside"):
        repo.read("digits")
    # a model folder that is a link elsewhere
    os.symlink(outside, repo_root / "linked")
    with pytest.raises(ModelLoadError, match="leads outside"):
        repo.read("linked")
    # names that are paths
    for name in ("../outside", "a/b", "..", "", "digits\n"):
        with pytest.raises(ModelLoadError, match="not a model name"):
            repo.read(name)
    # a config too large to be one
    big = _model(repo_root, name="big")
    (big / "config.pbtxt").write_text("max_batch_size: 1\n" + "#" * (1 << 20))
    with pytest.raises(ModelLoadError, match="over the 1,048,576"):
        repo.read("big")
    # not text
    odd = _model(repo_root, name="odd")
    (odd / "config.pbtxt").write_bytes(b"\xff\xfe\x00bad")
    with pytest.raises(ModelLoadError, match="not UTF-8"):
        repo.read("odd")


def test_missing_things_are_named(tmp_path):
    with pytest.raises(ModelLoadError, match="is not a folder"):
        ModelRepository(tmp_path / "nowhere")
    _model(tmp_path, versions=())
    repo = ModelRepository(tmp_path)
    with pytest.raises(ModelLoadError, match="no version to serve"):
        repo.read("digits")
    with pytest.raises(ModelLoadError, match="no folder 'absent'"):
        repo.read("absent")
    (tmp_path / "digits" / "2").mkdir()
    with pytest.raises(ModelLoadError, match=r"version 2: no model\.engine or model\.onnx"):
        repo.read("digits")


def test_the_platform_must_match_the_file(tmp_path):
    _model(tmp_path, config='platform: "tensorkiln_engine"')
    with pytest.raises(ModelLoadError, match=r"expects an engine file, found model\.onnx"):
        ModelRepository(tmp_path).read("digits")

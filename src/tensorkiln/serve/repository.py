"""A model repository in Triton's layout: what ``tensorkiln serve --model-repository DIR`` reads.

::

    DIR/
      <model>/
        config.pbtxt        (or config.json: the same ModelConfig schema, as Triton takes both)
        1/model.engine      (a tensorkiln engine)
        2/model.onnx        (an ONNX model: built when loaded)

A model's folder name is its name. Its versions are the subfolders named by positive integers
(others are skipped, as Triton does), and its version policy picks which of them are served:
``latest { num_versions: N }`` (the default, N = 1), ``all``, or ``specific { versions: [...] }``.
In a version folder the model file is ``model.engine``, else ``model.onnx``, or the config's
``default_model_filename``.

The repository may come from someone else, so nothing in it is trusted. A config file is read
only up to 1 MiB and must parse as the schema. A file name from the config is a plain name, never
a path. Every file read resolves, symlinks included, to a place inside the model's own folder.
Anything wrong is a :class:`ModelLoadError` naming the model, the file and the problem.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from google.protobuf import json_format, text_format

from tensorkiln.errors import ModelLoadError
from tensorkiln.serve import protocol

CONFIG_LIMIT = 1 << 20  # bytes: a config.pbtxt larger than this is not a model configuration
MODEL_FILES = ("model.engine", "model.onnx")
CONFIG_FILES = ("config.pbtxt", "config.json")
_SCAN_LIMIT = 1000  # folder entries a poll looks at per folder (a model has a few)
PLATFORMS = {
    "": None,  # (taken from the version's file)
    "tensorkiln_engine": "engine",
    "onnxruntime_onnx": "onnx",  # (a Triton repository's ONNX model: built on load)
}
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


@dataclass(frozen=True)
class ModelVersion:
    """One version folder's model file."""

    version: int
    path: Path
    kind: str  # "engine" or "onnx"


@dataclass
class ModelEntry:
    """A model of the repository: its configuration and the versions its policy serves."""

    name: str
    directory: Path
    config: Any  # inference.ModelConfig
    versions: list[ModelVersion] = field(default_factory=list)

    @property
    def max_batch_size(self) -> int:
        return int(self.config.max_batch_size)


class ModelRepository:
    """The models under ``root``: :meth:`index` lists them, :meth:`read` reads one."""

    def __init__(self, root: str | Path) -> None:
        path = Path(root)
        if not path.is_dir():
            raise ModelLoadError(f"model repository '{root}' is not a folder")
        self.root = path.resolve()

    def names(self) -> list[str]:
        """The model folders, sorted (hidden entries and files skipped)."""
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")
        )

    def index(self) -> list[dict[str, Any]]:
        """Each model with its versions, as the repository API's index lists them; a model
        that cannot be read is listed with the reason."""
        out = []
        for name in self.names():
            try:
                entry = self.read(name)
            except ModelLoadError as exc:
                out.append({"name": name, "state": "UNAVAILABLE", "reason": str(exc)})
                continue
            for v in entry.versions:
                out.append({"name": name, "version": str(v.version)})
        return out

    def fingerprint(self, name: str) -> tuple:
        """What a change to model ``name`` changes: the sizes and modification times of its
        configuration files and of the files in its version folders (``()``: no such folder).
        Poll mode reloads a model whose fingerprint changed."""
        directory = self.root / name
        try:
            entries = sorted(os.scandir(directory), key=lambda e: e.name)[:_SCAN_LIMIT]
        except OSError:
            return ()
        out = []
        for e in entries:
            try:
                if e.name in CONFIG_FILES and e.is_file():
                    st = e.stat()
                    out.append((e.name, st.st_size, st.st_mtime_ns))
                elif e.name.isdigit() and e.is_dir(follow_symlinks=False):
                    for f in sorted(os.scandir(e.path), key=lambda f: f.name)[:_SCAN_LIMIT]:
                        st = f.stat()
                        out.append((f"{e.name}/{f.name}", st.st_size, st.st_mtime_ns))
            except OSError:  # (changed while read: the next poll sees it)
                out.append((e.name, -1, -1))
        return tuple(out) or (("", 0, 0),)

    def read(self, name: str) -> ModelEntry:
        """Model ``name``'s configuration and served versions, checked."""
        if not _NAME.fullmatch(name) or name in (".", ".."):
            raise ModelLoadError(f"'{name}' is not a model name (letters, digits, '_', '-', '.')")
        directory = self.root / name
        if not directory.is_dir():
            raise ModelLoadError(f"model '{name}': no folder '{name}' in {self.root}")
        directory = _inside(directory, self.root, f"model '{name}'")
        config = read_config(directory, name)
        entry = ModelEntry(name, directory, config)
        entry.versions = _served(entry, _versions(entry))
        if not entry.versions:
            raise ModelLoadError(
                f"model '{name}': no version to serve in {directory} (version folders are named "
                f"1, 2, ...; each holds {' or '.join(MODEL_FILES)})"
            )
        return entry


def read_config(directory: Path, name: str) -> Any:
    """The model folder's config.pbtxt or config.json as an ``inference.ModelConfig``, checked
    (its name, if given, is the folder's; batch size, inputs and outputs are sound)."""
    config = protocol.model_config()
    pbtxt, js = directory / "config.pbtxt", directory / "config.json"
    where = pbtxt if pbtxt.exists() else js if js.exists() else None
    if where is not None:
        text = _read_text(where, directory, name)
        try:
            if where.suffix == ".pbtxt":
                text_format.Parse(text, config)
            else:
                json_format.Parse(text, config)
        except (text_format.ParseError, json_format.ParseError, json.JSONDecodeError) as exc:
            raise ModelLoadError(f"model '{name}': {where.name}: {exc}") from None
    if config.name and config.name != name:
        raise ModelLoadError(
            f"model '{name}': {where.name if where else 'config'} names the model "
            f"'{config.name}'; a model's name is its folder's ('{name}')"
        )
    config.name = name
    _check_config(config, name)
    return config


def _check_config(config: Any, name: str) -> None:
    what = f"model '{name}'"
    if config.backend not in ("", "tensorkiln"):
        raise ModelLoadError(
            f"{what}: backend '{config.backend}' is not served here; leave it out or give "
            "'tensorkiln'"
        )
    if config.platform not in PLATFORMS:
        raise ModelLoadError(
            f"{what}: platform '{config.platform}' is not served here; give one of "
            f"{', '.join(repr(p) for p in PLATFORMS if p)} or leave it out"
            + (" (a TensorRT plan is not a tensorkiln engine: build one from the ONNX model)"
               if config.platform == "tensorrt_plan" else "")
        )  # fmt: skip
    if config.max_batch_size < 0:
        raise ModelLoadError(f"{what}: max_batch_size is {config.max_batch_size}; give 0 or more")
    if config.WhichOneof("scheduling_choice") not in (None, "dynamic_batching"):
        raise ModelLoadError(
            f"{what}: {config.WhichOneof('scheduling_choice')} is not supported; dynamic_batching "
            "or none"
        )
    if config.HasField("dynamic_batching") and config.max_batch_size == 0:
        raise ModelLoadError(
            f"{what}: dynamic_batching needs a batch dimension (max_batch_size > 0)"
        )
    for size in config.dynamic_batching.preferred_batch_size:
        if not 0 < size <= config.max_batch_size:
            raise ModelLoadError(
                f"{what}: preferred_batch_size {size} is not within 1..max_batch_size "
                f"({config.max_batch_size})"
            )
    for kind, tensors in (("input", config.input), ("output", config.output)):
        seen = set()
        for t in tensors:
            if not t.name:
                raise ModelLoadError(f"{what}: an {kind} without a name")
            if t.name in seen:
                raise ModelLoadError(f"{what}: {kind} '{t.name}' is listed twice")
            seen.add(t.name)
            if any(d < -1 for d in t.dims):
                raise ModelLoadError(
                    f"{what}: {kind} '{t.name}' has dims {list(t.dims)}; each is -1 (any size) "
                    "or a size"
                )
            if t.data_type == 0:  # TYPE_INVALID: left out
                raise ModelLoadError(f"{what}: {kind} '{t.name}' has no data_type")
    for group in config.instance_group:
        if group.count < 0:
            raise ModelLoadError(f"{what}: instance_group count {group.count} is negative")
    policy = config.version_policy
    if policy.WhichOneof("policy_choice") == "latest" and policy.latest.num_versions == 0:
        raise ModelLoadError(f"{what}: version_policy latest needs num_versions of 1 or more")
    filename = config.default_model_filename
    if filename and (filename != Path(filename).name or filename in (".", "..")):
        raise ModelLoadError(
            f"{what}: default_model_filename '{filename}' must be a file name, not a path"
        )


def _versions(entry: ModelEntry) -> list[ModelVersion]:
    """Every version folder with its model file, in version order."""
    out = []
    for p in entry.directory.iterdir():
        if not (p.is_dir() and p.name.isdigit() and p.name.isascii()) or int(p.name) == 0:
            continue  # (Triton skips what is not a positive version number)
        version = int(p.name)
        out.append(_model_file(entry, p, version))
    return sorted(out, key=lambda v: v.version)


def _model_file(entry: ModelEntry, folder: Path, version: int) -> ModelVersion:
    what = f"model '{entry.name}' version {version}"
    wanted = PLATFORMS[entry.config.platform]
    names = [entry.config.default_model_filename] if entry.config.default_model_filename else []
    names += [n for n in MODEL_FILES if n not in names]
    for n in names:
        path = folder / n
        if path.exists():
            path = _inside(path, entry.directory, what)
            if not path.is_file():
                raise ModelLoadError(f"{what}: {n} is not a file")
            kind = "onnx" if n.endswith(".onnx") else "engine"
            if wanted is not None and kind != wanted:
                raise ModelLoadError(
                    f"{what}: platform '{entry.config.platform}' expects "
                    f"{'an engine' if wanted == 'engine' else 'an ONNX model'} file, found {n}"
                )
            return ModelVersion(version, path, kind)
    raise ModelLoadError(f"{what}: no {' or '.join(names)} in {folder}")


def _served(entry: ModelEntry, versions: list[ModelVersion]) -> list[ModelVersion]:
    """The versions the config's policy serves (Triton's default: the latest one)."""
    policy = entry.config.version_policy
    choice = policy.WhichOneof("policy_choice")
    if choice == "all":
        return versions
    if choice == "specific":
        have = {v.version: v for v in versions}
        missing = [n for n in policy.specific.versions if n not in have]
        if missing:
            raise ModelLoadError(
                f"model '{entry.name}': version_policy asks for versions {missing}, which the "
                f"folder lacks (it has {sorted(have) or 'none'})"
            )
        return [have[n] for n in sorted(set(policy.specific.versions))]
    n = policy.latest.num_versions if choice == "latest" else 1
    return versions[-n:] if versions else []


def _inside(path: Path, root: Path, what: str) -> Path:
    """``path`` resolved, symlinks followed; refused unless it stays inside ``root``."""
    real = path.resolve()
    if real != root.resolve() and not real.is_relative_to(root.resolve()):
        raise ModelLoadError(
            f"{what}: '{path.name}' leads outside the model repository's folder ({real}); refused"
        )
    return real


def _read_text(path: Path, directory: Path, name: str) -> str:
    path = _inside(path, directory, f"model '{name}'")
    size = path.stat().st_size
    if size > CONFIG_LIMIT:
        raise ModelLoadError(
            f"model '{name}': {path.name} is {size:,} bytes, over the {CONFIG_LIMIT:,} a model "
            "configuration may take"
        )
    try:
        return path.read_bytes()[:CONFIG_LIMIT].decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ModelLoadError(f"model '{name}': {path.name} is not UTF-8 text ({exc})") from None

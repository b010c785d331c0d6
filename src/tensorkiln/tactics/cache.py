"""The timing cache: tactic measurements keyed by what determines them, reused across builds.

A key covers the op, its attributes (a Pointwise body by its printed text), the input shapes and
dtypes, which inputs are weights, the device and the library versions; a rebuild of the same model
(or another model with the same layers) on the same machine finds every layer in the cache and
measures nothing. The file is JSON (never pickle), written atomically.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tensorkiln.errors import BuildError

FORMAT = "tensorkiln-timing-cache"
VERSION = 2  # 2: eager and CUDA-graph choices


class TimingCache:
    """In memory: key -> {"tactic": name, "timings_ms": {name: ms}, ...}; load/save to one file."""

    def __init__(self, entries: dict[str, dict] | None = None) -> None:
        self.entries: dict[str, dict] = dict(entries or {})
        self.path: Path | None = None  # the file it was loaded from (load)
        self.hits = 0
        self.misses = 0

    @staticmethod
    def key(signature: dict[str, Any]) -> str:
        text = json.dumps(signature, sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(text.encode()).hexdigest()

    def get(self, key: str, usable: Callable[[dict], bool] | None = None) -> dict | None:
        """The entry of ``key`` (None, a miss, where there is none or ``usable`` turns it down)."""
        hit = self.entries.get(key)
        if hit is not None and usable is not None and not usable(hit):
            hit = None
        if hit is None:
            self.misses += 1
        else:
            self.hits += 1
        return hit

    def put(self, key: str, entry: dict) -> None:
        """Store a layer's choice: at least "tactic" and "timings_ms" (name -> ms)."""
        self.entries[key] = dict(entry)

    @classmethod
    def load(cls, path: str | os.PathLike) -> TimingCache:
        """Read ``path``; a missing file is an empty cache, a damaged one a BuildError."""
        path = Path(path)
        cache = cls._read(path)
        cache.path = path
        return cache

    @classmethod
    def _read(cls, path: Path) -> TimingCache:
        if not path.exists():
            return cls()
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BuildError(
                f"timing cache '{path}' cannot be read ({exc}); delete it or pass another file"
            ) from None
        ok = (
            isinstance(data, dict)
            and data.get("format") == FORMAT
            and isinstance(data.get("entries"), dict)
            and all(
                isinstance(v, dict)
                and isinstance(v.get("tactic"), str)
                and isinstance(v.get("timings_ms"), dict)
                for v in data["entries"].values()
            )
        )
        if not ok:
            raise BuildError(
                f"'{path}' is not a tensorkiln timing cache (or it is damaged); delete it or pass "
                "another file"
            )
        if data.get("version") != VERSION:
            return cls()  # an older layout: measure again, and overwrite it on save
        return cls(data["entries"])

    def save(self, path: str | os.PathLike) -> None:
        path = Path(path)
        text = json.dumps({"format": FORMAT, "version": VERSION, "entries": self.entries})
        fd, tmp = tempfile.mkstemp(dir=path.parent or ".", prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

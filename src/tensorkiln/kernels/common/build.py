"""Shared libraries compiled from the package's own sources at first use, kept per user.

The cpu backend's native kernels (kernels/cpu/native.c) and the native gRPC transport
(serve/native/transport.cc) are built with the system compiler into one cache folder
(``$TENSORKILN_CACHE_DIR``, else ``$XDG_CACHE_HOME/tensorkiln``, else ``~/.cache/tensorkiln``;
then ``native/``). The folder must belong to the user and not be writable by others; a
library's file name is the SHA-256 of everything that went into it (source, compiler and its
version, flags, whatever else the caller names), and it is written under a temporary name and
renamed into place, so a library found there was built here from that source. No torch.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger("tensorkiln")


def cache_dir() -> Path:
    """Where built libraries are kept (created private to the user when missing)."""
    root = os.environ.get("TENSORKILN_CACHE_DIR") or os.environ.get("XDG_CACHE_HOME")
    base = Path(root) if root else Path.home() / ".cache"
    folder = base if os.environ.get("TENSORKILN_CACHE_DIR") else base / "tensorkiln"
    folder = folder / "native"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise RuntimeError(f"cache folder {folder} is not private to this user")
    return folder


def find_program(env: str, names: Iterable[str]) -> str | None:
    """The path of ``$env`` where set, else of the first of ``names`` on the PATH."""
    for name in (os.environ.get(env, "").strip(), *names):
        if name and (path := shutil.which(name)):
            return path
    return None


def run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


def cached_library(
    stem: str,
    source: Path,
    key: Iterable[bytes],
    commands: Iterable[list[str]],
    timeout: float = 120,
) -> Path:
    """``source`` built into the cache folder as ``<stem>-<hash>.so`` (the hash of the source
    and of ``key``), or the one already there. Each of ``commands`` is tried in turn until one
    succeeds, its ``{src}`` and ``{out}`` replaced by the source's copy and the library's
    temporary path; RuntimeError with the last one's error output when none does."""
    text = source.read_bytes()
    digest = hashlib.sha256(text + b"\0")
    for part in key:
        digest.update(part + b"\0")
    folder = cache_dir()
    target = folder / f"{stem}-{digest.hexdigest()[:32]}.so"
    if target.is_file() and not target.is_symlink():
        return target
    log.info("tensorkiln: building %s from %s", stem, source.name)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        out = Path(tmp) / "lib.so"
        src = Path(tmp) / source.name
        src.write_bytes(text)
        for command in commands:
            done = run([{"{src}": str(src), "{out}": str(out)}.get(a, a) for a in command], timeout)
            if done.returncode == 0:
                break
            log.info("tensorkiln: %s failed: %s", " ".join(command), done.stderr[-300:])
        else:  # (every command failed: the last one's words)
            raise RuntimeError(f"{command[0]} failed: {done.stderr.strip()[-300:]}")
        os.replace(out, target)
    return target

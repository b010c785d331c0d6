"""PNG plots for people who would rather look than read: per-layer error (``compare --layerwise
--plot``), and each calibrated tensor's histogram with the range its calibrator chose, beside the
other calibrators' choices (``debug precision --plot``). Needs matplotlib (``pip install
matplotlib``, or tensorkiln's ``plot`` extra)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from tensorkiln.cli.common import CLIError
from tensorkiln.precision.calibrators import CALIBRATORS, Histogram, choose_amax

_MAX_FILES = 2000  # histograms written by one call


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise CLIError("plots need matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def layer_errors(
    rows: list[dict],
    threshold: float | None,
    path: str | Path,
    ylabel: str = "relative L2 error",
    title: str = "error of each layer's output against the reference",
) -> Path:
    """Each row's error (``rel_l2``) in order (log scale), the threshold, failing rows red."""
    plt = _pyplot()
    values = [max(float(r.get("rel_l2", np.nan)), 1e-12) for r in rows]
    colors = ["tab:red" if not r["passed"] else "tab:blue" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.25 * len(rows) + 2), 4.5))
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if threshold:
        ax.axhline(threshold, color="black", linestyle="--", linewidth=1, label="tolerance")
        ax.legend()
    step = max(1, len(rows) // 40)
    ax.set_xticks(range(0, len(rows), step))
    ax.set_xticklabels([rows[i]["layer"][-32:] for i in range(0, len(rows), step)],
                       rotation=90, fontsize=7)  # fmt: skip
    fig.tight_layout()
    return _save(fig, plt, Path(path))


def histograms(
    hists: Mapping[str, Histogram],
    chosen: Mapping[str, float],
    precision: str,
    folder: str | Path,
) -> list[Path]:
    """One PNG per tensor in ``folder``: |x| histogram (log counts), the chosen range, and where
    each other calibrator would have put it. File names come from tensor names, made safe."""
    plt = _pyplot()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    used: set[str] = set()
    for name, h in list(hists.items())[:_MAX_FILES]:
        if h.width == 0.0 or not len(h.counts):
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        edges = np.arange(len(h.counts)) * h.width
        ax.bar(edges, h.counts, width=h.width, align="edge", color="tab:gray")
        ax.set_yscale("log")
        ax.set_xlabel("|x|")
        ax.set_ylabel("count")
        ax.set_title(name[-60:])
        for k, method in enumerate(m for m in CALIBRATORS if m != "entropy" or precision == "int8"):
            amax = choose_amax(h, method, precision)
            ax.axvline(
                amax, color=f"C{k}", linestyle="--", linewidth=1, label=f"{method} {amax:.3g}"
            )
        if name in chosen:
            ax.axvline(chosen[name], color="black", linewidth=2, label=f"chosen {chosen[name]:.3g}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        written.append(_save(fig, plt, folder / _file_name(name, used)))
    return written


def _file_name(name: str, used: set[str]) -> str:
    """A tensor name as a file name of letters, digits, '-', '_' and '.', unique in ``used``."""
    base = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("._")[:100] or "tensor"
    candidate, k = base, 1
    while candidate in used:
        candidate, k = f"{base}_{k}", k + 1
    used.add(candidate)
    return candidate + ".png"


def _save(fig: Any, plt: Any, path: Path) -> Path:
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise CLIError(f"cannot write '{path}': {exc.strerror or exc}") from None
    finally:
        plt.close(fig)
    return path

"""Peak arithmetic rates and memory bandwidths of known GPUs: the roofs of a layer's roofline.

Numbers are NVIDIA's datasheet figures, dense (without structured sparsity, which the datasheets
quote at twice these), in TFLOP/s (TOP/s for int8) and GB/s of HBM bandwidth:

* H200 SXM (H200 Tensor Core GPU datasheet, 2024): fp64 34, fp32 67, tf32 494.5, fp16/bf16
  989.5, fp8/int8 1979; 4800 GB/s.
* H100 SXM and H100 PCIe (H100 Tensor Core GPU datasheet, 2023): fp32 67 / 51, tf32 494.5 /
  378, fp16/bf16 989.5 / 756, fp8/int8 1979 / 1513; 3350 / 2000 GB/s.
* A100 (A100 Tensor Core GPU datasheet, 2021): fp32 19.5, tf32 156, fp16/bf16 312, int8 624
  (no fp8); 2039 GB/s (SXM4 80GB), 1935 (PCIe 80GB), 1555 (40GB, either form).

``fp32`` is the CUDA cores' rate (no tensor cores): the roof of every layer that is not a matrix
product, and of matrix products computed in plain fp32.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class DevicePeaks:
    """A device's peak rates by precision (TFLOP/s) and its memory bandwidth (GB/s); either
    may be missing (None, or a precision absent from ``tflops``)."""

    name: str
    tflops: dict[str, float] = field(default_factory=dict)
    gbps: float | None = None
    source: str = "datasheet"

    def compute_tflops(self, precision: str, products: bool) -> float | None:
        """The roof of a layer computing in ``precision``: the tensor cores' rate for matrix
        ``products`` (fp32 ones on the CUDA cores), the CUDA cores' fp32 rate otherwise."""
        if not products:
            return self.tflops.get("fp32")
        return self.tflops.get(precision)


def _rates(fp32: float, tf32: float, fp16: float, fp8: float | None, int8: float) -> dict:
    out = {"fp32": fp32, "tf32": tf32, "fp16": fp16, "bf16": fp16, "int8": int8}
    if fp8 is not None:
        out["fp8"] = fp8
    return out


_HOPPER_SXM = _rates(67.0, 494.5, 989.5, 1979.0, 1979.0)
_AMPERE = _rates(19.5, 156.0, 312.0, None, 624.0)

# (pattern of the lowercased device name, what to call it, rates, bandwidth); the first match
# wins. The names are torch.cuda.get_device_name's ("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-
# 40GB"); an NVL or other form with different clocks matches none and gets no roofline.
KNOWN_DEVICES: tuple[tuple[str, str, dict[str, float], float], ...] = (
    (r"\bh200\b(?!.*nvl)", "H200 SXM", _HOPPER_SXM, 4800.0),
    (r"\bh100\b(?!.*(nvl|pcie)).*(sxm|hbm3)", "H100 SXM", _HOPPER_SXM, 3350.0),
    (r"\bh100\b.*pcie", "H100 PCIe", _rates(51.0, 378.0, 756.0, 1513.0, 1513.0), 2000.0),
    (r"\ba100\b.*sxm.*80", "A100 SXM4 80GB", _AMPERE, 2039.0),
    (r"\ba100\b.*80.*pcie|\ba100\b.*pcie.*80", "A100 PCIe 80GB", _AMPERE, 1935.0),
    (r"\ba100\b.*(sxm|pcie).*40|\ba100\b.*40.*(sxm|pcie)", "A100 40GB", _AMPERE, 1555.0),
)


def known_peaks(device_name: str) -> DevicePeaks | None:
    """The datasheet peaks of the device called ``device_name``; None for one not in the table
    (a CPU, another GPU)."""
    name = device_name.lower()
    for pattern, label, rates, gbps in KNOWN_DEVICES:
        if re.search(pattern, name):
            return DevicePeaks(label, dict(rates), gbps)
    return None


def device_peaks(
    device_name: str, peak_tflops: float | None = None, peak_gbps: float | None = None
) -> DevicePeaks | None:
    """The roofs to profile against: the table's peaks for ``device_name``, with ``peak_tflops``
    (for every precision and layer) and ``peak_gbps`` replacing them where given. None when
    neither is known."""
    table = known_peaks(device_name)
    if table is None and peak_tflops is None and peak_gbps is None:
        return None
    name = table.name if table is not None else device_name
    tflops = dict(table.tflops) if table is not None else {}
    if peak_tflops is not None:
        tflops = dict.fromkeys(("fp32", "tf32", "fp16", "bf16", "fp8", "int8"), peak_tflops)
    gbps = peak_gbps if peak_gbps is not None else (table.gbps if table is not None else None)
    given = peak_tflops is not None or peak_gbps is not None
    source = ("datasheet, " if table is not None else "") + "given" if given else "datasheet"
    return DevicePeaks(name, tflops, gbps, source)

"""How long INT8 calibration of ResNet-50 takes on the GPU: 512 images, entropy calibrator.

    python benchmarks/calibration_time.py DIR

Exports ResNet-50 (random weights, dynamic batch axis) to DIR, writes 16 .npy files of 32 random
224x224 images, and builds an INT8 (+fp16) engine three times through the Builder API with a
profile up to batch 256 and one timing cache; prints each build's seconds and phases (the
"calibrate" phase is the calibration) and writes DIR/calibration_time.json. The second build has
the tactic timings cached, so its time is mostly calibration; the third also reads the
calibration cache the second wrote (DIR/calib.json), so it calibrates nothing.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import numpy as np

sys.path[:0] = [
    str(Path(__file__).resolve().parents[1]),
    str(Path(__file__).resolve().parents[1] / "src"),
]

from benchmarks import _common as common  # noqa: E402
from tensorkiln.builder import Builder, BuilderConfig, OptimizationProfile  # noqa: E402


def main(out: Path) -> dict:
    # (each build phase's seconds as it ends, so that a run stopped by a time limit still shows
    # how far it got: calibration is the "calibrate" phase)
    logging.basicConfig(format="%(asctime)s %(message)s", stream=sys.stdout, force=True)
    logging.getLogger("tensorkiln.builder.builder").setLevel(logging.DEBUG)
    out.mkdir(parents=True, exist_ok=True)
    onnx_path = common.export_dynamic(
        common.make_model("resnet50"), common.image_feeds(2, 224, 0), out / "resnet50.onnx"
    )
    data = out / "calib"
    data.mkdir(exist_ok=True)
    rng = np.random.default_rng()
    for i in range(16):
        batch = rng.standard_normal((32, 3, 224, 224)).astype(np.float32)
        np.save(data / f"b{i:02d}.npy", batch)
    result: dict = {}
    cache = out / "calib.json"
    cache.unlink(missing_ok=True)
    for name in ("first_build", "second_build", "calibration_cached"):
        config = BuilderConfig()
        config.set_flag("int8")
        config.set_flag("fp16")
        config.calibration_data = str(data)
        config.calibration_batch_size = 32
        config.timing_cache = str(out / "timing.cache")
        if name != "first_build":  # (the second writes it, the third reads it)
            config.calibration_cache = str(cache)
        profile = OptimizationProfile()
        profile.set_shape("input", (1, 3, 224, 224), (256, 3, 224, 224), (256, 3, 224, 224))
        config.add_optimization_profile(profile)
        builder = Builder("cuda", device="cuda")
        t0 = time.perf_counter()
        builder.build(onnx_path, config, progress=False)
        result[name] = {
            "seconds": round(time.perf_counter() - t0, 2),
            "phases": {k: round(v, 3) for k, v in builder.last_report.phases.items()},
            "notes": builder.last_report.notes,
        }
        print(name, json.dumps(result[name]), flush=True)
    (out / "calibration_time.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(Path(sys.argv[1]))

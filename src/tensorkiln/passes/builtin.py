"""Imports every pass module so that their passes register (see :mod:`.registry`)."""

from importlib import import_module

_MODULES = (
    "cleanup",
    "fold",
    "shape",
    "fuse_conv",
    "fuse_gemm",
    "fuse_se",
    "fuse_qdq",
    "fuse_norm",
    "fuse_activation",
    "fuse_attention",
    "fuse_mha",
    "fuse_pointwise",
)

for _name in _MODULES:
    import_module(f"tensorkiln.passes.{_name}")
